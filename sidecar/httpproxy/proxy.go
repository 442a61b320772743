// Package httpproxy is the Streamable HTTP transport of the sidecar: a
// reverse proxy that forwards everything byte for byte and hands only
// deduplicated tools/call requests to the engine.
package httpproxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemcp/idemcp/internal/tracing"
	"github.com/idemcp/idemcp/sidecar/engine"
	"github.com/idemcp/idemcp/sidecar/mcpmsg"
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
	client  *http.Client
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
		o.Transport = t
	}
	o.Transport = noResend{next: o.Transport}
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
		client: &http.Client{
			Transport:     o.Transport,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		},
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

// ServeHTTP implements http.Handler.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet, http.MethodPost, http.MethodDelete, http.MethodOptions:
	default:
		// Nothing else is an MCP request, and none is forwarded: CONNECT
		// would ask the server for a tunnel, TRACE would echo the
		// caller's headers back, and a server's router may treat PUT or
		// HEAD like POST or GET behind the dedup's back.
		w.Header().Set("Allow", allowedMethods)
		w.Header().Set("Connection", "close")
		writeError(w, r, http.StatusMethodNotAllowed, nil, mcpmsg.CodeInvalidRequest,
			fmt.Sprintf("method %s is not used by MCP; the idemcp sidecar takes %s", r.Method, allowedMethods))
		return
	}
	release, ok := p.admit(w, r)
	if !ok {
		return
	}
	defer release()
	if r.Method == http.MethodGet {
		if calls := p.resumes.match(r.Header.Get(HeaderSessionID), r.Header.Get(headerLastEventID)); len(calls) > 0 {
			p.serveResumedStream(w, r, calls)
			return
		}
	}
	if p.serveLegacy(w, r) {
		return
	}
	if r.Method == http.MethodDelete {
		p.serveDelete(w, r)
		return
	}
	if r.Method != http.MethodPost {
		p.rp.ServeHTTP(w, r) // GET streams, OPTIONS: untouched
		return
	}
	// A server may answer before it has read the whole request (an SSE
	// stream starts at once); without full duplex, Go's HTTP/1 server
	// would close the request body under the proxy and cut the response.
	_ = http.NewResponseController(w).EnableFullDuplex()
	if r.ProtoMajor == 1 && r.Body != nil && r.Body != http.NoBody {
		// HTTP/2 frames each stream's body: nothing of it is left on the
		// connection. HTTP/1 needs care (body.go).
		var b *duplexBody
		r, b = guardBody(r)
		defer b.end(w)
	}
	// 2026-07-28 names the method (and tool) in headers: most requests are
	// classified without reading the body at all.
	hdrMethod := r.Header.Get(HeaderMethod)
	switch hdrMethod {
	case "", "tools/call", "notifications/cancelled":
	case "tools/list":
		p.rp.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), toolsListKey, true)))
		return
	default:
		p.rp.ServeHTTP(w, r)
		return
	}
	if hdrMethod == "tools/call" && r.Header.Get(HeaderIdempotencyKey) == "" {
		if name, ok := decodeHeaderValue(r.Header.Get(HeaderName)); ok && name != "" && !p.engine.Deduplicates(name) {
			// If the header lies about the body, the server rejects the
			// mismatch; nothing here depends on it.
			p.engine.CountPassthrough(name)
			ctx, span := p.engine.StartCall(r.Context(), p.callInfo(r, name, nil, nil))
			defer span.End()
			span.Passthrough()
			p.rp.ServeHTTP(w, r.WithContext(ctx))
			return
		}
	}

	body, ok := p.readBody(w, r)
	if !ok {
		return
	}
	kind, err := mcpmsg.Sniff(body)
	if err != nil {
		writeError(w, r, http.StatusBadRequest, nil, mcpmsg.ErrorCode(err), err.Error())
		return
	}
	if kind == mcpmsg.Batch {
		// Batches (2025-03-26 only) are forwarded whole, not deduplicated.
		p.forwardBody(w, r, body, false)
		return
	}
	msg, err := mcpmsg.Parse(body)
	if err != nil {
		// Strict: a message the server could read another way is refused.
		var id json.RawMessage
		if msg != nil {
			id = msg.ID
		}
		status := http.StatusBadRequest
		if mcpmsg.ErrorCode(err) == mcpmsg.CodeInvalidParams && len(id) > 0 {
			status = http.StatusOK // as for every invalid-params answer
		}
		writeError(w, r, status, id, mcpmsg.ErrorCode(err), err.Error())
		return
	}
	switch msg.Method {
	case "initialize":
		p.forwardInitialize(w, r, body, msg)
	case "tools/call":
		p.serveToolCall(w, r, body, msg, hdrMethod)
	case "tools/list":
		p.forwardBody(w, r, body, true)
	case "notifications/cancelled":
		p.serveCancel(w, r, body, msg)
	default:
		p.forwardBody(w, r, body, false)
	}
}

