package toollist

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/store"
)

// sdkServer is a real Go SDK server with one tool per page; the last is
// read-only. It counts DELETEs and sessions still open.
func sdkServer(t *testing.T, stateless bool) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	s := mcp.NewServer(&mcp.Implementation{Name: "paged", Version: "1"}, &mcp.ServerOptions{PageSize: 1})
	noop := func(context.Context, *mcp.CallToolRequest, struct{}) (*mcp.CallToolResult, struct{}, error) {
		return &mcp.CallToolResult{}, struct{}{}, nil
	}
	mcp.AddTool(s, &mcp.Tool{Name: "a_write"}, noop)
	mcp.AddTool(s, &mcp.Tool{Name: "b_write", Annotations: &mcp.ToolAnnotations{ReadOnlyHint: false}}, noop)
	mcp.AddTool(s, &mcp.Tool{Name: "c_read", Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true}}, noop)
	h := mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return s }, &mcp.StreamableHTTPOptions{Stateless: stateless})
	var deletes atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodDelete {
			deletes.Add(1)
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv, &deletes
}

// TestHTTPListsEveryPageOnItsOwnSession: the lister opens its own session
// where the server keeps sessions, pages through nextCursor, and ends the
// session; a call to an unknown tool waits for the listing.
func TestHTTPListsEveryPageOnItsOwnSession(t *testing.T) {
	for _, stateless := range []bool{false, true} {
		srv, deletes := sdkServer(t, stateless)
		u, _ := url.Parse(srv.URL + "/mcp")
		hints := engine.NewToolHints()
		l := New(Options{Hints: hints, List: NewHTTP(http.DefaultClient, u, "").List})
		start := time.Now()
		if !hints.ReadOnly("c_read") {
			t.Errorf("stateless=%v: c_read (readOnlyHint, on the last page) is not known read-only", stateless)
		}
		if d := time.Since(start); d > time.Second {
			t.Errorf("the first call waited %v for the listing", d)
		}
		for _, tool := range []string{"a_write", "b_write", "c_read"} {
			if !hints.Known(tool) {
				t.Errorf("stateless=%v: %s was not listed", stateless, tool)
			}
		}
		if hints.ReadOnly("a_write") {
			t.Error("a_write is not read-only")
		}
		// A tool the server does not have: no new listing so soon, and counted.
		if hints.ReadOnly("nope") {
			t.Error("an unknown tool counts as read-only")
		}
		if n := deletes.Load(); !stateless && n != 1 {
			t.Errorf("%d DELETEs of the lister's session, want 1", n)
		}
		if n := unknownCalls(l); n != 1 {
			t.Errorf("unknown tool calls counted %v, want 1", n)
		}
	}
}

func unknownCalls(l *Lister) float64 {
	var m dto.Metric
	_ = l.UnknownCalls().Write(&m)
	return m.GetCounter().GetValue()
}

// TestWatchSeesListChangedAcrossWrites: a list_changed notification on any
// response stream through the proxy makes the lister list again, even when
// the stream splits it across writes.
func TestWatchSeesListChangedAcrossWrites(t *testing.T) {
	u, _ := url.Parse("http://127.0.0.1:1")
	h := NewHTTP(http.DefaultClient, u, "")
	var changed atomic.Int64
	h.OnChanged(func() { changed.Add(1) })
	event := "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/tools/list_changed\"}\n\n"
	for split := 1; split < len(event); split++ {
		before := changed.Load()
		handler := h.Watch(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			_, _ = w.Write([]byte(event[:split]))
			_, _ = w.Write([]byte(event[split:]))
		}))
		handler.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/mcp", nil))
		if changed.Load() == before {
			t.Fatalf("split at %d: list_changed not seen", split)
		}
	}
	before := changed.Load()
	h.Watch(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte(`data: {"jsonrpc":"2.0","method":"notifications/resources/list_changed"}` + "\n\n"))
	})).ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/mcp", nil))
	if changed.Load() != before {
		t.Error("another list's change made the tools be listed again")
	}
}

// TestHTTPListsWithTheConfiguredHost: a server that allows only its
// public host name (as SDKs do against DNS rebinding, given a list of
// allowed hosts) refuses the lister with the upstream URL's Host, and
// answers it with the Host configured (--upstream-host).
func TestHTTPListsWithTheConfiguredHost(t *testing.T) {
	s := mcp.NewServer(&mcp.Implementation{Name: "named", Version: "1"}, nil)
	mcp.AddTool(s, &mcp.Tool{Name: "c_read", Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true}},
		func(context.Context, *mcp.CallToolRequest, struct{}) (*mcp.CallToolResult, struct{}, error) {
			return &mcp.CallToolResult{}, struct{}{}, nil
		})
	sdk := mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return s }, &mcp.StreamableHTTPOptions{DisableLocalhostProtection: true})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Host != "mcp.shop.svc" {
			http.Error(w, "Forbidden: invalid Host header", http.StatusForbidden)
			return
		}
		sdk.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	if err := NewHTTP(http.DefaultClient, u, "").List(t.Context(), engine.NewToolHints()); err == nil || !strings.Contains(err.Error(), "403") {
		t.Fatalf("listing with the upstream URL's Host: %v, want the server's 403", err)
	}
	hints := engine.NewToolHints()
	if err := NewHTTP(http.DefaultClient, u, "mcp.shop.svc").List(t.Context(), hints); err != nil {
		t.Fatalf("listing with the configured Host: %v", err)
	}
	if !hints.ReadOnly("c_read") {
		t.Error("c_read was not listed as read-only")
	}
}

// TestClientsCannotRedirectTheListing: a client's POST through the proxy,
// to another path and under another Host of the same server (where a tool
// is marked idempotent), does not move the sidecar's own listing there:
// the listing stays at the configured path and Host.
func TestClientsCannotRedirectTheListing(t *testing.T) {
	prod := mcp.NewServer(&mcp.Implementation{Name: "prod", Version: "1"}, nil)
	sandbox := mcp.NewServer(&mcp.Implementation{Name: "sandbox", Version: "1"}, nil)
	noop := func(context.Context, *mcp.CallToolRequest, struct{}) (*mcp.CallToolResult, struct{}, error) {
		return &mcp.CallToolResult{}, struct{}{}, nil
	}
	mcp.AddTool(prod, &mcp.Tool{Name: "charge"}, noop)
	mcp.AddTool(sandbox, &mcp.Tool{Name: "charge", Annotations: &mcp.ToolAnnotations{IdempotentHint: true}}, noop)
	opts := &mcp.StreamableHTTPOptions{DisableLocalhostProtection: true}
	mux := http.NewServeMux()
	mux.Handle("/mcp", mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return prod }, opts))
	mux.Handle("/sandbox/mcp", mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return sandbox }, opts))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	h := NewHTTP(http.DefaultClient, u, "")
	req := httptest.NewRequest(http.MethodPost, "http://sandbox.example/sandbox/mcp", strings.NewReader("{}"))
	req.Header.Set("Mcp-Protocol-Version", "2025-11-25")
	h.Watch(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})).ServeHTTP(httptest.NewRecorder(), req)
	e := engine.New(engine.Options{Store: store.NewMemory(10)})
	if err := h.List(t.Context(), e.Hints()); err != nil {
		t.Fatalf("listing: %v", err)
	}
	if !e.Hints().Known("charge") {
		t.Fatal("charge was not listed")
	}
	if !e.Deduplicates("charge") {
		t.Error("the listing followed a client to /sandbox/mcp, where charge is idempotentHint: true: charge on /mcp is passed through")
	}
}
