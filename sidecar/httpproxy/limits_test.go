package httpproxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcp/idemcp/test/poll"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// A client that opens stream after stream is bounded: per principal (HTTP
// 429) and in all (HTTP 503), with a JSON-RPC error body, counted; a
// closed stream frees its slot, and other principals are not starved by
// one that is over its own bound.
func TestStreamsAreBounded(t *testing.T) {
	stop := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(stop) }) }
	t.Cleanup(release)
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// A session's GET stream: open until the test ends it.
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(": open\n\n"))
		w.(http.Flusher).Flush()
		select {
		case <-stop:
		case <-r.Context().Done():
		}
	})
	proxy, e := dedupProxy(t, upstream, "", Options{MaxStreamsPerPrincipal: 2, MaxStreams: 3})

	type stream struct {
		resp   *http.Response
		cancel context.CancelFunc
	}
	open := func(principal string) stream {
		t.Helper()
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, proxy.URL, nil)
		req.Header.Set("Accept", "text/event-stream")
		req.Header.Set("Mcp-Session-Id", "s-"+principal)
		if principal != "" {
			req.Header.Set("Authorization", "Bearer "+principal)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			cancel()
			t.Fatalf("GET as %q: %v", principal, err)
		}
		if resp.StatusCode == http.StatusOK {
			// Read the first event: the stream is open through the proxy.
			if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
				t.Fatalf("reading the stream: %v", err)
			}
		}
		t.Cleanup(func() { cancel(); _ = resp.Body.Close() })
		return stream{resp, cancel}
	}
	refused := func(s stream, status int) {
		t.Helper()
		if s.resp.StatusCode != status {
			t.Fatalf("HTTP %d, want %d", s.resp.StatusCode, status)
		}
		var buf strings.Builder
		sc := bufio.NewScanner(s.resp.Body)
		for sc.Scan() {
			if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				buf.WriteString(d)
			}
		}
		var msg struct {
			Error struct {
				Code    int
				Message string
			}
		}
		if err := json.Unmarshal([]byte(buf.String()), &msg); err != nil || msg.Error.Code != mcpmsg.CodeOverloaded || !strings.Contains(msg.Error.Message, "--max-streams") {
			t.Fatalf("body %q (%v); want a JSON-RPC error %d naming the flag", buf.String(), err, mcpmsg.CodeOverloaded)
		}
		if s.resp.Header.Get("Retry-After") == "" {
			t.Error("no Retry-After on a refused stream")
		}
	}

	a1 := open("alice")
	open("alice")
	refused(open("alice"), http.StatusTooManyRequests)
	open("bob") // bob is not starved by alice
	refused(open("carol"), http.StatusServiceUnavailable)

	// Alice closes a stream: her slot, and the sidecar's, are free again.
	a1.cancel()
	_ = a1.resp.Body.Close()
	poll.Within(t, 10*time.Second, "alice's closed stream to free its slot", func() error {
		if s := open("alice"); s.resp.StatusCode != http.StatusOK {
			return fmt.Errorf("a new stream of hers got HTTP %d", s.resp.StatusCode)
		}
		return nil
	})
	over := e.Metrics().OverLimit
	if n := counterValue(over.WithLabelValues(engine.LimitStreamsPerPrincipal)); n < 1 {
		t.Errorf(`idemcp_over_limit_total{limit="streams_per_principal"} = %v, want at least 1`, n)
	}
	if n := counterValue(over.WithLabelValues(engine.LimitStreamsTotal)); n < 1 {
		t.Errorf(`idemcp_over_limit_total{limit="streams_total"} = %v, want at least 1`, n)
	}
	release()
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

// Copies of tools/list responses, kept to learn the tools' annotations
// from, are bounded per principal and in all: a client that sends many
// tools/list requests at once and reads their answers slowly makes the
// sidecar copy at most maxTapBytesPerPrincipal of them. Every response is
// still forwarded whole, another principal's listing still teaches Auto,
// and the copies are given back when the responses end.
func TestToolsListCopiesAreBounded(t *testing.T) {
	const half = 512 << 10
	head := `{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"pad","description":"` + strings.Repeat("x", half)
	tail := func(tool string) string {
		return strings.Repeat("y", half) + `"},{"name":"` + tool + `","annotations":{"readOnlyHint":true}}]}}`
	}
	stop := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(stop) }) }
	t.Cleanup(release)
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, head)
		w.(http.Flusher).Flush()
		select {
		case <-stop:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, tail(strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")+"_read"))
	})
	srv, e := dedupProxy(t, upstream, "", Options{})
	p := srv.Config.Handler.(*Proxy)

	list := func(principal string) (*http.Response, error) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/mcp", strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"tools/list"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer "+principal)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, err
		}
		if _, err := io.ReadFull(resp.Body, make([]byte, len(head))); err != nil {
			return nil, err
		}
		return resp, nil
	}
	const n = 40
	var held []*http.Response
	for range n {
		resp, err := list("mallory")
		if err != nil {
			t.Fatalf("mallory's tools/list: %v", err)
		}
		held = append(held, resp)
	}
	if got := p.tapHeld(); got > maxTapBytesPerPrincipal {
		t.Errorf("the sidecar holds %d bytes of mallory's %d listings, want at most %d", got, n, maxTapBytesPerPrincipal)
	}
	alice, err := list("alice")
	if err != nil {
		t.Fatalf("alice's tools/list: %v", err)
	}
	held = append(held, alice)
	release()
	for i, resp := range held {
		rest, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil || !strings.HasSuffix(string(rest), `_read","annotations":{"readOnlyHint":true}}]}}`) || len(rest) < half {
			t.Fatalf("listing %d was not forwarded whole: %d bytes, %v", i, len(rest), err)
		}
	}
	poll.Within(t, 10*time.Second, "alice's listing to teach Auto and the taps to let go", func() error {
		if known, held := e.Hints().Known("alice_read"), p.tapHeld(); !known || held != 0 {
			return fmt.Errorf("known: %v, the taps hold %d bytes", known, held)
		}
		return nil
	})
	if c := counterValue(e.Metrics().OverLimit.WithLabelValues(engine.LimitToolsListBuffers)); c < n-maxTapBytesPerPrincipal/half {
		t.Errorf(`idemcp_over_limit_total{limit="tools_list_buffers"} = %v, want at least %d`, c, n-maxTapBytesPerPrincipal/half)
	}
}
