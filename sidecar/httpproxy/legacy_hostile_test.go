package httpproxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/store"
)

// oddLegacy is a legacy (2024-11-05) server with the odd habits real ones
// have: its own line endings, comments and retry: before the endpoint, one
// endpoint URL for every session (it tells sessions by Authorization),
// large notifications, and responses written result first (as the
// TypeScript SDK does).
type oddLegacy struct {
	nl        string
	prelude   string
	shared    bool
	bigNote   int // a notification of about this size precedes each response
	bigResult int // the result's text is this long

	mu      sync.Mutex
	streams map[string]chan string
	n       int
	runs    atomic.Int64
}

func (f *oddLegacy) event(name, data string) string {
	e := "data: " + data + f.nl + f.nl
	if name != "" {
		e = "event: " + name + f.nl + e
	}
	return e
}

func (f *oddLegacy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/sse":
		f.mu.Lock()
		f.n++
		key, endpoint := fmt.Sprint(f.n), fmt.Sprintf("/msg?sid=%d", f.n)
		if f.shared {
			key, endpoint = r.Header.Get("Authorization"), "/msg"
		}
		ch := make(chan string, 16)
		f.streams[key] = ch
		f.mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, f.prelude+f.event("endpoint", endpoint))
		w.(http.Flusher).Flush()
		for {
			select {
			case <-r.Context().Done():
				return
			case e := <-ch:
				_, _ = io.WriteString(w, e)
				w.(http.Flusher).Flush()
			}
		}
	case r.Method == http.MethodPost && r.URL.Path == "/msg":
		key := r.URL.Query().Get("sid")
		if f.shared {
			key = r.Header.Get("Authorization")
		}
		f.mu.Lock()
		ch := f.streams[key]
		f.mu.Unlock()
		if ch == nil {
			http.Error(w, "unknown session", http.StatusNotFound)
			return
		}
		var m struct {
			ID     json.RawMessage `json:"id"`
			Method string          `json:"method"`
		}
		body, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(body, &m)
		w.WriteHeader(http.StatusAccepted)
		if m.Method != "tools/call" {
			return
		}
		n := f.runs.Add(1)
		if f.bigNote > 0 {
			ch <- f.event("message", fmt.Sprintf(`{"jsonrpc":"2.0","method":"notifications/message","params":{"data":"%s"}}`,
				strings.Repeat("n", f.bigNote)))
		}
		text := fmt.Sprintf("run %d %s", n, strings.Repeat("r", f.bigResult))
		ch <- f.event("message", fmt.Sprintf(`{"result":{"content":[{"type":"text","text":%q}]},"jsonrpc":"2.0","id":%s}`, text, m.ID))
	default:
		http.NotFound(w, r)
	}
}

func newOddLegacy(t *testing.T, f *oddLegacy, maxResponse int64) (*Proxy, *httptest.Server) {
	t.Helper()
	f.streams = map[string]chan string{}
	if f.nl == "" {
		f.nl = "\n"
	}
	up := httptest.NewServer(f)
	t.Cleanup(up.Close)
	u, _ := url.Parse(up.URL)
	p := New(Options{Upstream: u, MaxResponseBytes: maxResponse, Engine: engine.New(engine.Options{Store: store.NewMemory(100)})})
	proxy := httptest.NewServer(p)
	t.Cleanup(proxy.Close)
	return p, proxy
}

const legacyCharge = `{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"charge","arguments":{"amount":%d}}}`

func resultText(m map[string]any) string {
	res, _ := m["result"].(map[string]any)
	content, _ := res["content"].([]any)
	if len(content) == 0 {
		return ""
	}
	text, _ := content[0].(map[string]any)["text"].(string)
	return text
}

func TestLegacyOddFramingRunsOnce(t *testing.T) {
	for _, tc := range []struct {
		name, nl, prelude string
	}{
		{"LF", "\n", ""},
		{"CRLF", "\r\n", ""},
		{"bare CR", "\r", ""},
		{"comment before the endpoint", "\n", ": welcome\n\n"},
		{"retry before the endpoint", "\n", "retry: 3000\n"},
		{"comment and retry, CR", "\r", ":hi\rretry: 10\r\r"},
		{"BOM", "\n", "\xEF\xBB\xBF"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &oddLegacy{nl: tc.nl, prelude: tc.prelude}
			_, proxy := newOddLegacy(t, f, 0)
			c := openLegacy(t, proxy.URL)
			for i, id := range []string{`1`, `"two"`, `9007199254740993`} {
				c.post(fmt.Sprintf(legacyCharge, id, 5))
				m := c.next()
				if got, _ := json.Marshal(m["id"]); string(got) != id && (id != `9007199254740993` || m["id"] == nil) {
					t.Errorf("call %d answered with id %s, want %s", i+1, got, id)
				}
				if !strings.HasPrefix(resultText(m), "run 1") {
					t.Errorf("call %d: %v, want run 1's result", i+1, m)
				}
			}
			if n := f.runs.Load(); n != 1 {
				t.Errorf("3 identical calls ran %d times, want 1", n)
			}
		})
	}
}

