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
	"testing"
)

// sseServer answers every tools/call with one SSE event carrying its
// response, as the Go SDK's streamable server does.
func sseServer() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			ID json.RawMessage `json:"id"`
		}
		b, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(b, &req)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		_, _ = fmt.Fprintf(w, "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":%s,\"result\":{\"content\":[{\"type\":\"text\",\"text\":\"charged\"}]}}\n\n", req.ID)
	})
}

// BenchmarkHTTPExecuted: a deduplicated tools/call with new arguments
// each time, through the proxy to a server that answers in SSE, over
// loopback HTTP/1.1 keep-alive connections; the client and the server run
// in the benchmark's process, so their costs are in the figures too (the
// same in every run: compare runs, not absolute values).
func BenchmarkHTTPExecuted(b *testing.B) {
	proxy, _ := dedupProxy(b, sseServer(), "", Options{})
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		i++
		body := `{"jsonrpc":"2.0","id":` + strconv.Itoa(i) + `,"method":"tools/call","params":{"name":"charge_card","arguments":{"amount":5,"card":"c-` + strconv.Itoa(i) + `"}}}`
		req, _ := http.NewRequest(http.MethodPost, proxy.URL, bytes.NewReader([]byte(body)))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer caller-a")
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		data, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if !bytes.Contains(data, []byte(`"result"`)) {
			b.Fatalf("not a result: %s", data)
		}
	}
}

// largeSSEServer answers every tools/call with one SSE event whose
// result's text is 1 MiB, written in 32 KiB writes as a server's
// buffered writer sends it.
func largeSSEServer() http.Handler {
	text := bytes.Repeat([]byte("x"), 1<<20)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			ID json.RawMessage `json:"id"`
		}
		b, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(b, &req)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		ev := fmt.Appendf(nil, "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":%s,\"result\":{\"content\":[{\"type\":\"text\",\"text\":\"%s\"}]}}\n\n", req.ID, text)
		for len(ev) > 0 {
			n := min(len(ev), 32<<10)
			_, _ = w.Write(ev[:n])
			ev = ev[n:]
		}
	})
}

// BenchmarkHTTPExecutedLarge: BenchmarkHTTPExecuted with a 1 MiB result,
// and BenchmarkHTTPGoProxyLarge the same calls through a plain
// httputil.ReverseProxy: the difference is what the sidecar adds to a
// large result over a proxy that only relays it.
func BenchmarkHTTPExecutedLarge(b *testing.B) {
	proxy, _ := dedupProxy(b, largeSSEServer(), "", Options{})
	benchLarge(b, proxy.URL)
}

func BenchmarkHTTPGoProxyLarge(b *testing.B) {
	upstream := httptest.NewServer(largeSSEServer())
	b.Cleanup(upstream.Close)
	u, _ := url.Parse(upstream.URL)
	proxy := httptest.NewServer(&httputil.ReverseProxy{Rewrite: func(r *httputil.ProxyRequest) { r.SetURL(u) }, FlushInterval: -1})
	b.Cleanup(proxy.Close)
	benchLarge(b, proxy.URL)
}

func benchLarge(b *testing.B, target string) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	i := 0
	b.ReportAllocs()
	b.SetBytes(1 << 20)
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
		n, _ := io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if n < 1<<20 {
			b.Fatalf("got %d bytes", n)
		}
	}
}