// readBody reads a request body within --max-body-bytes, or answers the
// client with the reason it cannot and returns false.
func (p *Proxy) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, p.opts.MaxBodyBytes))
	if err == nil {
		return body, true
	}
	var tooBig *http.MaxBytesError
	if errors.As(err, &tooBig) {
		writeError(w, r, http.StatusRequestEntityTooLarge, nil, mcpmsg.CodeInvalidRequest,
			fmt.Sprintf("request body is over %d bytes, the sidecar's limit (--max-body-bytes)", p.opts.MaxBodyBytes))
		return nil, false
	}
	writeError(w, r, http.StatusBadRequest, nil, mcpmsg.CodeParseError, fmt.Sprintf("reading request body: %v", err))
	return nil, false
}

func (p *Proxy) serveToolCall(w http.ResponseWriter, r *http.Request, body []byte, msg *mcpmsg.Message, hdrMethod string) {
	if len(msg.ID) == 0 {
		p.forwardBody(w, r, body, false) // a notification: nothing to answer or dedup
		return
	}
	tc, err := engine.CallOf(msg)
	if err != nil {
		p.writeEngineError(w, r, msg.ID, err)
		return
	}
	ctx, span := p.engine.StartCall(r.Context(), p.callInfo(r, tc.Name, msg.ID, tc.Meta))
	defer span.End()
	r = r.WithContext(ctx)
	if hdrMethod != "" {
		if name, ok := decodeHeaderValue(r.Header.Get(HeaderName)); !ok || name != tc.Name {
			// Headers and body disagree: dedup nothing, let the server reject it.
			span.Passthrough()
			p.forwardBody(w, r, body, false)
			return
		}
	}
	key, hasKey := headerValue(r.Header, HeaderIdempotencyKey)
	principalHeader := p.engine.Policy().PrincipalHeader
	session := r.Header.Get(HeaderSessionID)
	plan, err := p.engine.PlanCall(ctx, tc, engine.Caller{
		HeaderKey:    key,
		HasHeaderKey: hasKey,
		Principal:    r.Header.Get(principalHeader),
		Session:      session,
		Listing:      p.listingContext(session, principalHeader, r.Header.Get(principalHeader)),
	})
	if err != nil {
		span.Error(mcpmsg.ErrorCode(err))
		p.writeEngineError(w, r, msg.ID, err)
		return
	}
	if plan == nil { // counted by Plan
		span.Forwarded()
		p.forwardBody(w, r, body, false)
		return
	}
	p.serveDedup(w, r, body, msg, plan)
}

// callInfo is what a tools/call's span says of its request.
func (p *Proxy) callInfo(r *http.Request, tool string, id json.RawMessage, meta map[string]json.RawMessage) engine.CallInfo {
	return engine.CallInfo{
		Tool: tool, RequestID: id, Meta: meta, Transport: "tcp",
		Session: r.Header.Get(HeaderSessionID), ProtocolVersion: r.Header.Get("Mcp-Protocol-Version"),
		Header: tracing.FromHeader(r.Header),
	}
}

func headerValue(h http.Header, name string) (string, bool) {
	v, ok := h[name]
	if !ok || len(v) == 0 {
		return "", false
	}
	return v[0], true
}

