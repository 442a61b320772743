package httpproxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"testing"
)

// sseServer answers every tools/call with one SSE event carrying its
// response, as the Go SDK's streamable server does.
func sseServer() http.Handler { return sseServerOf("charged") }

// sseServerOf is sseServer with text as the result's text, the event
// written in 32 KiB writes as a server's buffered writer sends it.
func sseServerOf(text string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			ID json.RawMessage `json:"id"`
		}
		b, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(b, &req)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		ev := fmt.Appendf(nil, "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":%s,\"result\":{\"content\":[{\"type\":\"text\",\"text\":\"%s\"}]}}\n\n", req.ID, text)
		for len(ev) > 0 {
			n := min(len(ev), 32<<10)
			_, _ = w.Write(ev[:n])
			ev = ev[n:]
		}
	})
}

// BenchmarkHTTPExecuted: a deduplicated tools/call with new arguments
// each time, through the proxy to a server that answers in SSE, over
// loopback HTTP/1.1 keep-alive connections; the client and the server run
// in the benchmark's process, so their costs are in the figures too (the
// same in every run: compare runs, not absolute values).
func BenchmarkHTTPExecuted(b *testing.B) {
	proxy, _ := dedupProxy(b, sseServer(), "", Options{})
	benchCalls(b, proxy.URL, 0)
}

// BenchmarkHTTPExecutedLarge: BenchmarkHTTPExecuted with a 1 MiB result,
// and BenchmarkHTTPGoProxyLarge the same calls through a plain
// httputil.ReverseProxy: the difference is what the sidecar adds to a
// large result over a proxy that only relays it.
func BenchmarkHTTPExecutedLarge(b *testing.B) {
	proxy, _ := dedupProxy(b, sseServerOf(strings.Repeat("x", 1<<20)), "", Options{})
	b.SetBytes(1 << 20)
	benchCalls(b, proxy.URL, 1<<20)
}

func BenchmarkHTTPGoProxyLarge(b *testing.B) {
	upstream := httptest.NewServer(sseServerOf(strings.Repeat("x", 1<<20)))
	b.Cleanup(upstream.Close)
	u, _ := url.Parse(upstream.URL)
	proxy := httptest.NewServer(&httputil.ReverseProxy{Rewrite: func(r *httputil.ProxyRequest) { r.SetURL(u) }, FlushInterval: -1})
	b.Cleanup(proxy.Close)
	b.SetBytes(1 << 20)
	benchCalls(b, proxy.URL, 1<<20)
}

// benchCalls makes b.N calls of charge_card with new arguments each time
// to target, each answered with a result of at least minBytes.
func benchCalls(b *testing.B, target string, minBytes int) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		i++
		body := `{"jsonrpc":"2.0","id":` + strconv.Itoa(i) + `,"method":"tools/call","params":{"name":"charge_card","arguments":{"amount":5,"card":"c-` + strconv.Itoa(i) + `"}}}`
		req, _ := http.NewRequest(http.MethodPost, target, bytes.NewReader([]byte(body)))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer caller-a")
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		data, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if !bytes.Contains(data, []byte(`"result"`)) || len(data) < minBytes {
			b.Fatalf("not a result of %d bytes or more: %.200s", minBytes, data)
		}
	}
}
