package httpproxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/store"
)

// methodLog records the methods of the requests that reach the server.
type methodLog struct {
	mu   sync.Mutex
	seen []string
	next http.Handler
}

func (l *methodLog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	l.mu.Lock()
	l.seen = append(l.seen, r.Method+" "+r.RequestURI)
	l.mu.Unlock()
	l.next.ServeHTTP(w, r)
}

func (l *methodLog) methods() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.seen...)
}

// rawRequest sends one request line and headers on a fresh connection and
// reads the response, as a client that is not Go's would.
func rawRequest(t *testing.T, addr, head string) *http.Response {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, head); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("reading the answer to %q: %v", strings.SplitN(head, "\r\n", 2)[0], err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp
}

// TestMethodsMCPDoesNotUseAre405: CONNECT (with an authority-form target,
// as a client asking for a tunnel sends it), TRACE, PUT, PATCH, HEAD and
// made-up methods get 405 with an Allow header from the sidecar, on the
// Streamable HTTP path and on a legacy session's endpoint, and none of
// them reaches the MCP server. OPTIONS (CORS preflight) is the server's
// to answer and passes through.
func TestMethodsMCPDoesNotUseAre405(t *testing.T) {
	f := &fakeLegacy{streams: map[string]chan []byte{}}
	log := &methodLog{next: f}
	up := httptest.NewServer(log)
	t.Cleanup(up.Close)
	f.url = up.URL
	u, _ := url.Parse(up.URL + "/base")
	proxy := httptest.NewServer(New(Options{Upstream: u, Engine: engine.New(engine.Options{Store: store.NewMemory(100)})}))
	t.Cleanup(proxy.Close)
	addr := proxy.Listener.Addr().String()
	legacy := openLegacy(t, proxy.URL)

	check := func(what string, resp *http.Response) {
		t.Helper()
		if resp.StatusCode != http.StatusMethodNotAllowed {
			t.Errorf("%s: status %d, want 405", what, resp.StatusCode)
		}
		if got := resp.Header.Get("Allow"); got != "GET, POST, DELETE, OPTIONS" {
			t.Errorf("%s: Allow %q, want GET, POST, DELETE, OPTIONS", what, got)
		}
	}
	check("CONNECT upstream.example:443", rawRequest(t, addr, "CONNECT upstream.example:443 HTTP/1.1\r\nHost: upstream.example:443\r\n\r\n"))
	check("CONNECT to the upstream's own address", rawRequest(t, addr, fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: %[1]s\r\n\r\n", up.Listener.Addr())))
	check("TRACE *", rawRequest(t, addr, "TRACE * HTTP/1.1\r\nHost: x\r\n\r\n"))
	for _, path := range []string{"/", "/mcp", legacy.endpoint} {
		for _, m := range []string{http.MethodTrace, http.MethodPut, http.MethodPatch, http.MethodHead, "PROPFIND", "BREW"} {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			req, _ := http.NewRequestWithContext(ctx, m, proxy.URL+path, strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x"}}`))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				cancel()
				t.Fatalf("%s %s: %v", m, path, err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			cancel()
			check(m+" "+path, resp)
		}
	}
	for _, m := range log.methods() {
		if !strings.HasPrefix(m, "GET ") {
			t.Errorf("the MCP server got %q; nothing but the legacy stream's GET should have reached it", m)
		}
	}

	req, _ := http.NewRequest(http.MethodOptions, proxy.URL+"/mcp", nil)
	req.Header.Set("Origin", "https://app.example")
	req.Header.Set("Access-Control-Request-Method", "POST")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode == http.StatusMethodNotAllowed {
		t.Error("a CORS preflight (OPTIONS) got 405 from the sidecar; it is the MCP server's to answer")
	}
	seen := log.methods()
	if last := seen[len(seen)-1]; last != "OPTIONS /base/mcp" {
		t.Errorf("the MCP server last got %q, want the OPTIONS preflight", last)
	}
}
