package httpproxy

import (
	"bufio"
	"bytes"
	"context"
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

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/test/poll"
)

func TestLegacyClientEndpoint(t *testing.T) {
	in := httptest.NewRequest(http.MethodGet, "http://sidecar:8081/sse", nil)
	for _, tc := range []struct {
		upstream, data string
		want, key      string
		ours           bool
	}{
		{"http://127.0.0.1:9000", "/message?sessionId=abc", "/message?sessionId=abc", "/message?sessionId=abc", true},
		{"http://127.0.0.1:9000", "/sse?sessionid=XY", "/sse?sessionid=XY", "/sse?sessionid=XY", true},
		{"http://127.0.0.1:9000", "message?sessionId=abc", "message?sessionId=abc", "/message?sessionId=abc", true},
		{"http://127.0.0.1:9000", "http://127.0.0.1:9000/message?sessionId=abc", "/message?sessionId=abc", "/message?sessionId=abc", true},
		{"http://127.0.0.1:9000", "http://sidecar:8081/message?s=1", "http://sidecar:8081/message?s=1", "/message?s=1", true},
		{"http://127.0.0.1:9000", "https://elsewhere.example/message?s=1", "https://elsewhere.example/message?s=1", "", false},
		{"http://127.0.0.1:9000/base", "/base/msg?sid=1", "/msg?sid=1", "/msg?sid=1", true},
		{"http://127.0.0.1:9000/base/", "http://127.0.0.1:9000/base/msg?sid=1", "/msg?sid=1", "/msg?sid=1", true},
		{"http://127.0.0.1:9000/base", "/basement/msg", "/basement/msg", "/basement/msg", true},
		{"http://127.0.0.1:9000", "/messages/a%2Fb", "/messages/a%2Fb", "/messages/a%2Fb", true},
	} {
		up, _ := url.Parse(tc.upstream)
		p := New(Options{Upstream: up, Engine: engine.New(engine.Options{Store: store.NewMemory(10)})})
		got, key, ours := p.clientEndpoint(tc.data, in)
		if got != tc.want || key != tc.key || ours != tc.ours {
			t.Errorf("upstream %s, endpoint %q: got (%q, %q, %v), want (%q, %q, %v)",
				tc.upstream, tc.data, got, key, ours, tc.want, tc.key, tc.ours)
		}
	}
}

func TestLegacyReplaceData(t *testing.T) {
	for _, tc := range []struct{ raw, want string }{
		{"id: 7\r\nevent: endpoint\r\ndata: http://x/old\r\n\r\n", "id: 7\r\nevent: endpoint\r\ndata: /new\r\n\r\n"},
		{": hi\rretry: 5\revent: endpoint\rdata:http://x/old\rdata: more\r\r", ": hi\rretry: 5\revent: endpoint\rdata: /new\r\r"},
		{"\xEF\xBB\xBFdata: http://x/old\nevent: endpoint\n\n", "\xEF\xBB\xBFdata: /new\nevent: endpoint\n\n"},
		{"event: endpoint\ndata: http://x/old", "event: endpoint\ndata: /new"},
	} {
		if got := string(replaceData([]byte(tc.raw), "/new")); got != tc.want {
			t.Errorf("replaceData(%q) = %q, want %q", tc.raw, got, tc.want)
		}
	}
}

// fakeLegacy is a hand-written 2024-11-05 server mounted under /base that
// announces its endpoint as an absolute URL to itself, as some servers do.
type fakeLegacy struct {
	url     string // set once listening
	mu      sync.Mutex
	streams map[string]chan []byte
	calls   atomic.Int64
	cancels atomic.Int64
	gets    atomic.Int64
	hold    chan struct{} // if set, a call answers only once it is closed
}

