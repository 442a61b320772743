// Package httpproxy is the Streamable HTTP transport of the sidecar: a
// reverse proxy that forwards everything byte for byte and hands only
// deduplicated tools/call requests to the engine.
package httpproxy

import (
	"bytes"
	"context"
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
	"time"

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
	// Transport reaches the upstream (a tuned http.Transport if nil).
	Transport http.RoundTripper
	Logger    *slog.Logger
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
	legacy  legacyHub // legacy HTTP+SSE sessions (legacy.go)
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
	if o.Transport == nil {
		o.Transport = NewTransport()
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	p := &Proxy{
		opts:    o,
		engine:  o.Engine,
		log:     o.Logger,
		cancels: engine.NewInFlight[struct{}](engine.CancelGrace),
		flights: newFlights(),
		client: &http.Client{
			Transport:     o.Transport,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		},
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(o.Upstream)
			// MCP servers check Host against DNS rebinding: keep the client's.
			pr.Out.Host = pr.In.Host
		},
		Transport:      o.Transport,
		FlushInterval:  -1,
		ModifyResponse: p.tapToolsList,
		ErrorHandler:   p.upstreamError,
		ErrorLog:       slog.NewLogLogger(o.Logger.Handler(), slog.LevelDebug),
	}
	return p
}

type ctxKey int

const toolsListKey ctxKey = 0

// ServeHTTP implements http.Handler.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
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
			p.engine.CountPassthrough()
			p.rp.ServeHTTP(w, r)
			return
		}
	}

	body, ok := p.readBody(w, r)
	if !ok {
		return
	}
	kind, err := mcpmsg.Sniff(body)
	if err != nil {
		writeError(w, r, http.StatusBadRequest, nil, mcpmsg.CodeParseError, err.Error())
		return
	}
	if kind == mcpmsg.Batch {
		// Batches (2025-03-26 only) are forwarded whole, not deduplicated.
		p.forwardBody(w, r, body, false)
		return
	}
	msg, err := mcpmsg.Parse(body)
	if err != nil {
		code := mcpmsg.CodeInvalidRequest
		var id json.RawMessage
		if msg == nil {
			code = mcpmsg.CodeParseError
		} else if len(msg.ID) > 0 && msg.ID[0] != '{' && msg.ID[0] != '[' {
			id = msg.ID
		}
		writeError(w, r, http.StatusBadRequest, id, code, err.Error())
		return
	}
	switch msg.Method {
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
	tc, err := engine.ParseToolCall(msg.Params)
	if err != nil {
		p.writeEngineError(w, r, msg.ID, err)
		return
	}
	if hdrMethod != "" {
		if name, ok := decodeHeaderValue(r.Header.Get(HeaderName)); !ok || name != tc.Name {
			// Headers and body disagree: dedup nothing, let the server reject it.
			p.forwardBody(w, r, body, false)
			return
		}
	}
	key, hasKey := headerValue(r.Header, HeaderIdempotencyKey)
	plan, err := p.engine.Plan(tc, engine.Caller{
		HeaderKey:    key,
		HasHeaderKey: hasKey,
		Principal:    r.Header.Get(p.engine.Policy().PrincipalHeader),
		Session:      r.Header.Get(HeaderSessionID),
	})
	if err != nil {
		p.writeEngineError(w, r, msg.ID, err)
		return
	}
	if plan == nil {
		p.engine.CountPassthrough()
		p.forwardBody(w, r, body, false)
		return
	}
	p.serveDedup(w, r, body, msg, plan)
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

	s := &sink{w: w, rc: http.NewResponseController(w)}
	defer s.detach()
	out, err := p.engine.Execute(r.Context(), plan, func(ctx context.Context) (engine.Upstream, error) {
		p.cancels.Hold(call)
		defer p.cancels.Release(call)
		release := p.flights.start(r.Header.Get(HeaderSessionID))
		defer release()
		return p.forwardDedup(ctx, r, body, msg.ID, s)
	})
	var ee *engine.Error
	switch {
	case err == nil && out.Kind == engine.Replayed:
		w.Header().Set(HeaderReplayed, "true")
		writeMessage(w, r, http.StatusOK, mcpmsg.WithID(out.Response, msg.ID))
	case err == nil:
		// Executed or forwarded: the response is already relayed.
	case errors.As(err, &ee):
		writeMessage(w, r, http.StatusOK, mcpmsg.ErrorResponse(msg.ID, ee.Code, ee.Message))
	case errors.Is(err, engine.ErrDetached), r.Context().Err() != nil:
		p.log.Debug("Client left while its call runs upstream", "tool", plan.Tool)
	default:
		s.mu.Lock()
		started := s.started
		s.mu.Unlock()
		if !started {
			writeError(w, r, http.StatusBadGateway, msg.ID, mcpmsg.CodeUpstreamUnavailable,
				fmt.Sprintf("the MCP server could not be reached (%v); nothing was stored, so a retry runs the call", err))
		}
	}
}