func (p *Proxy) serveDedup(w http.ResponseWriter, r *http.Request, body []byte, msg *mcpmsg.Message, plan *engine.Plan) {
	cancelKey := p.cancelKey(r, msg.ID)
	call := p.cancels.Acquire(cancelKey, struct{}{})
	defer p.cancels.Release(call)

	// The session's DELETE waits for this call from now, not only once it
	// is forwarded: a client that gives up and closes its session at once
	// sends the DELETE while the call may still be claimed. Forwarded then,
	// the DELETE could reach the server as the call does, and the server
	// would drop the call's response with the session: nothing stored, and
	// the retry runs the call again.
	flight := sync.OnceFunc(p.flights.start(r.Header.Get(HeaderSessionID)))
	var forwarded atomic.Bool
	detached := false
	// Also if Execute panics (net/http recovers it): the session's DELETE
	// must not wait out its whole hold for a call that never left.
	defer func() {
		if !forwarded.Load() && !detached {
			flight()
		}
	}()
	s := newSink(w, p.opts.ClientWriteTimeout)
	defer s.detach()
	out, err := p.engine.Execute(r.Context(), plan, func(ctx context.Context) (engine.Upstream, error) {
		forwarded.Store(true)
		p.cancels.Hold(call)
		handedOn := false
		defer func() {
			if !handedOn {
				flight()
				p.cancels.Release(call)
			}
		}()
		up, err := p.forwardDedup(ctx, r, body, msg.ID, s, plan.Policy.LeaseDuration)
		if up.Later == nil {
			return up, err
		}
		// While the response is awaited, the session's DELETE waits and
		// the client's cancel is still not forwarded.
		handedOn = true
		later := up.Later
		up.Later = func(ctx context.Context) (engine.Upstream, error) {
			defer p.cancels.Release(call)
			defer flight()
			return later(ctx)
		}
		return up, err
	})
	detached = errors.Is(err, engine.ErrDetached)
	if !forwarded.Load() && !detached {
		// Replayed, refused, or given up before it was claimed: nothing
		// of this call will reach the server. (ErrDetached: the call was
		// claimed and its forward, which may not have begun yet, lets the
		// DELETE go when it ends.)
		flight()
	}
	var ee *engine.Error
	switch {
	case err == nil && out.Kind == engine.Replayed:
		w.Header().Set(HeaderReplayed, "true")
		writeMessage(w, r, http.StatusOK, mcpmsg.WithID(out.Response, msg.ID))
	case err == nil:
		// Executed or forwarded: the response is already relayed; what the
		// server streams after it follows.
		s.relayTail()
	case errors.As(err, &ee) && s.hasStarted():
		// The response had begun (a forward that panicked after relaying
		// its header): an error appended to it would be garbage, and the
		// sink's header timer may still write. Break it off.
		s.detach()
		panic(http.ErrAbortHandler)
	case errors.As(err, &ee):
		s.detach()
		engine.CallSpanFrom(r.Context()).Error(ee.Code)
		writeMessage(w, r, http.StatusOK, mcpmsg.ErrorResponse(msg.ID, ee.Code, ee.Message))
	case errors.Is(err, engine.ErrDetached), r.Context().Err() != nil:
		p.log.Debug("Client left while its call runs upstream", "tool", plan.Tool)
	default:
		if !s.hasStarted() {
			writeError(w, r, http.StatusBadGateway, msg.ID, mcpmsg.CodeUpstreamUnavailable,
				fmt.Sprintf("the MCP server could not be reached (%v); nothing was stored, so a retry runs the call", err))
		}
	}
	if s.abortRequested() {
		// The server's response broke off: so does the client's, as it
		// would without the sidecar.
		panic(http.ErrAbortHandler)
	}
}