func (f *fakeLegacy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/base/plain":
		// Not a legacy stream: relayed byte for byte.
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "id: 1\ndata: one\n\n: a comment\n\n\n\ndata: two\ndata: lines\n\n")
	case r.Method == http.MethodGet && r.URL.Path == "/base/sse":
		f.gets.Add(1)
		defer f.gets.Add(-1)
		sid := fmt.Sprint(time.Now().UnixNano())
		ch := make(chan []byte, 16)
		f.mu.Lock()
		f.streams[sid] = ch
		f.mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = fmt.Fprintf(w, "event: endpoint\ndata: %s/base/msg?sid=%s\n\n", f.url, sid)
		w.(http.Flusher).Flush()
		for {
			select {
			case <-r.Context().Done():
				return
			case b := <-ch:
				_, _ = w.Write(mcpmsg.AppendEvent(nil, b))
				w.(http.Flusher).Flush()
			}
		}
	case r.Method == http.MethodPost && r.URL.Path == "/base/msg":
		f.mu.Lock()
		ch := f.streams[r.URL.Query().Get("sid")]
		f.mu.Unlock()
		if ch == nil {
			http.Error(w, "unknown session", http.StatusNotFound)
			return
		}
		body, _ := io.ReadAll(r.Body)
		var m struct {
			ID     json.RawMessage `json:"id"`
			Method string          `json:"method"`
			Params struct {
				Name      string `json:"name"`
				Arguments struct {
					DelayMS int `json:"delayMs"`
				} `json:"arguments"`
			} `json:"params"`
		}
		_ = json.Unmarshal(body, &m)
		switch {
		case m.Method == "notifications/cancelled":
			f.cancels.Add(1)
		case m.Method == "tools/call" && m.Params.Name == "refused":
			http.Error(w, "no such tool here", http.StatusBadRequest)
			return
		case m.Method == "tools/call":
			n := f.calls.Add(1)
			go func() {
				time.Sleep(time.Duration(m.Params.Arguments.DelayMS) * time.Millisecond)
				if f.hold != nil {
					<-f.hold
				}
				ch <- fmt.Appendf(nil, `{"jsonrpc":"2.0","id":%s,"result":{"content":[{"type":"text","text":"run %d"}]}}`, m.ID, n)
			}()
		}
		w.WriteHeader(http.StatusAccepted)
	default:
		http.NotFound(w, r)
	}
}

func newLegacyTestProxy(t *testing.T) (*fakeLegacy, *httptest.Server) {
	t.Helper()
	f := &fakeLegacy{streams: map[string]chan []byte{}}
	up := httptest.NewServer(f)
	t.Cleanup(up.Close)
	f.url = up.URL
	u, _ := url.Parse(up.URL + "/base")
	proxy := httptest.NewServer(New(Options{Upstream: u, Engine: engine.New(engine.Options{Store: store.NewMemory(100)})}))
	t.Cleanup(proxy.Close)
	return f, proxy
}

type legacyTestClient struct {
	t        *testing.T
	base     string
	auth     string
	endpoint string
	events   chan mcpmsg.Event
	cancel   context.CancelFunc
}

func openLegacy(t *testing.T, base string) *legacyTestClient {
	t.Helper()
	return openLegacyAs(t, base, "")
}

// openLegacyAs opens a legacy session with an Authorization header (none
// if auth is empty), as a client reads one: up to the endpoint event,
// whatever comes before it.
func openLegacyAs(t *testing.T, base, auth string) *legacyTestClient {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/sse", nil)
	req.Header.Set("Accept", "text/event-stream")
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	c := &legacyTestClient{t: t, base: base, auth: auth, events: make(chan mcpmsg.Event, 64), cancel: cancel}
	er := mcpmsg.NewEventReader(resp.Body, 16<<20)
	tooLate := time.AfterFunc(5*time.Second, cancel)
	defer tooLate.Stop()
	for {
		first, err := er.Next()
		if err != nil {
			t.Fatalf("no endpoint event within 5s: %q, %v", first.Raw, err)
		}
		if first.Name == "endpoint" {
			c.endpoint = string(first.Data)
			break
		}
	}
	go func() {
		defer func() { _ = resp.Body.Close() }()
		for {
			ev, err := er.Next()
			if err != nil {
				close(c.events)
				return
			}
			if ev.HasData {
				c.events <- ev
			}
		}
	}()
	return c
}