func TestLegacyOversizedEventKeepsTheSession(t *testing.T) {
	const limit = 4 << 10
	t.Run("notification", func(t *testing.T) {
		f := &oddLegacy{bigNote: 2 * limit}
		_, proxy := newOddLegacy(t, f, limit)
		c := openLegacy(t, proxy.URL)
		c.post(fmt.Sprintf(legacyCharge, "1", 5))
		note := c.next()
		if params, _ := note["params"].(map[string]any); len(fmt.Sprint(params["data"])) != 2*limit {
			t.Fatalf("the oversized notification arrived as %.80v, want it whole", note)
		}
		if m := c.next(); resultText(m) != "run 1 " {
			t.Fatalf("after the oversized notification: %v, want the response", m)
		}
		// The session goes on: the retry is replayed, another call runs.
		c.post(fmt.Sprintf(legacyCharge, "2", 5))
		if m := c.next(); m["id"] != 2.0 || resultText(m) != "run 1 " {
			t.Errorf("retry: %v, want the replay of run 1 with id 2", m)
		}
		c.post(fmt.Sprintf(legacyCharge, "3", 6))
		c.next() // its notification
		if m := c.next(); m["id"] != 3.0 || resultText(m) != "run 2 " {
			t.Errorf("another call: %v, want run 2 with id 3", m)
		}
	})
	t.Run("response", func(t *testing.T) {
		f := &oddLegacy{bigResult: 2 * limit}
		_, proxy := newOddLegacy(t, f, limit)
		c := openLegacy(t, proxy.URL)
		c.post(fmt.Sprintf(legacyCharge, "1", 5))
		if m := c.next(); m["id"] != 1.0 || len(resultText(m)) != len("run 1 ")+2*limit {
			t.Fatalf("oversized response arrived as %.80v, want it whole", m)
		}
		// It ran and was too large to keep: the retry is told, not run.
		c.post(fmt.Sprintf(legacyCharge, "2", 5))
		m := c.next()
		if e, _ := m["error"].(map[string]any); m["id"] != 2.0 || e["code"] != -32014.0 {
			t.Errorf("retry: %v, want error -32014 with id 2", m)
		}
		if n := f.runs.Load(); n != 1 {
			t.Errorf("ran %d times, want 1", n)
		}
	})
}

func TestLegacySharedEndpointIsNotDeduplicated(t *testing.T) {
	f := &oddLegacy{shared: true}
	p, proxy := newOddLegacy(t, f, 0)

	// One session alone: its calls are deduplicated, scoped to it.
	a := openLegacyAs(t, proxy.URL, "Bearer a")
	a.post(fmt.Sprintf(legacyCharge, "1", 5))
	a.post(fmt.Sprintf(legacyCharge, "2", 5))
	if m1, m2 := a.next(), a.next(); resultText(m1) != "run 1 " || resultText(m2) != "run 1 " {
		t.Fatalf("a session alone: %v, %v; want run 1 twice", m1, m2)
	}
	a.cancel()
	time.Sleep(100 * time.Millisecond)

	// The next session gets the same endpoint; it is not the same session.
	b := openLegacyAs(t, proxy.URL, "Bearer b")
	b.post(fmt.Sprintf(legacyCharge, "1", 5))
	if m := b.next(); resultText(m) != "run 2 " {
		t.Errorf("another session with the same endpoint got %v, want its own run 2", m)
	}

	// Two live sessions share it: whose a POST is cannot be told, so
	// nothing is deduplicated and nothing is written into another's stream.
	c := openLegacyAs(t, proxy.URL, "Bearer c")
	c.post(fmt.Sprintf(legacyCharge, "7", 9))
	if m := c.next(); m["id"] != 7.0 || resultText(m) != "run 3 " {
		t.Errorf("c's call: %v, want run 3 with id 7 on c's stream", m)
	}
	b.post(fmt.Sprintf(legacyCharge, "7", 9))
	if m := b.next(); m["id"] != 7.0 || resultText(m) != "run 4 " {
		t.Errorf("b's call: %v, want run 4 with id 7 on b's stream", m)
	}
	select {
	case ev := <-c.events:
		t.Errorf("c's stream got %s, which is not c's", ev.Data)
	case <-time.After(200 * time.Millisecond):
	}
	var metric dto.Metric
	if err := p.sharedCalls.Write(&metric); err != nil {
		t.Fatal(err)
	}
	if n := metric.GetCounter().GetValue(); n != 2 {
		t.Errorf("idemcp_legacy_shared_endpoint_calls_total = %v, want 2", n)
	}
}