// forwardDedup sends a deduplicated call upstream with ctx (detached from
// the client), relays the response to the client while it is there, and
// returns the final response message for the engine to store. The client
// sees what the server sent: the same bytes, and an abort where the server
// aborted. A stream that ends after an event id but before the response
// leaves the outcome pending (Upstream.Later, resume.go).
func (p *Proxy) forwardDedup(ctx context.Context, in *http.Request, body []byte, id json.RawMessage, s *sink, lease time.Duration) (engine.Upstream, error) {
	req, err := p.newUpstreamRequest(ctx, in, body)
	if err != nil {
		return engine.Upstream{}, err
	}
	readableAcceptEncoding(req.Header) // the response must be readable to find ours
	resp, err := p.client.Do(req)      //nolint:bodyclose // closed below, or by the sink once the rest is relayed
	if err != nil {
		return engine.Upstream{}, fmt.Errorf("calling the MCP server: %w", err)
	}
	// The response is ours alone: relay its header without a copy, read
	// what the sidecar needs of it first.
	h := resp.Header
	encodings := h.Values("Content-Encoding")
	mt, _, _ := mime.ParseMediaType(h.Get("Content-Type"))
	removeHopHeaders(h)
	up := engine.Upstream{Status: resp.StatusCode}
	rb := &readTracker{r: resp.Body}
	if resp.StatusCode < 200 || resp.StatusCode > 299 || mt != "text/event-stream" {
		defer drainAndClose(resp.Body)
		s.header(resp.StatusCode, h)
		// Relay as it comes; keep a copy up to --max-response-bytes.
		keep := &capped{limit: p.opts.MaxResponseBytes}
		n, err := io.Copy(io.MultiWriter(s, keep), rb)
		if err != nil {
			s.abort()
			return engine.Upstream{}, fmt.Errorf("reading the MCP server's response: %w", err)
		}
		if !keep.over && len(keep.buf) > 0 && len(encodings) > 0 {
			// Relayed as the server sent it; read decoded.
			keep.buf, keep.over = decodeAll(keep.buf, encodings, p.opts.MaxResponseBytes)
		}
		switch {
		case keep.over:
			up.TooLarge, up.Size = true, n
		case up.Status >= 200 && up.Status <= 299 && isResponseTo(keep.buf, id):
			// A response to another id is not this call's outcome.
			up.Response, up.Valid = keep.buf, true
		}
		return up, nil
	}
	var c *pendingCall // set once the stream carried an event id
	events, err := decodeBody(rb, encodings)
	if err != nil {
		// The call ran, but its response cannot be read: relay it, keep
		// nothing, and do not run it again.
		s.header(resp.StatusCode, h)
		n, _ := io.Copy(s, rb)
		drainAndClose(resp.Body)
		up.TooLarge, up.Size = true, n
		return up, nil
	}
	if len(h.Values("Content-Encoding")) > 0 {
		// Events are relayed one by one as they are read, so a compressed
		// stream is relayed decoded: what the client's HTTP stack would
		// have made of it.
		h.Del("Content-Encoding")
		h.Del("Content-Length")
	}
	s.header(resp.StatusCode, h)
	er := mcpmsg.NewEventReader(events, int(p.opts.MaxResponseBytes))
	var oversized int64
	for {
		ev, err := er.Next()
		if errors.Is(err, mcpmsg.ErrEventTooLarge) {
			// Relay it whole without keeping it, and read on: if it was
			// not our response, the response still follows.
			s.write(ev.Raw)
			n, serr := er.SkipEvent(s, nil)
			oversized = max(oversized, int64(len(ev.Raw))+n)
			if serr == nil {
				continue
			}
			err = serr
		} else if len(ev.Raw) > 0 {
			if c == nil {
				if ev.HasID && ev.ID != "" {
					// From here on a client GET resuming this stream is
					// tapped: register before the client can see the id.
					c = p.newPendingCall(in, id)
					p.resumes.add(c)
				}
			}
			if c != nil {
				c.sawEvent(ev.Raw)
			}
			s.write(ev.Raw)
			if err == nil && ev.HasData && isResponseTo(ev.Data, id) {
				if c != nil {
					p.resumes.remove(c)
				}
				up.Response, up.Valid = bytes.Clone(ev.Data), true
				s.setTail(resp.Body, er.Rest(), rb)
				return up, nil
			}
		}
		if err == nil {
			continue
		}
		drainAndClose(resp.Body)
		aborted := rb.err != nil
		if aborted {
			s.abort()
		}
		if c != nil {
			if got, ok := c.result(); ok {
				// A client resumed the stream while this one was open,
				// and its stream brought the response.
				p.resumes.remove(c)
				return got, nil
			}
			if oversized == 0 && c.resumeFrom() != "" {
				// Ended after an event id: the response comes on a
				// resumed stream (SEP-1699 polling), not a failure.
				up.Later = func(ctx context.Context) (engine.Upstream, error) {
					return p.awaitPending(ctx, c, lease)
				}
				return up, nil
			}
			p.resumes.remove(c)
		}
		switch {
		case oversized > 0:
			// Our response never came whole: it was most likely the
			// event too large to keep. The call ran.
			up.TooLarge, up.Size = true, oversized
			return up, nil
		case aborted:
			return engine.Upstream{}, fmt.Errorf("reading the MCP server's event stream: %w", rb.err)
		case !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF):
			return engine.Upstream{}, fmt.Errorf("reading the MCP server's event stream: %w", err)
		}
		return up, nil // ended without the response: released, a retry runs
	}
}

