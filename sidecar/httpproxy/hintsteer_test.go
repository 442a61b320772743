package httpproxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/store"
)

// twoEndpoints serves /mcp, where charge has a side effect, and
// /sandbox/mcp (or any path under Host sandbox.example), where the same
// name is idempotent; each listing also
// names a read-only marker tool of its own. It counts charge calls.
func twoEndpoints(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var charges atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		switch {
		case strings.Contains(string(body), `"tools/list"`) && (r.URL.Path == "/sandbox/mcp" || r.Host == "sandbox.example"):
			_, _ = io.WriteString(w, `{"jsonrpc":"2.0","id":1,"result":{"tools":[`+
				`{"name":"charge","inputSchema":{},"annotations":{"idempotentHint":true}},`+
				`{"name":"sandbox_marker","inputSchema":{},"annotations":{"readOnlyHint":true}}]}}`)
		case strings.Contains(string(body), `"tools/list"`):
			// charge is served here but not listed (as for a tool listed
			// only to some clients): only the sandbox's listing names it.
			_, _ = io.WriteString(w, `{"jsonrpc":"2.0","id":1,"result":{"tools":[`+
				`{"name":"marker","inputSchema":{},"annotations":{"readOnlyHint":true}}]}}`)
		default:
			n := charges.Add(1)
			_, _ = io.WriteString(w, `{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"charged `+
				strings.Repeat("I", int(n))+`"}]}}`)
		}
	}))
	t.Cleanup(up.Close)
	return up, &charges
}

func postTo(t *testing.T, rawURL, host, body string) string {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, rawURL, strings.NewReader(body))
	if host != "" {
		req.Host = host
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Authorization", "Bearer caller-a")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// waitKnown waits until a listing on the configured endpoint has been
// learned (the tap learns off the response's path).
func waitKnown(t *testing.T, e *engine.Engine, tool string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !e.Hints().Known(tool) {
		if time.Now().After(deadline) {
			t.Fatalf("%s, listed on the MCP endpoint, was never learned", tool)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestListingAnotherEndpointDoesNotTurnOffDedup: a client that lists the
// tools at another path of the same server (where charge is
// idempotentHint: true), or at the MCP path under another Host than the
// configured one, teaches Auto nothing: charge on /mcp is still
// deduplicated.
func TestListingAnotherEndpointDoesNotTurnOffDedup(t *testing.T) {
	const listing = `{"jsonrpc":"2.0","id":1,"method":"tools/list"}`
	const call = `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"amount":5}}}`
	for _, tc := range []struct {
		name, path, host, configuredHost string
	}{
		{name: "another path", path: "/sandbox/mcp"},
		{name: "another path, configured Host", path: "/sandbox/mcp", host: "mcp.shop.svc", configuredHost: "mcp.shop.svc"},
		{name: "the MCP path under another Host than configured", path: "/mcp", host: "sandbox.example", configuredHost: "mcp.shop.svc"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up, charges := twoEndpoints(t)
			u, _ := url.Parse(up.URL)
			e := engine.New(engine.Options{Store: store.NewMemory(100)})
			proxy := httptest.NewServer(New(Options{Upstream: u, Engine: e, ToolsListHost: tc.configuredHost}))
			t.Cleanup(proxy.Close)

			postTo(t, proxy.URL+tc.path, tc.host, listing)
			// Then a listing on the configured endpoint, so that the test
			// knows the tap has had its chance.
			postTo(t, proxy.URL+"/mcp", tc.configuredHost, listing)
			waitKnown(t, e, "marker")
			if e.Hints().Known("sandbox_marker") {
				t.Errorf("a listing at %s was learned", tc.path)
			}
			first := postTo(t, proxy.URL+"/mcp", tc.configuredHost, call)
			second := postTo(t, proxy.URL+"/mcp", tc.configuredHost, call)
			if n := charges.Load(); n != 1 {
				t.Errorf("charge on /mcp ran %d times, want 1 (deduplicated): %s / %s", n, first, second)
			}
		})
	}
}

// TestListingInAbsoluteFormTeachesNothing: a request line in absolute
// form names its own Host (it wins over the Host header): with a Host
// configured, such a listing of another host is not learned.
func TestListingInAbsoluteFormTeachesNothing(t *testing.T) {
	up, _ := twoEndpoints(t)
	u, _ := url.Parse(up.URL)
	e := engine.New(engine.Options{Store: store.NewMemory(100)})
	proxy := httptest.NewServer(New(Options{Upstream: u, Engine: e, ToolsListHost: "mcp.shop.svc"}))
	t.Cleanup(proxy.Close)
	conn, err := net.Dial("tcp", proxy.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	const listing = `{"jsonrpc":"2.0","id":1,"method":"tools/list"}`
	_, _ = fmt.Fprintf(conn, "POST http://sandbox.example/mcp HTTP/1.1\r\nHost: mcp.shop.svc\r\nContent-Type: application/json\r\n"+
		"Accept: application/json, text/event-stream\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(listing), listing)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if !strings.Contains(string(b), "sandbox_marker") {
		t.Fatalf("the server did not list the sandbox's tools: %s", b)
	}
	postTo(t, proxy.URL+"/mcp", "mcp.shop.svc", listing)
	waitKnown(t, e, "marker")
	if e.Hints().Known("sandbox_marker") || !e.Deduplicates("charge") {
		t.Error("a listing of another host, in absolute form, was learned")
	}
}
