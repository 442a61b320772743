package httpproxy

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/test/poll"
)

func newTestProxy(t *testing.T, upstream, policyYAML string) *httptest.Server {
	t.Helper()
	u, err := url.Parse(upstream)
	if err != nil {
		t.Fatal(err)
	}
	pol := policy.Default()
	if policyYAML != "" {
		if pol, err = policy.Parse([]byte(policyYAML)); err != nil {
			t.Fatal(err)
		}
	}
	proxy := httptest.NewServer(New(Options{Upstream: u, Engine: engine.New(engine.Options{Policy: pol, Store: store.NewMemory(100)})}))
	t.Cleanup(proxy.Close)
	return proxy
}

// droppingServer is an MCP server reached over raw HTTP/1.1 that runs a
// tool call and then drops the connection without answering, as a server
// that crashes mid-response does. Other requests are answered, each held
// until warm of them have arrived, so that the sidecar's connection pool
// holds that many open connections when the call comes.
type droppingServer struct {
	ln   net.Listener
	runs atomic.Int64
	warm int

	mu      sync.Mutex
	arrived int
	goFlag  chan struct{}
}

func newDroppingServer(t *testing.T, warm int) *droppingServer {
	t.Helper()
	s := &droppingServer{warm: warm, goFlag: make(chan struct{})}
	s.ln = listenTCP(t, func(c net.Conn) { s.serve(t, c) })
	return s
}

func (s *droppingServer) serve(t *testing.T, c net.Conn) {
	defer func() { _ = c.Close() }()
	br := bufio.NewReader(c)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		body, _ := io.ReadAll(req.Body)
		switch {
		case req.Method == http.MethodGet:
			// A legacy session whose POSTs go to /msg.
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"+
				"event: endpoint\ndata: /msg?sid=1\n\n")
			<-t.Context().Done()
			return
		case bytes.Contains(body, []byte(`"tools/call"`)):
			s.runs.Add(1)
			return // ran the tool, then died before answering
		}
		s.mu.Lock()
		s.arrived++
		if s.arrived == s.warm {
			close(s.goFlag)
		}
		s.mu.Unlock()
		select {
		case <-s.goFlag:
		case <-time.After(5 * time.Second):
		}
		const answer = `{"jsonrpc":"2.0","id":1,"result":{}}`
		_, _ = fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(answer), answer)
	}
}

// warmUp opens n pooled connections from the sidecar to the server.
func (s *droppingServer) warmUp(t *testing.T, proxy string, n int) {
	t.Helper()
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			resp, err := http.Post(proxy+"/mcp", "application/json",
				strings.NewReader(fmt.Sprintf(`{"jsonrpc":"2.0","id":%d,"method":"ping"}`, i)))
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
		})
	}
	wg.Wait()
}

// A call forwarded once must reach the server once: net/http's Transport
// resends a request carrying an Idempotency-Key header on another pooled
// connection when the first dies after the request was written.
func TestForwardedCallIsNeverResent(t *testing.T) {
	const warm = 6
	call := `{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"%s","arguments":{"n":1}}}`
	for _, tc := range []struct {
		name, tool, header string
		legacy             bool
	}{
		{"deduplicated", "charge", "Idempotency-Key", false},
		{"deduplicated X-Idempotency-Key", "charge", "X-Idempotency-Key", false},
		{"passthrough", "get_balance", "Idempotency-Key", false},
		{"legacy", "charge", "Idempotency-Key", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := newDroppingServer(t, warm)
			proxy := newTestProxy(t, "http://"+srv.ln.Addr().String(), "spec:\n  tools:\n  - name: get_*\n    mode: Passthrough\n")
			path := "/mcp"
			if tc.legacy {
				ctx, cancel := context.WithCancel(t.Context())
				defer cancel()
				req, _ := http.NewRequestWithContext(ctx, http.MethodGet, proxy.URL+"/sse", nil)
				req.Header.Set("Accept", "text/event-stream")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = resp.Body.Close() }()
				if line, _ := bufio.NewReader(resp.Body).ReadString('\n'); line != "event: endpoint\n" {
					t.Fatalf("legacy stream began %q", line)
				}
				path = "/msg?sid=1"
			}
			srv.warmUp(t, proxy.URL, warm)
			req, _ := http.NewRequest(http.MethodPost, proxy.URL+path, strings.NewReader(fmt.Sprintf(call, tc.tool)))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Accept", "application/json, text/event-stream")
			req.Header.Set(tc.header, "key-1")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			deadline := time.Now().Add(2 * time.Second)
			for srv.runs.Load() == 0 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			time.Sleep(200 * time.Millisecond) // time for a resend to arrive
			if n := srv.runs.Load(); n != 1 {
				t.Errorf("the server ran the call %d times with %d warm connections, want 1", n, warm)
			}
		})
	}
}

