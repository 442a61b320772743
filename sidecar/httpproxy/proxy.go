// Package httpproxy is the Streamable HTTP transport of the sidecar: a
// reverse proxy that forwards everything byte for byte and hands only
// deduplicated tools/call requests to the engine.
package httpproxy

import (
	"crypto/tls"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/tracing"
)

// Header names the proxy reads or writes.
const (
	HeaderIdempotencyKey = "Idempotency-Key"
	HeaderReplayed       = "Idempotent-Replayed"
	HeaderSessionID      = "Mcp-Session-Id"
	HeaderMethod         = "Mcp-Method"
	HeaderName           = "Mcp-Name"
)

// Defaults for Options.
const (
	DefaultMaxBodyBytes     = 4 << 20
	DefaultMaxResponseBytes = 16 << 20
	DefaultDeleteHold       = 5 * time.Minute
	// DefaultClientWriteTimeout bounds how long one write to a client of a
	// deduplicated call may stall before the client is detached.
	DefaultClientWriteTimeout = 10 * time.Second
)

// Options configure a Proxy.
type Options struct {
	// Upstream is the MCP server's base URL; the request path is appended.
	Upstream *url.URL
	Engine   *engine.Engine
	// MaxBodyBytes bounds a request body (DefaultMaxBodyBytes if 0).
	MaxBodyBytes int64
	// MaxResponseBytes bounds one upstream response message of a
	// deduplicated call (DefaultMaxResponseBytes if 0).
	MaxResponseBytes int64
	// DeleteHold bounds how long a session DELETE waits for the session's
	// deduplicated calls to finish (DefaultDeleteHold if 0).
	DeleteHold time.Duration
	// ClientWriteTimeout bounds how long a write to the client of a
	// deduplicated call may stall: a client that stops reading is
	// detached, and the call goes on and is stored
	// (DefaultClientWriteTimeout if 0).
	ClientWriteTimeout time.Duration
	// ResumeGrace is how long past the server's retry interval the sidecar
	// waits for a client to resume a pending call's stream before it
	// resumes it itself (DefaultResumeGrace if 0).
	ResumeGrace time.Duration
	// Transport reaches the upstream (a tuned http.Transport if nil).
	Transport http.RoundTripper
	// Dialer connects the default Transport to the upstream, at the pod's
	// IP first (dial.go); nil: at the upstream URL's host. Its addresses
	// are the upstream's own in a legacy SSE endpoint.
	Dialer *UpstreamDialer
	Logger *slog.Logger
	// Registerer takes the transport's metrics (nil: not registered).
	Registerer prometheus.Registerer
	// MaxStreamsPerPrincipal and MaxStreams bound the requests held open
	// at once (POSTs until their response ends, GET streams), for one
	// principal (callers with no principal count as one) and in all. Over
	// a bound a request is answered 429 or 503 with a JSON-RPC error
	// (mcpmsg.CodeOverloaded). 0 means the defaults; negative, no bound.
	MaxStreamsPerPrincipal int
	MaxStreams             int
	// ToolsListPath is the MCP endpoint's path at the upstream, where the
	// sidecar's own tool listing goes ("": the Upstream URL's path, or
	// /mcp). A tools/list response that passes through teaches Auto only
	// when its request went there (with no query of the client's): a
	// client must not change what Auto believes by listing another
	// endpoint of the server.
	ToolsListPath string
	// ToolsListHost, if set, is the Host of the sidecar's own listing
	// (--upstream-host); then a tools/list response that passes through
	// teaches Auto only when its request carried that Host too.
	ToolsListHost string
	// Host, if set, is the Host of every request sent upstream, in place
	// of the client's: the upstream's own host, for a remote server that
	// serves (and checks) its public name.
	Host string
	// TLSClientConfig configures the default Transport's TLS to an
	// https:// upstream (nil: the system's roots, the URL's host as the
	// server name).
	TLSClientConfig *tls.Config
}

// Proxy is an http.Handler.
type Proxy struct {
	opts    Options
	rp      *httputil.ReverseProxy
	engine  *engine.Engine
	log     *slog.Logger
	cancels *engine.InFlight[struct{}]
	flights *flights
	legacy  legacyHub  // legacy HTTP+SSE sessions (legacy.go)
	clients clientCaps // what each session's client declared (caps.go)
	resumes resumeHub  // calls whose response comes on a resumed stream (resume.go)
	streams *streams   // requests held open, bounded (limits.go)
	taps    tapBudget  // what tools/list taps hold, bounded (tap.go)
	// sharedCalls counts legacy tools/call requests not deduplicated
	// because two live sessions share their endpoint.
	sharedCalls prometheus.Counter
}