// forwardDedup sends a deduplicated call upstream with ctx (detached from
// the client), relays the response to the client while it is there, and
// returns the final response message for the engine to store.
func (p *Proxy) forwardDedup(ctx context.Context, in *http.Request, body []byte, id json.RawMessage, s *sink) (engine.Upstream, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.target(in.URL).String(), bytes.NewReader(body))
	if err != nil {
		return engine.Upstream{}, err
	}
	req.Header = in.Header.Clone()
	removeHopHeaders(req.Header)
	req.Header.Del("Accept-Encoding") // bytes must be readable to find the response
	req.Host = in.Host
	resp, err := p.client.Do(req) //nolint:bodyclose // drainAndClose closes it once read
	if err != nil {
		return engine.Upstream{}, fmt.Errorf("calling the MCP server: %w", err)
	}
	defer drainAndClose(resp.Body)
	h := resp.Header.Clone()
	removeHopHeaders(h)
	up := engine.Upstream{Status: resp.StatusCode}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if resp.StatusCode < 200 || resp.StatusCode > 299 || mt != "text/event-stream" {
		s.header(resp.StatusCode, h)
		// Relay as it comes; keep a copy up to --max-response-bytes.
		keep := &capped{limit: p.opts.MaxResponseBytes}
		n, err := io.Copy(io.MultiWriter(s, keep), resp.Body)
		if err != nil {
			return engine.Upstream{}, fmt.Errorf("reading the MCP server's response: %w", err)
		}
		switch {
		case keep.over:
			up.TooLarge, up.Size = true, n
		case len(keep.buf) > 0 && up.Status >= 200 && up.Status <= 299:
			up.Response = keep.buf
		}
		return up, nil
	}
	s.header(resp.StatusCode, h)
	er := mcpmsg.NewEventReader(resp.Body, int(p.opts.MaxResponseBytes))
	var oversized int64
	for {
		ev, err := er.Next()
		if errors.Is(err, io.EOF) {
			if oversized > 0 {
				// Our response never came whole: it was most likely the
				// event too large to keep. The call ran.
				up.TooLarge, up.Size = true, oversized
			}
			return up, nil
		}
		if errors.Is(err, mcpmsg.ErrEventTooLarge) {
			// Relay it whole without keeping it, and read on: if it was
			// not our response, the response still follows.
			s.write(ev.Raw)
			n, serr := er.SkipEvent(s)
			oversized = max(oversized, int64(len(ev.Raw))+n)
			if serr != nil {
				up.TooLarge, up.Size = true, oversized
				return up, nil
			}
			continue
		}
		if err != nil {
			return engine.Upstream{}, fmt.Errorf("reading the MCP server's event stream: %w", err)
		}
		s.write(ev.Raw)
		if isResponseTo(ev.Data, id) {
			up.Response = bytes.Clone(ev.Data)
			return up, nil
		}
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
	if len(data) == 0 || data[0] != '{' {
		return false
	}
	var m struct {
		ID     json.RawMessage `json:"id"`
		Method string          `json:"method"`
	}
	return json.Unmarshal(data, &m) == nil && m.Method == "" && mcpmsg.SameID(m.ID, id)
}

// serveCancel keeps a client's cancel of a deduplicated call from reaching
// the server: the call completes and is stored for the retry that follows.
func (p *Proxy) serveCancel(w http.ResponseWriter, r *http.Request, body []byte, msg *mcpmsg.Message) {
	var params struct {
		RequestID json.RawMessage `json:"requestId"`
	}
	if json.Unmarshal(msg.Params, &params) == nil && len(params.RequestID) > 0 &&
		p.swallowsCancel(p.cancelKey(r, params.RequestID)) {
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
	return engine.CancelKey(id, "http", r.Header.Get(p.engine.Policy().PrincipalHeader))
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
	switch {
	case strings.HasSuffix(t.Path, "/") && strings.HasPrefix(u.Path, "/"):
		t.Path += u.Path[1:]
	case !strings.HasSuffix(t.Path, "/") && !strings.HasPrefix(u.Path, "/") && u.Path != "":
		t.Path += "/" + u.Path
	default:
		t.Path += u.Path
	}
	t.RawPath = ""
	switch {
	case t.RawQuery == "":
		t.RawQuery = u.RawQuery
	case u.RawQuery != "":
		t.RawQuery += "&" + u.RawQuery
	}
	return &t
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
// dropped, so a call detached from its client can run to the end.
type sink struct {
	mu      sync.Mutex
	w       http.ResponseWriter
	rc      *http.ResponseController
	gone    bool
	started bool
}

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
	_ = s.rc.Flush()
}

func (s *sink) write(b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gone {
		return
	}
	if _, err := s.w.Write(b); err != nil {
		s.gone = true
		return
	}
	_ = s.rc.Flush()
}

// Write lets the sink be an io.Writer; a client that left swallows it all.
func (s *sink) Write(b []byte) (int, error) {
	s.write(b)
	return len(b), nil
}

func (s *sink) detach() {
	s.mu.Lock()
	s.gone = true
	s.mu.Unlock()
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