// drainAndClose reads what is left of a response body before closing it,
// so the connection goes back to the pool instead of being torn down; a
// server that keeps the stream open is cut off after a moment.
func drainAndClose(body io.ReadCloser) {
	go func() {
		t := time.AfterFunc(2*time.Second, func() { _ = body.Close() })
		_, _ = io.CopyN(io.Discard, body, 256<<10)
		t.Stop()
		_ = body.Close()
	}()
}

// capped keeps what is written to it up to limit bytes; past that it keeps
// nothing and says so.
type capped struct {
	buf   []byte
	limit int64
	over  bool
}

func (c *capped) Write(b []byte) (int, error) {
	if !c.over {
		if int64(len(c.buf)+len(b)) > c.limit {
			c.over, c.buf = true, nil
		} else {
			c.buf = append(c.buf, b...)
		}
	}
	return len(b), nil
}

func isResponseTo(data []byte, id json.RawMessage) bool {
	return mcpmsg.IsResponseTo(data, id)
}

// serveCancel keeps a client's cancel of a deduplicated call from reaching
// the server: the call completes and is stored for the retry that follows.
func (p *Proxy) serveCancel(w http.ResponseWriter, r *http.Request, body []byte, msg *mcpmsg.Message) {
	// Parse has checked the params: the id is read as the server reads it.
	if reqID, _ := mcpmsg.CancelledRequestID(msg.Params); len(reqID) > 0 &&
		p.swallowsCancel(p.cancelKey(r, reqID)) {
		w.WriteHeader(http.StatusAccepted)
		return
	}
	p.forwardBody(w, r, body, false)
}

// serveDelete holds a session's DELETE until its deduplicated calls have
// finished upstream: a client that drops and closes its session must not
// make the server discard a result its retry is about to ask for.
func (p *Proxy) serveDelete(w http.ResponseWriter, r *http.Request) {
	if wait := p.flights.wait(r.Header.Get(HeaderSessionID)); wait != nil {
		timer := time.NewTimer(p.opts.DeleteHold)
		select {
		case <-wait:
		case <-timer.C:
			p.log.Warn("Forwarding a session DELETE while deduplicated calls still run", "hold", p.opts.DeleteHold)
		}
		timer.Stop()
		// The client may have given up on its DELETE meanwhile; the
		// server should still hear it.
		r = r.WithContext(context.WithoutCancel(r.Context()))
	}
	p.rp.ServeHTTP(w, r)
}

// cancelKey names a request of this caller: principal and session (a
// stateless server's callers have no session, so their principals tell
// them apart).
func (p *Proxy) cancelKey(r *http.Request, id json.RawMessage) string {
	// With a session, the session alone: a token refreshed mid-call must
	// not let the cancel through.
	if sess := r.Header.Get(HeaderSessionID); sess != "" {
		return engine.CancelKey(id, "http-session", sess)
	}
	principal := r.Header.Get(p.engine.Policy().PrincipalHeader)
	if principal == "" {
		// Nothing tells this caller from other anonymous ones: its cancel
		// goes to the server, never to another caller's call.
		return engine.NoCancelKey
	}
	return engine.CancelKey(id, "http", principal)
}

// swallowsCancel reports whether a cancel for this request id belongs to a
// deduplicated call and must not reach the server.
func (p *Proxy) swallowsCancel(key string) bool {
	_, ok := p.cancels.Get(key)
	return ok
}

func (p *Proxy) forwardBody(w http.ResponseWriter, r *http.Request, body []byte, toolsList bool) {
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	if toolsList {
		r = r.WithContext(context.WithValue(r.Context(), toolsListKey, true))
	}
	p.rp.ServeHTTP(w, r)
}

func (p *Proxy) target(u *url.URL) *url.URL {
	t := *p.opts.Upstream
	if t.RawPath != "" || u.RawPath != "" {
		// An escaped path (a%2Fb) stays escaped: join the escaped forms
		// too and keep them as the raw path.
		t.RawPath = joinPath(t.EscapedPath(), u.EscapedPath())
	}
	t.Path = joinPath(t.Path, u.Path)
	switch {
	case t.RawQuery == "":
		t.RawQuery = u.RawQuery
	case u.RawQuery != "":
		t.RawQuery += "&" + u.RawQuery
	}
	return &t
}