// seenRequest is what the upstream received.
type seenRequest struct {
	rawQuery string
	header   http.Header
	hasUA    bool
}

func TestForwardingHeadersAndRawQueryOnEveryPath(t *testing.T) {
	var mu sync.Mutex
	var seen []seenRequest
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, hasUA := r.Header["User-Agent"]
		mu.Lock()
		seen = append(seen, seenRequest{rawQuery: r.URL.RawQuery, header: r.Header.Clone(), hasUA: hasUA})
		mu.Unlock()
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/sse":
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "event: endpoint\ndata: /msg?sid=1;x=2&y=3\n\n")
		case r.Method == http.MethodPost:
			body, _ := io.ReadAll(r.Body)
			id := "1"
			if i := bytes.Index(body, []byte(`"id":`)); i >= 0 {
				id = string(body[i+5 : i+5+bytes.IndexByte(body[i+5:], ',')])
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = fmt.Fprintf(w, `{"jsonrpc":"2.0","id":%s,"result":{"content":[]}}`, id)
		default:
			w.WriteHeader(http.StatusNoContent)
		}
	}))
	t.Cleanup(up.Close)
	proxy := newTestProxy(t, up.URL, "spec:\n  tools:\n  - name: get_*\n    mode: Passthrough\n")

	send := func(method, path, body string) {
		t.Helper()
		var rd io.Reader
		if body != "" {
			rd = strings.NewReader(body)
		}
		req, _ := http.NewRequest(method, proxy.URL+path, rd)
		req.Header["User-Agent"] = []string{""} // the client sends none
		req.Header.Set("Forwarded", `for=192.0.2.60;proto=https;host=mcp.example`)
		req.Header.Set("X-Forwarded-For", "192.0.2.60, 10.0.0.1")
		req.Header.Set("X-Forwarded-Host", "mcp.example")
		req.Header.Set("X-Forwarded-Proto", "https")
		req.Header.Set("Accept", "application/json, text/event-stream")
		if method == http.MethodGet {
			req.Header.Set("Accept", "text/event-stream")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
	}
	call := `{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"%s","arguments":{}}}`
	paths := []string{"passthrough call", "deduplicated call", "other request", "GET stream", "DELETE"}
	send(http.MethodPost, "/mcp?a=1;b=2&c=3", fmt.Sprintf(call, 1, "get_x"))
	send(http.MethodPost, "/mcp?a=1;b=2&c=3", fmt.Sprintf(call, 2, "charge"))
	send(http.MethodPost, "/mcp?a=1;b=2&c=3", `{"jsonrpc":"2.0","id":3,"method":"ping"}`)
	send(http.MethodGet, "/sse?a=1;b=2&c=3", "")
	send(http.MethodDelete, "/mcp?a=1;b=2&c=3", "")

	mu.Lock()
	defer mu.Unlock()
	if len(seen) != len(paths) {
		t.Fatalf("the server saw %d requests, want %d", len(seen), len(paths))
	}
	for i, s := range seen {
		if s.rawQuery != "a=1;b=2&c=3" {
			t.Errorf("%s: query %q reached the server, want a=1;b=2&c=3", paths[i], s.rawQuery)
		}
		if s.hasUA {
			t.Errorf("%s: the server got User-Agent %q the client did not send", paths[i], s.header.Get("User-Agent"))
		}
		for name, want := range map[string]string{
			"Forwarded":         `for=192.0.2.60;proto=https;host=mcp.example`,
			"X-Forwarded-For":   "192.0.2.60, 10.0.0.1",
			"X-Forwarded-Host":  "mcp.example",
			"X-Forwarded-Proto": "https",
		} {
			if got := s.header.Values(name); len(got) != 1 || got[0] != want {
				t.Errorf("%s: %s reached the server as %q, want %q", paths[i], name, got, want)
			}
		}
	}
}