func (c *legacyTestClient) post(body string) int {
	c.t.Helper()
	req, _ := http.NewRequest(http.MethodPost, c.base+c.endpoint, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if c.auth != "" {
		req.Header.Set("Authorization", c.auth)
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// next returns the next message on the stream.
func (c *legacyTestClient) next() map[string]any {
	c.t.Helper()
	select {
	case ev, ok := <-c.events:
		if !ok {
			c.t.Fatal("the stream ended")
		}
		var m map[string]any
		if err := json.Unmarshal(ev.Data, &m); err != nil {
			c.t.Fatalf("event %q: %v", ev.Raw, err)
		}
		return m
	case <-time.After(5 * time.Second):
		c.t.Fatal("no event within 5s")
		return nil
	}
}

func TestLegacyAbsoluteEndpointReplayAndCancel(t *testing.T) {
	f, proxy := newLegacyTestProxy(t)
	c := openLegacy(t, proxy.URL)
	if !strings.HasPrefix(c.endpoint, "/msg?sid=") {
		t.Fatalf("endpoint %q: want the upstream's absolute URL rewritten to /msg?sid=...", c.endpoint)
	}

	call := `{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"charge","arguments":{"card":"4242","delayMs":%d}}}`
	if s := c.post(fmt.Sprintf(call, "1", 300)); s != http.StatusAccepted {
		t.Fatalf("POST tools/call: %d, want 202", s)
	}
	// The client cancels (as agents do on a timeout): not forwarded.
	if s := c.post(`{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1}}`); s != http.StatusAccepted {
		t.Fatalf("POST cancel: %d", s)
	}
	first := c.next()
	if first["id"] != 1.0 {
		t.Fatalf("first response %v, want id 1", first)
	}
	// A retry with a string id gets the replay, with its own id.
	if s := c.post(fmt.Sprintf(call, `"retry-2"`, 300)); s != http.StatusAccepted {
		t.Fatalf("POST retry: %d", s)
	}
	replay := c.next()
	if replay["id"] != "retry-2" {
		t.Fatalf("replay %v, want id \"retry-2\"", replay)
	}
	meta, _ := replay["result"].(map[string]any)["_meta"].(map[string]any)
	if meta[engine.ReplayedMeta] != true {
		t.Errorf("replay without _meta[%q]: %v", engine.ReplayedMeta, replay)
	}
	if n := f.calls.Load(); n != 1 {
		t.Errorf("the server ran %d calls, want 1", n)
	}
	if n := f.cancels.Load(); n != 0 {
		t.Errorf("%d cancels of a deduplicated call reached the server", n)
	}

	// A message the server refuses: the client hears of it on the stream.
	c.post(`{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"refused"}}`)
	refused := c.next()
	if refused["id"] != 9.0 || refused["error"] == nil || !strings.Contains(fmt.Sprint(refused["error"]), "HTTP 400") {
		t.Errorf("refused call: %v, want an error with id 9 naming HTTP 400", refused)
	}
	// An invalid key is refused by the engine, on the stream too.
	c.post(`{"jsonrpc":"2.0","id":10,"method":"tools/call","params":{"name":"charge","_meta":{"idempotency-key":""}}}`)
	if bad := c.next(); bad["id"] != 10.0 || fmt.Sprint(bad["error"].(map[string]any)["code"]) != fmt.Sprint(mcpmsg.CodeInvalidParams) {
		t.Errorf("invalid key: %v, want error %d with id 10", bad, mcpmsg.CodeInvalidParams)
	}
}

func TestLegacyClientLeavesHoldsUpstreamUntilAnswered(t *testing.T) {
	f, proxy := newLegacyTestProxy(t)
	f.hold = make(chan struct{}) // the call runs until the test lets it answer
	c := openLegacy(t, proxy.URL)
	call := `{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"charge","arguments":{"delayMs":%d}}}`
	c.post(fmt.Sprintf(call, 1, 0))
	poll.Within(t, time.Minute, "the call to reach the server", poll.True(func() bool { return f.calls.Load() != 0 }))
	c.cancel() // the client's stream goes away mid-call
	// A stream wrongly closed with the client's would be gone by now; the
	// call cannot have answered, whatever the machine's load.
	time.Sleep(100 * time.Millisecond)
	if n := f.gets.Load(); n != 1 {
		t.Fatalf("%d upstream streams open while the call runs, want 1 (held)", n)
	}
	close(f.hold)
	poll.Within(t, 5*time.Second, "the held upstream stream to close after the response", poll.True(func() bool { return f.gets.Load() == 0 }))
	if n := f.calls.Load(); n != 1 {
		t.Fatalf("server ran %d calls, want 1", n)
	}
}

func TestNonLegacyEventStreamIsRelayedByteForByte(t *testing.T) {
	_, proxy := newLegacyTestProxy(t)
	req, _ := http.NewRequest(http.MethodGet, proxy.URL+"/plain", nil)
	req.Header.Set("Accept", "text/event-stream")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	got, _ := io.ReadAll(bufio.NewReader(resp.Body))
	// The first event is read as an event (to tell a legacy stream), the
	// rest is copied as it comes.
	want := "id: 1\ndata: one\n\n: a comment\n\n\n\ndata: two\ndata: lines\n\n"
	if !bytes.Equal(got, []byte(want)) {
		t.Errorf("relayed %q, want %q", got, want)
	}
	if resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Errorf("Content-Type %q", resp.Header.Get("Content-Type"))
	}
}