// joinPath appends a request's path to the upstream URL's, with one slash
// between them.
func joinPath(base, path string) string {
	switch {
	case strings.HasSuffix(base, "/") && strings.HasPrefix(path, "/"):
		return base + path[1:]
	case !strings.HasSuffix(base, "/") && !strings.HasPrefix(path, "/") && path != "":
		return base + "/" + path
	}
	return base + path
}

func (p *Proxy) upstreamError(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() != nil {
		return // the client left
	}
	p.log.Warn("MCP server unreachable", "err", err)
	writeError(w, r, http.StatusBadGateway, nil, mcpmsg.CodeUpstreamUnavailable,
		fmt.Sprintf("the MCP server could not be reached: %v", err))
}

func (p *Proxy) writeEngineError(w http.ResponseWriter, r *http.Request, id json.RawMessage, err error) {
	var ee *engine.Error
	if !errors.As(err, &ee) {
		ee = &engine.Error{Code: mcpmsg.CodeInternalError, Message: err.Error()}
	}
	writeMessage(w, r, http.StatusOK, mcpmsg.ErrorResponse(id, ee.Code, ee.Message))
}

func writeError(w http.ResponseWriter, r *http.Request, status int, id json.RawMessage, code int, message string) {
	writeMessage(w, r, status, mcpmsg.ErrorResponse(id, code, message))
}

// writeMessage answers one JSON-RPC message as JSON, or as a single SSE
// event when the client accepts only event streams.
func writeMessage(w http.ResponseWriter, r *http.Request, status int, msg []byte) {
	closeIfBodyUnread(r.Context(), status, w.Header())
	if prefersSSE(r.Header.Get("Accept")) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Cache-Control", "no-cache")
		w.WriteHeader(status)
		_, _ = w.Write(mcpmsg.AppendEvent(nil, msg))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(msg)
}

func prefersSSE(accept string) bool {
	if accept == "" {
		return false
	}
	for _, part := range strings.Split(accept, ",") {
		mt, _, _ := mime.ParseMediaType(strings.TrimSpace(part))
		switch mt {
		case "application/json", "application/*", "*/*":
			return false
		}
	}
	return strings.Contains(accept, "text/event-stream")
}

var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

func removeHopHeaders(h http.Header) {
	for _, f := range h["Connection"] {
		for _, name := range strings.Split(f, ",") {
			h.Del(strings.TrimSpace(name))
		}
	}
	for _, name := range hopHeaders {
		h.Del(name)
	}
}

// decodeHeaderValue undoes the =?base64?...?= wrapping 2026-07-28 clients
// use for header values that are not plain ASCII.
func decodeHeaderValue(v string) (string, bool) {
	if enc, ok := strings.CutPrefix(v, "=?base64?"); ok {
		if enc, ok = strings.CutSuffix(enc, "?="); ok {
			b, err := base64.StdEncoding.DecodeString(enc)
			return string(b), err == nil
		}
	}
	return v, true
}

// sink writes to a client that may go away: once detached, writes are
// dropped, so a call detached from its client can run to the end. Each
// write has a deadline: a client that stays connected but stops reading is
// detached rather than allowed to stall the call.
type sink struct {
	mu      sync.Mutex
	w       http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	gone    bool
	started bool
	aborted bool      // the server's response broke off: abort the client's
	tail    *tailBody // the server's stream after the response, to relay
	// headerFlush sends a header that no body followed within
	// headerFlushDelay; unflushed says a written header still waits.
	headerFlush *time.Timer
	unflushed   bool
}

// headerFlushDelay is how long a response header waits for the first bytes
// of its body, so that both leave in one write: a server's header and its
// response event usually arrive together, and flushing each alone costs a
// write and a wake-up of the client per call. A body that takes longer
// (a tool that runs for a while) gets its header sent after the delay.
const headerFlushDelay = 5 * time.Millisecond

// tailBody is what is left of an upstream stream once the response passed.
type tailBody struct {
	body io.ReadCloser
	rest io.Reader
	rb   *readTracker
}

func newSink(w http.ResponseWriter, timeout time.Duration) *sink {
	return &sink{w: w, rc: http.NewResponseController(w), timeout: timeout}
}

