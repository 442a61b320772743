package e2e_test

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/storeopen"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/sidecar/toollist"
	"github.com/idemcp/idemcp/test/mcpserver"
)

// revision is one protocol revision clients speak today. The Go SDK speaks
// 2026-07-28 to a stateless server; against a stateful one it falls back to
// 2025-11-25 with sessions.
type revision struct {
	name      string
	stateless bool
	client    string // ClientSessionOptions.ProtocolVersion
}

var revisions = []revision{
	{name: "2026-07-28", stateless: true},
	{name: "2025-11-25", stateless: false, client: "2025-11-25"},
}

func forEachRevision(t *testing.T, fn func(t *testing.T, rev revision)) {
	for _, rev := range revisions {
		t.Run(rev.name, func(t *testing.T) {
			t.Parallel()
			fn(t, rev)
		})
	}
}

type harness struct {
	rev      revision
	srv      *mcpserver.Server
	upstream *httptest.Server
	proxy    *httptest.Server
	sidecar  *sidecar.Sidecar

	mu    sync.Mutex
	hosts []string
	posts atomic.Int64 // POST requests that reached the server
}

// newHarness starts the counting MCP server, wrapped by mw if given, and a
// sidecar in front of it configured with policyYAML (none: the defaults).
func newHarness(t *testing.T, rev revision, policyYAML string, mw func(http.Handler) http.Handler) *harness {
	t.Helper()
	h := &harness{rev: rev, srv: mcpserver.New()}
	handler := h.srv.Handler(rev.stateless)
	if mw != nil {
		handler = mw(handler)
	}
	inner := handler
	handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if os.Getenv("E2E_TRACE") != "" {
			println("upstream", r.Method, r.Header.Get("Mcp-Session-Id"))
		}
		h.mu.Lock()
		h.hosts = append(h.hosts, r.Host)
		h.mu.Unlock()
		if r.Method == http.MethodPost && r.Header.Get("User-Agent") != toollist.UserAgent {
			h.posts.Add(1) // the sidecar's own tools/list is not the client's traffic
		}
		inner.ServeHTTP(w, r)
	})
	h.upstream = httptest.NewServer(handler)
	t.Cleanup(h.upstream.Close)

	h.sidecar, h.proxy = startSidecar(t, h.upstream.URL, policyYAML)
	return h
}

// startSidecar runs a sidecar with the memory store in front of upstream,
// configured with policyYAML (none: the defaults).
func startSidecar(t *testing.T, upstream, policyYAML string) (*sidecar.Sidecar, *httptest.Server) {
	t.Helper()
	opts := sidecar.Options{Upstream: upstream, LogLevel: "error", Store: storeopen.Options{MemoryMaxEntries: 1000}}
	if policyYAML != "" {
		opts.PolicyFile = writePolicy(t, policyYAML)
	}
	sc, err := sidecar.New(opts)
	if err != nil {
		t.Fatalf("sidecar.New: %v", err)
	}
	proxy := httptest.NewServer(sc.Handler())
	t.Cleanup(proxy.Close)
	return sc, proxy
}

type clientOpts struct {
	headers http.Header
	// anonymous sends no Authorization. Otherwise a client without one in
	// headers sends "Bearer e2e-agent": on a stateless server an anonymous
	// caller has no scope and is not deduplicated.
	anonymous bool
	mcp       *mcp.ClientOptions
	transport *killableTransport
}

// connect opens a real Go SDK client session to url and checks that the
// revision under test was negotiated.
func (h *harness) connect(t *testing.T, url string, o clientOpts) *mcp.ClientSession {
	t.Helper()
	if o.transport == nil {
		o.transport = newKillableTransport()
	}
	if _, ok := o.headers["Authorization"]; !ok && !o.anonymous {
		o.headers = o.headers.Clone()
		if o.headers == nil {
			o.headers = http.Header{}
		}
		o.headers.Set("Authorization", "Bearer e2e-agent")
	}
	client := mcp.NewClient(&mcp.Implementation{Name: "e2e-client", Version: "1.0.0"}, o.mcp)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{
		Endpoint:   url,
		HTTPClient: &http.Client{Transport: &headerTransport{headers: o.headers, next: o.transport}},
		MaxRetries: -1,
	}, &mcp.ClientSessionOptions{ProtocolVersion: h.rev.client})
	if err != nil {
		t.Fatalf("connecting to %s: %v", url, err)
	}
	t.Cleanup(func() { _ = cs.Close() })
	if got := cs.InitializeResult().ProtocolVersion; got != h.rev.name {
		t.Fatalf("negotiated protocol %s, want %s", got, h.rev.name)
	}
	return cs
}

// headerTransport adds fixed headers (Authorization, Idempotency-Key).
type headerTransport struct {
	headers http.Header
	next    http.RoundTripper
}

func (h *headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if len(h.headers) > 0 {
		r = r.Clone(r.Context())
		for k, v := range h.headers {
			r.Header[k] = v
		}
	}
	return h.next.RoundTrip(r)
}

// killableTransport can drop every connection it opened, as a network
// failure would.
type killableTransport struct {
	*http.Transport
	mu    sync.Mutex
	conns []net.Conn
}

func newKillableTransport() *killableTransport {
	k := &killableTransport{}
	d := &net.Dialer{}
	k.Transport = &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		if err == nil {
			k.mu.Lock()
			k.conns = append(k.conns, c)
			k.mu.Unlock()
		}
		return c, err
	}}
	return k
}

func (k *killableTransport) kill() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, c := range k.conns {
		_ = c.Close()
	}
	k.conns = nil
}

func call(ctx context.Context, cs *mcp.ClientSession, tool string, args any, meta mcp.Meta) (*mcp.CallToolResult, error) {
	// The SDK writes its own members into _meta: each call gets a copy.
	return cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args, Meta: maps.Clone(meta)})
}

func mustCall(t *testing.T, cs *mcp.ClientSession, tool string, args any, meta mcp.Meta) *mcp.CallToolResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := call(ctx, cs, tool, args, meta)
	if err != nil {
		t.Fatalf("calling %s: %v", tool, err)
	}
	return res
}

func replayed(res *mcp.CallToolResult) bool {
	v, _ := res.Meta["idemcp.io/replayed"].(bool)
	return v
}

// body is what a user compares between two results: content and
// structured content, not _meta.
func body(t *testing.T, res *mcp.CallToolResult) string {
	t.Helper()
	b, err := json.Marshal(struct {
		Content    []mcp.Content `json:"content"`
		Structured any           `json:"structured"`
		IsError    bool          `json:"isError"`
	}{res.Content, res.StructuredContent, res.IsError})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func rpcCode(err error) int64 {
	var we *jsonrpc.Error
	if errors.As(err, &we) {
		return we.Code
	}
	return 0
}