// NewTransport returns the transport the proxy uses by default: many idle
// connections to the one upstream, and no transparent compression, so SSE
// bytes pass as the server wrote them.
func NewTransport() *http.Transport {
	return &http.Transport{
		Proxy:               nil,
		MaxIdleConns:        1024,
		MaxIdleConnsPerHost: 1024,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
}

// New returns a proxy to o.Upstream.
func New(o Options) *Proxy {
	if o.MaxBodyBytes <= 0 {
		o.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if o.MaxResponseBytes <= 0 {
		o.MaxResponseBytes = DefaultMaxResponseBytes
	}
	if o.DeleteHold <= 0 {
		o.DeleteHold = DefaultDeleteHold
	}
	if o.ClientWriteTimeout <= 0 {
		o.ClientWriteTimeout = DefaultClientWriteTimeout
	}
	if o.ResumeGrace <= 0 {
		o.ResumeGrace = DefaultResumeGrace
	}
	if o.Transport == nil {
		t := NewTransport()
		if o.Dialer != nil {
			t.DialContext = o.Dialer.DialContext
		}
		if o.TLSClientConfig != nil {
			t.TLSClientConfig = o.TLSClientConfig.Clone()
		}
		// The direct path never resends; what it passes to the Transport
		// goes as noResend makes it.
		o.Transport = newDirectTransport(t)
	} else {
		o.Transport = noResend{next: o.Transport}
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.ToolsListPath == "" {
		o.ToolsListPath = DefaultToolsListPath(o.Upstream)
	}
	p := &Proxy{
		opts:    o,
		engine:  o.Engine,
		log:     o.Logger,
		cancels: engine.NewInFlight[struct{}](engine.CancelGrace),
		flights: newFlights(),
		streams: newStreams(o.MaxStreamsPerPrincipal, o.MaxStreams),
		sharedCalls: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idemcp_legacy_shared_endpoint_calls_total",
			Help: "Legacy SSE tools/call requests forwarded without dedup because two live sessions shared their endpoint.",
		}),
	}
	if o.Registerer != nil {
		o.Registerer.MustRegister(p.sharedCalls, p.streams.open)
	}
	p.legacy.shared = func(endpoint string) {
		p.log.Warn("Two live legacy SSE sessions share one endpoint; their calls are forwarded without dedup while they do",
			"endpoint", endpoint)
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite:        p.rewrite,
		Transport:      o.Transport,
		FlushInterval:  -1,
		BufferPool:     copyBufs{},
		ModifyResponse: p.modifyResponse,
		ErrorHandler:   p.upstreamError,
		ErrorLog:       slog.NewLogLogger(o.Logger.Handler(), slog.LevelDebug),
	}
	return p
}

// DefaultToolsListPath is where the MCP endpoint is at upstream, when
// nothing else says: the URL's path, or /mcp.
func DefaultToolsListPath(upstream *url.URL) string {
	if upstream.Path == "" || upstream.Path == "/" {
		return "/mcp"
	}
	return upstream.Path
}

type ctxKey int

const toolsListKey ctxKey = 0

// allowedMethods are the methods MCP's transports use: POST, GET and
// DELETE (Streamable HTTP and legacy SSE), and OPTIONS, the CORS preflight
// a browser client sends first, which only the MCP server can answer.
const allowedMethods = "GET, POST, DELETE, OPTIONS"

// callInfo is what a tools/call's span says of its request.
func (p *Proxy) callInfo(r *http.Request, tool string, id json.RawMessage, meta map[string]json.RawMessage) engine.CallInfo {
	if !tracing.Built {
		return engine.CallInfo{}
	}
	return engine.CallInfo{
		Tool: tool, RequestID: id, Meta: meta, Transport: "tcp",
		Session: r.Header.Get(HeaderSessionID), ProtocolVersion: r.Header.Get("Mcp-Protocol-Version"),
		Header: tracing.FromHeader(r.Header),
	}
}

var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// headerFlushDelay is how long a response header waits for the first bytes
// of its body, so that both leave in one write: a server's header and its
// response event usually arrive together, and flushing each alone costs a
// write and a wake-up of the client per call. A body that takes longer
// (a tool that runs for a while) gets its header sent after the delay.
const headerFlushDelay = 5 * time.Millisecond

// sinkChunk bounds one write, so the deadline measures a stall, not the
// time a large event takes on a slow link.
const sinkChunk = 64 << 10

// tailBufs holds relayTail's buffers, and the passthrough path's
// (copyBufs): almost every stream ends right after its response, and a
// fresh 32 KiB buffer per call was most of the bytes an executed call
// allocated.
var tailBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// copyBufs is the passthrough path's ReverseProxy.BufferPool, from
// tailBufs: without one, ReverseProxy makes a 32 KiB buffer for every
// response it copies, which was the largest allocation of a passthrough
// call.
type copyBufs struct{}

func (copyBufs) Get() []byte { return *tailBufs.Get().(*[]byte) }

// Put takes back what Get gave (ReverseProxy returns the slice whole);
// the pointer it stores is 24 bytes, against the 32 KiB it saves.
func (copyBufs) Put(b []byte) {
	if cap(b) == 32<<10 {
		b = b[:cap(b)]
		tailBufs.Put(&b)
	}
}