// sinkChunk bounds one write, so the deadline measures a stall, not the
// time a large event takes on a slow link.
const sinkChunk = 64 << 10

func (s *sink) header(status int, h http.Header) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gone || s.started {
		return
	}
	dst := s.w.Header()
	for k, v := range h {
		dst[k] = v
	}
	s.w.WriteHeader(status)
	s.started = true
	s.unflushed = true
	s.headerFlush = time.AfterFunc(headerFlushDelay, s.flushHeader)
}

// flushHeader sends a header still waiting for its body.
func (s *sink) flushHeader() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.unflushed {
		s.flushLocked()
	}
}

func (s *sink) write(b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for len(b) > 0 && !s.gone {
		chunk := b[:min(len(b), sinkChunk)]
		b = b[len(chunk):]
		_ = s.rc.SetWriteDeadline(time.Now().Add(s.timeout))
		if _, err := s.w.Write(chunk); err != nil {
			s.gone = true
		}
	}
	s.flushLocked()
}

func (s *sink) flushLocked() {
	if s.headerFlush != nil {
		s.headerFlush.Stop()
		s.headerFlush = nil
	}
	s.unflushed = false
	if s.gone {
		return
	}
	_ = s.rc.SetWriteDeadline(time.Now().Add(s.timeout))
	if err := s.rc.Flush(); err != nil {
		s.gone = true
		return
	}
	_ = s.rc.SetWriteDeadline(time.Time{})
}

// Write lets the sink be an io.Writer; a client that left swallows it all.
func (s *sink) Write(b []byte) (int, error) {
	s.write(b)
	return len(b), nil
}

func (s *sink) isGone() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gone
}

func (s *sink) hasStarted() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.started
}

// abort asks the handler to break the client's response off.
func (s *sink) abort() {
	s.mu.Lock()
	s.aborted = true
	s.mu.Unlock()
}

func (s *sink) abortRequested() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.aborted && !s.gone
}

// setTail hands the rest of the server's stream to the handler, which
// relays it after the call is settled.
func (s *sink) setTail(body io.ReadCloser, rest io.Reader, rb *readTracker) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gone {
		drainAndClose(body)
		return
	}
	s.tail = &tailBody{body: body, rest: rest, rb: rb}
}

// tailBufs holds relayTail's buffers: almost every stream ends right after
// its response, and a fresh 32 KiB buffer per call was most of the bytes
// an executed call allocated.
var tailBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// relayTail relays what the server streams after the response, until the
// stream or the client ends.
func (s *sink) relayTail() {
	s.mu.Lock()
	t := s.tail
	s.tail = nil
	s.mu.Unlock()
	if t == nil {
		return
	}
	bp := tailBufs.Get().(*[]byte)
	defer tailBufs.Put(bp)
	buf := *bp
	for {
		n, err := t.rest.Read(buf)
		if n > 0 {
			s.write(buf[:n])
		}
		if s.isGone() {
			drainAndClose(t.body)
			return
		}
		if err != nil {
			if t.rb.err != nil {
				s.abort()
			}
			_ = t.body.Close()
			return
		}
	}
}

func (s *sink) detach() {
	s.mu.Lock()
	s.gone = true
	if s.headerFlush != nil {
		s.headerFlush.Stop()
		s.headerFlush = nil
	}
	t := s.tail
	s.tail = nil
	s.mu.Unlock()
	if t != nil {
		drainAndClose(t.body)
	}
}

// flights counts each session's deduplicated calls running upstream.
type flights struct {
	mu       sync.Mutex
	sessions map[string]*flight
}

type flight struct {
	n    int
	idle chan struct{} // closed when n drops to 0
}

func newFlights() *flights { return &flights{sessions: make(map[string]*flight)} }

func (f *flights) start(session string) (release func()) {
	if session == "" {
		return func() {}
	}
	f.mu.Lock()
	fl, ok := f.sessions[session]
	if !ok {
		fl = &flight{idle: make(chan struct{})}
		f.sessions[session] = fl
	}
	fl.n++
	f.mu.Unlock()
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		fl.n--
		if fl.n == 0 {
			close(fl.idle)
			delete(f.sessions, session)
		}
	}
}

// wait returns a channel closed when the session has no call in flight,
// or nil if it has none now.
func (f *flights) wait(session string) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if fl, ok := f.sessions[session]; ok && session != "" {
		return fl.idle
	}
	return nil
}