// A response the server compresses is read decoded and stored; the client
// reads it as it would without the sidecar.
func TestCompressedResponsesAreRead(t *testing.T) {
	for _, sse := range []bool{false, true} {
		t.Run(fmt.Sprintf("sse=%v", sse), func(t *testing.T) {
			var runs atomic.Int64
			up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				body, _ := io.ReadAll(r.Body)
				n := runs.Add(1)
				id := string(body[bytes.Index(body, []byte(`"id":`))+5 : bytes.Index(body, []byte(`,"method"`))])
				msg := fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,"result":{"content":[{"type":"text","text":"run %d"}]}}`, id, n)
				w.Header().Set("Content-Encoding", "gzip") // whatever the client accepts
				gz := gzip.NewWriter(w)
				if sse {
					w.Header().Set("Content-Type", "text/event-stream")
					_, _ = fmt.Fprintf(gz, "event: message\r\ndata: %s\r\n\r\n", msg)
				} else {
					w.Header().Set("Content-Type", "application/json")
					_, _ = io.WriteString(gz, msg)
				}
				_ = gz.Close()
			}))
			t.Cleanup(up.Close)
			proxy := newTestProxy(t, up.URL, "")
			for i, id := range []string{`1`, `"two"`} {
				req, _ := http.NewRequest(http.MethodPost, proxy.URL+"/mcp",
					strings.NewReader(`{"jsonrpc":"2.0","id":`+id+`,"method":"tools/call","params":{"name":"charge","arguments":{}}}`))
				req.Header.Set("Accept", "application/json, text/event-stream")
				req.Header.Set("Authorization", "Bearer a")
				resp, err := http.DefaultClient.Do(req) // asks for gzip and decodes it
				if err != nil {
					t.Fatal(err)
				}
				got, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				if !bytes.Contains(got, []byte(`"id":`+id)) || !bytes.Contains(got, []byte("run 1")) {
					t.Errorf("call %d got %q, want run 1 with id %s", i+1, got, id)
				}
			}
			if n := runs.Load(); n != 1 {
				t.Errorf("the server ran %d calls, want 1", n)
			}
		})
	}
}

// tools/list responses teach readOnlyHint however they are framed or
// compressed.
func TestToolsListIsLearnedFromCompressedEvents(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Content-Encoding", "gzip")
		gz := gzip.NewWriter(w)
		_, _ = io.WriteString(gz, "event: message\rdata: "+
			`{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"look","inputSchema":{},"annotations":{"readOnlyHint":true}}]}}`+"\r")
		_ = gz.Close()
	}))
	t.Cleanup(up.Close)
	u, _ := url.Parse(up.URL)
	p := New(Options{Upstream: u, Engine: engine.New(engine.Options{Store: store.NewMemory(10)})})
	proxy := httptest.NewServer(p)
	t.Cleanup(proxy.Close)
	if !p.engine.Deduplicates("look") {
		t.Fatal("an unlisted tool is not deduplicated under Auto")
	}
	resp, err := http.Post(proxy.URL+"/mcp", "application/json", strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"tools/list"}`))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	poll.Within(t, 2*time.Second, "a readOnlyHint tool listed in a gzip-encoded event stream to pass through", poll.True(func() bool { return !p.engine.Deduplicates("look") }))
}

// TestEscapedPathKeptEscaped: a path with an escaped slash (an endpoint a
// legacy server announced as /messages/a%2Fb) reaches the MCP server
// escaped, on the passthrough and the deduplicated path alike, under an
// upstream URL with a path of its own.
func TestEscapedPathKeptEscaped(t *testing.T) {
	var mu sync.Mutex
	var got []string
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Method+" "+r.RequestURI)
		mu.Unlock()
		if r.Method == http.MethodPost {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"jsonrpc":"2.0","id":1,"result":{"content":[]}}`)
		}
	}))
	t.Cleanup(up.Close)
	for _, base := range []string{"", "/base", "/base/", "/b%2Fse"} {
		mu.Lock()
		got = nil
		mu.Unlock()
		proxy := newTestProxy(t, up.URL+base, "")
		resp, err := http.Get(proxy.URL + "/messages/a%2Fb?sid=1")
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		body := `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"n":1}}}`
		req, _ := http.NewRequest(http.MethodPost, proxy.URL+"/messages/a%2Fb?sid=1", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		if resp, err = http.DefaultClient.Do(req); err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		prefix := strings.TrimSuffix(base, "/")
		want := []string{"GET " + prefix + "/messages/a%2Fb?sid=1", "POST " + prefix + "/messages/a%2Fb?sid=1"}
		mu.Lock()
		if strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Errorf("upstream %q: the MCP server saw\n%s\nwant\n%s", base, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
		mu.Unlock()
	}
}
