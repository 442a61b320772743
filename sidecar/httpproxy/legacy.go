package httpproxy

// Legacy HTTP+SSE (2024-11-05). The client opens a GET event stream; the
// server's first event, "endpoint", names the URL the client POSTs its
// messages to, and every response comes back on the GET stream, not in the
// POST's response (202 Accepted).
//
// Nothing needs configuring: a GET that asks for an event stream and
// carries no Mcp-Session-Id is relayed here event by event, and its first
// "endpoint" event (whatever comes before it) makes the stream a legacy
// session, remembered by the endpoint's path and query. A POST to a
// remembered endpoint is a legacy message; every other request is
// Streamable HTTP. A server that gives two live sessions the same endpoint
// leaves no way to tell whose a POST is: while it does, that endpoint's
// calls are forwarded without dedup, and the sidecar says so. For a
// deduplicated tools/call the client's POST is answered 202 at once; the
// call goes upstream and its response is matched by id on the session's
// stream (still relayed to the client) and handed to the engine. Replays
// and idemcp's errors are written into the client's stream with the
// caller's id. The upstream stream of a session outlives its client while
// a deduplicated call waits for its response on it, so a client that
// leaves mid-call does not lose the result its retry will ask for.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// maxLegacyWatches bounds the tools/list ids a session remembers while
// their responses are outstanding.
const maxLegacyWatches = 1024

// legacyHub holds the legacy sessions whose streams pass through the proxy,
// by the endpoint (path and query) their client POSTs to. The zero value
// is ready to use.
type legacyHub struct {
	n        atomic.Int64 // len(sessions), read without the lock
	mu       sync.Mutex
	sessions map[string][]*legacySession // live sessions by endpoint, oldest first
	shared   func(endpoint string)       // called when a second live session gets an endpoint
}

func (h *legacyHub) add(s *legacySession) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.sessions == nil {
		h.sessions = make(map[string][]*legacySession)
	}
	h.sessions[s.endpoint] = append(h.sessions[s.endpoint], s)
	h.n.Store(int64(len(h.sessions)))
	if len(h.sessions[s.endpoint]) == 2 && h.shared != nil {
		h.shared(s.endpoint)
	}
}

func (h *legacyHub) remove(s *legacySession) {
	h.mu.Lock()
	defer h.mu.Unlock()
	live := h.sessions[s.endpoint]
	for i, o := range live {
		if o == s {
			live = append(live[:i:i], live[i+1:]...)
			break
		}
	}
	if len(live) == 0 {
		delete(h.sessions, s.endpoint)
	} else {
		h.sessions[s.endpoint] = live
	}
	h.n.Store(int64(len(h.sessions)))
}

// lookup returns the session a POST to u belongs to, and whether more
// than one live session has that endpoint, so that it cannot be told.
func (h *legacyHub) lookup(u *url.URL) (*legacySession, bool) {
	if h.n.Load() == 0 {
		return nil, false
	}
	key := requestKey(u)
	h.mu.Lock()
	defer h.mu.Unlock()
	live := h.sessions[key]
	if len(live) == 0 {
		return nil, false
	}
	return live[0], len(live) > 1
}

// requestKey is how a request's URL is matched against endpoints.
func requestKey(u *url.URL) string {
	if u.RawQuery == "" {
		return u.EscapedPath()
	}
	return u.EscapedPath() + "?" + u.RawQuery
}

// legacySession is one client's legacy event stream.
type legacySession struct {
	id        string          // the sidecar's own name for the session: its dedup scope
	endpoint  string          // the path and query the client POSTs to
	principal string          // the GET's principal header, for POSTs without one
	client    context.Context // the client's GET: done when it leaves

	wmu    sync.Mutex // serializes writes into the client's stream
	w      http.ResponseWriter
	rc     *http.ResponseController
	gone   bool // the client left, or a write to it failed
	closed bool // the handler returned: w must not be touched

	mu       sync.Mutex
	waiters  map[string]chan legacyResponse // response ids awaited by deduplicated calls
	lists    map[string]struct{}            // tools/list ids whose responses teach hints
	holds    int                            // deduplicated calls awaiting a response
	left     bool                           // the client's GET ended
	stopping bool                           // the upstream stream is being closed
	ended    bool                           // the upstream stream ended
	endedCh  chan struct{}
	cancelUp context.CancelFunc // ends the upstream stream
}

// write sends bytes to the client and flushes them, unless it is gone.
func (s *legacySession) write(b []byte) bool {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if s.gone || s.closed {
		return false
	}
	if _, err := s.w.Write(b); err != nil {
		s.gone = true
		return false
	}
	if err := s.rc.Flush(); err != nil {
		s.gone = true
		return false
	}
	return true
}

// inject writes one JSON-RPC message into the client's stream as a
// "message" event, between the events relayed from the server.
func (s *legacySession) inject(msg []byte) {
	s.write(mcpmsg.AppendEvent(nil, msg))
}

// clientLeft runs when the client's GET ends. The upstream stream stays
// open while deduplicated calls still wait for their responses on it.
func (s *legacySession) clientLeft() {
	s.wmu.Lock()
	s.gone = true
	s.wmu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.left = true
	if s.holds == 0 {
		s.stopUpstream()
	}
}

// Write lets the session be the io.Writer an event is relayed to.
func (s *legacySession) Write(b []byte) (int, error) {
	s.write(b)
	return len(b), nil
}

// legacyResponse is a response seen on the stream: its data, or the size
// of one too large to keep.
type legacyResponse struct {
	data     []byte
	tooLarge int64
}

// stopUpstream closes the upstream stream; s.mu is held.
func (s *legacySession) stopUpstream() {
	s.stopping = true
	s.cancelUp()
}

// finish marks the handler as returned: nothing may write to w after it.
func (s *legacySession) finish() {
	s.wmu.Lock()
	s.closed = true
	s.wmu.Unlock()
}

// end records that the upstream stream is over: calls still waiting for
// their responses will not get them.
func (s *legacySession) end() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.ended {
		s.ended = true
		close(s.endedCh)
	}
}

// await registers a deduplicated call waiting for the response with id,
// and keeps the upstream stream open until unawait. It fails if the
// stream has already ended.
func (s *legacySession) await(id json.RawMessage) (chan legacyResponse, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended || s.stopping {
		// The upstream stream is over or being closed: a response sent
		// on it would be lost.
		return nil, false
	}
	if s.waiters == nil {
		s.waiters = make(map[string]chan legacyResponse)
	}
	ch := make(chan legacyResponse, 1)
	s.waiters[mcpmsg.IDKey(id)] = ch
	s.holds++
	return ch, true
}

func (s *legacySession) unawait(id json.RawMessage, ch chan legacyResponse) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := mcpmsg.IDKey(id)
	if s.waiters[k] == ch {
		delete(s.waiters, k)
	}
	s.holds--
	if s.holds == 0 && s.left {
		s.stopUpstream()
	}
}

// watchList remembers a tools/list request, so that its response on the
// stream teaches the engine the tools' readOnlyHint.
func (s *legacySession) watchList(id json.RawMessage) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lists == nil || len(s.lists) >= maxLegacyWatches {
		s.lists = make(map[string]struct{})
	}
	s.lists[mcpmsg.IDKey(id)] = struct{}{}
}

// dispatch hands a response seen on the stream to the call waiting for
// it, and tools/list results to observe.
func (s *legacySession) dispatch(data []byte, observe func([]byte)) {
	if len(data) == 0 || data[0] != '{' {
		return
	}
	m, err := mcpmsg.Parse(data)
	if err != nil || m.Method != "" || len(m.ID) == 0 {
		return
	}
	ch, listed := s.claim(m.ID)
	if ch != nil {
		ch <- legacyResponse{data: bytes.Clone(data)}
	}
	if listed {
		observe(data)
	}
}

// dispatchTooLarge hands the call waiting for id the news that its
// response was relayed but was too large to keep: it ran.
func (s *legacySession) dispatchTooLarge(id json.RawMessage, size int64) {
	if ch, _ := s.claim(id); ch != nil {
		ch <- legacyResponse{tooLarge: size}
	}
}

// claim takes the waiter and the tools/list watch of a response id.
func (s *legacySession) claim(id json.RawMessage) (chan legacyResponse, bool) {
	k := mcpmsg.IDKey(id)
	s.mu.Lock()
	defer s.mu.Unlock()
	ch, waiting := s.waiters[k]
	if waiting {
		delete(s.waiters, k)
	}
	_, listed := s.lists[k]
	if listed {
		delete(s.lists, k)
	}
	return ch, listed
}

// isLegacyStream says whether a GET may open a legacy session: it asks for
// an event stream without a Streamable HTTP session.
func isLegacyStream(r *http.Request) bool {
	return r.Header.Get(HeaderSessionID) == "" && acceptsEventStream(r.Header.Values("Accept"))
}

func acceptsEventStream(accept []string) bool {
	for _, v := range accept {
		for _, part := range strings.Split(v, ",") {
			if mt, _, _ := mime.ParseMediaType(strings.TrimSpace(part)); mt == "text/event-stream" {
				return true
			}
		}
	}
	return false
}

// serveEventStream relays a GET event stream event by event. Its first
// "endpoint" event makes it a legacy session: the endpoint is rewritten to
// reach the sidecar if need be and remembered, and responses on the
// stream are matched to the deduplicated calls waiting for them.
func (p *Proxy) serveEventStream(w http.ResponseWriter, r *http.Request) {
	upCtx, cancelUp := context.WithCancel(context.WithoutCancel(r.Context()))
	defer cancelUp()
	req, err := p.newUpstreamRequest(upCtx, r, nil)
	if err != nil {
		writeError(w, r, http.StatusBadRequest, nil, mcpmsg.CodeInvalidRequest, err.Error())
		return
	}
	// The sidecar reads the events (and may rewrite the endpoint): it asks
	// for them uncompressed, and decodes what a server compresses anyway.
	req.Header.Del("Accept-Encoding")

	s := &legacySession{
		id:        rand.Text(),
		client:    r.Context(),
		principal: r.Header.Get(p.engine.Policy().PrincipalHeader),
		w:         w,
		rc:        http.NewResponseController(w),
		endedCh:   make(chan struct{}),
		cancelUp:  cancelUp,
	}
	defer s.finish()
	stop := context.AfterFunc(r.Context(), s.clientLeft)
	defer stop()

	resp, err := p.send(req)
	if err != nil {
		p.upstreamError(w, r, err)
		return
	}
	defer func() { _ = resp.Body.Close() }()
	h := resp.Header.Clone()
	removeHopHeaders(h)
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	events := resp.StatusCode >= 200 && resp.StatusCode <= 299 && mt == "text/event-stream"
	var body io.Reader = resp.Body
	if events {
		if body, err = decodeBody(resp.Body, resp.Header.Values("Content-Encoding")); err != nil {
			events, body = false, resp.Body // relayed as it is, unread
		} else if len(h.Values("Content-Encoding")) > 0 {
			h.Del("Content-Encoding")
			h.Del("Content-Length")
		}
	}
	dst := w.Header()
	for k, v := range h {
		dst[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	_ = s.rc.Flush()
	if !events {
		relayBytes(s, body)
		return
	}
	er := mcpmsg.NewEventReader(body, int(p.opts.MaxResponseBytes))
	defer er.Release()
	for {
		ev, err := er.Next()
		if err == nil && ev.HasData && strings.TrimSpace(ev.Name) == "endpoint" {
			p.serveLegacySession(s, r, ev, er)
			return
		}
		s.write(ev.Raw)
		if errors.Is(err, mcpmsg.ErrEventTooLarge) {
			_, err = er.SkipEvent(s, nil)
		}
		if err != nil {
			return
		}
	}
}

// relayBytes copies the rest of a stream that is not a legacy session,
// flushing as it goes, until either side ends.
func relayBytes(s *legacySession, r io.Reader) {
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 && !s.write(buf[:n]) {
			return
		}
		if err != nil {
			return
		}
	}
}

func (p *Proxy) serveLegacySession(s *legacySession, r *http.Request, first mcpmsg.Event, er *mcpmsg.EventReader) {
	defer s.end()
	raw := first.Raw
	data, key, ours := p.clientEndpoint(string(first.Data), r)
	if data != string(first.Data) {
		raw = replaceData(raw, data)
		p.log.Debug("Rewrote a legacy SSE endpoint for the client", "upstream", string(first.Data), "client", data)
	}
	if ours {
		s.endpoint = key
		p.legacy.add(s)
		defer p.legacy.remove(s)
		p.log.Debug("Legacy SSE session opened", "endpoint", key)
	} else {
		p.log.Warn("Legacy SSE endpoint is not served through the sidecar; its calls are not deduplicated", "endpoint", data)
	}
	s.write(raw)
	for {
		// After the client left, keep reading: a call detached from it
		// still waits for its response here.
		ev, err := er.Next()
		s.write(ev.Raw)
		if errors.Is(err, mcpmsg.ErrEventTooLarge) {
			// Relay it whole and keep the session. If it is a response,
			// its call ran: it gets no result to keep, and does not run
			// again.
			var scan idScanner
			_, _ = scan.Write(ev.Data)
			n, serr := er.SkipEvent(s, &scan)
			if id, ok := scan.responseID(); ok {
				s.dispatchTooLarge(id, int64(len(ev.Raw))+n)
			}
			err = serr
			if err == nil {
				continue
			}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) && s.client.Err() == nil && !errors.Is(err, context.Canceled) {
				p.log.Debug("Legacy SSE stream from the MCP server ended", "err", err)
			}
			return
		}
		if name := strings.TrimSpace(ev.Name); ev.HasData && (name == "" || name == "message") {
			s.dispatch(ev.Data, p.observeToolsList)
		}
	}
}

// clientEndpoint returns the endpoint event's data as the client must see
// it, the key the client's POSTs to it will have, and whether those POSTs
// reach the sidecar. An absolute URL to the upstream's host, or to the
// pod IP the sidecar reaches it at, becomes a path; a path under the
// upstream URL's own path loses that prefix (the sidecar adds it back).
// Relative references resolve as they did.
func (p *Proxy) clientEndpoint(data string, in *http.Request) (string, string, bool) {
	u, err := url.Parse(strings.TrimSpace(data))
	if err != nil {
		return data, "", false
	}
	changed := false
	if u.Scheme != "" || u.Host != "" {
		switch {
		case strings.EqualFold(u.Host, p.opts.Upstream.Host) || (p.opts.Dialer != nil && p.opts.Dialer.isUpstream(u.Host)):
			u = &url.URL{Path: u.Path, RawPath: u.RawPath, RawQuery: u.RawQuery, Fragment: u.Fragment}
			changed = true
		case strings.EqualFold(u.Host, in.Host):
			// Built from the Host header, which the sidecar passes on.
		default:
			return data, "", false
		}
	}
	if base := strings.TrimSuffix(p.opts.Upstream.Path, "/"); base != "" && strings.HasPrefix(u.Path, "/") &&
		(u.Path == base || strings.HasPrefix(u.Path, base+"/")) {
		u.Path = strings.TrimPrefix(u.Path, base)
		if u.Path == "" {
			u.Path = "/"
		}
		u.RawPath = ""
		changed = true
	}
	out := data
	if changed {
		out = u.String()
	}
	abs := (&url.URL{Path: in.URL.Path, RawPath: in.URL.RawPath}).ResolveReference(u)
	return out, requestKey(abs), true
}

// replaceData rewrites an event's data, keeping its other lines and its
// line endings.
func replaceData(raw []byte, data string) []byte {
	var out []byte
	done := false
	for len(raw) > 0 {
		end := bytes.IndexAny(raw, "\r\n")
		term := end + 1
		switch {
		case end < 0:
			end, term = len(raw), len(raw)
		case raw[end] == '\r' && end+1 < len(raw) && raw[end+1] == '\n':
			term = end + 2
		}
		line, nl := raw[:end], raw[end:term]
		raw = raw[term:]
		content := bytes.TrimPrefix(line, []byte("\xEF\xBB\xBF"))
		if name, _, _ := bytes.Cut(content, []byte(":")); string(name) != "data" {
			out = append(append(out, line...), nl...)
			continue
		}
		if !done {
			out = append(out, line[:len(line)-len(content)]...)
			out = append(append(append(out, "data: "...), data...), nl...)
			done = true
		}
	}
	return out
}

// serveLegacyPost handles a message the client POSTs to its legacy
// session's endpoint.
func (p *Proxy) serveLegacyPost(w http.ResponseWriter, r *http.Request, s *legacySession) {
	body, ok := p.readBody(w, r)
	if !ok {
		return
	}
	// Anything that is not one well-formed message goes to the server,
	// which answers it as it would without the sidecar.
	if kind, err := mcpmsg.Sniff(body); err != nil || kind != mcpmsg.Single {
		p.forwardBody(w, r, body, false)
		return
	}
	msg, err := mcpmsg.Parse(body)
	if err != nil {
		if msg != nil {
			// JSON the server could read another way than the sidecar:
			// refused, never forwarded.
			p.legacyError(w, s, msg.ID, &engine.Error{Code: mcpmsg.ErrorCode(err), Message: err.Error()})
			return
		}
		p.forwardBody(w, r, body, false)
		return
	}
	switch msg.Method {
	case "tools/call":
		if len(msg.ID) > 0 {
			p.serveLegacyCall(w, r, s, body, msg)
			return
		}
	case "tools/list":
		if len(msg.ID) > 0 {
			s.watchList(msg.ID)
		}
	case "notifications/cancelled":
		if reqID, _ := mcpmsg.CancelledRequestID(msg.Params); len(reqID) > 0 &&
			p.swallowsCancel(legacyCancelKey(s, reqID)) {
			// A deduplicated call runs to the end for its retry (design rule 5).
			w.WriteHeader(http.StatusAccepted)
			return
		}
	}
	p.forwardBody(w, r, body, false)
}

func legacyCancelKey(s *legacySession, id json.RawMessage) string {
	return engine.CancelKey(id, "legacy", s.id)
}

// serveSharedEndpointPost forwards a POST to an endpoint two live sessions
// share, untouched: its session cannot be told, so neither can its calls
// be deduplicated or answered into a stream.
func (p *Proxy) serveSharedEndpointPost(w http.ResponseWriter, r *http.Request) {
	body, ok := p.readBody(w, r)
	if !ok {
		return
	}
	if msg, err := mcpmsg.Parse(body); err == nil && msg.Method == "tools/call" && len(msg.ID) > 0 {
		p.sharedCalls.Inc()
	}
	p.forwardBody(w, r, body, false)
}

// legacyCall is a deduplicated call's request, kept past its POST handler.
type legacyCall struct {
	id      json.RawMessage
	body    []byte
	in      *http.Request          // the client's POST (its URL and header), body read
	refused atomic.Pointer[string] // why the server refused the POST, if it did
}

func (p *Proxy) serveLegacyCall(w http.ResponseWriter, r *http.Request, s *legacySession, body []byte, msg *mcpmsg.Message) {
	tc, err := engine.CallOf(msg)
	if err != nil {
		p.legacyError(w, s, msg.ID, err)
		return
	}
	key, hasKey := headerValue(r.Header, HeaderIdempotencyKey)
	principal := r.Header.Get(p.engine.Policy().PrincipalHeader)
	if principal == "" {
		principal = s.principal
	}
	// The call runs past this POST, in the session: so does its span.
	ctx, span := p.engine.StartCall(s.client, p.callInfo(r, tc.Name, msg.ID, tc.Meta))
	plan, err := p.engine.PlanCall(ctx, tc, engine.Caller{
		HeaderKey:    key,
		HasHeaderKey: hasKey,
		Principal:    principal,
		Session:      s.id,
	})
	if err != nil {
		span.Error(mcpmsg.ErrorCode(err))
		span.End()
		p.legacyError(w, s, msg.ID, err)
		return
	}
	if plan == nil { // counted by Plan
		span.Forwarded()
		span.End()
		p.forwardBody(w, r, body, false)
		return
	}
	c := &legacyCall{
		id:   bytes.Clone(msg.ID),
		body: body,
		in:   &http.Request{Method: r.Method, URL: r.URL, Header: r.Header.Clone(), Host: r.Host},
	}
	cancelKey := legacyCancelKey(s, msg.ID)
	call := p.cancels.Acquire(cancelKey, struct{}{})
	// The response goes into the stream, as the server's would.
	w.WriteHeader(http.StatusAccepted)
	done := p.engine.Track()
	p.engine.Go("legacy", func() {
		defer done()
		defer span.End()
		p.runLegacyCall(ctx, s, plan, c, call)
	})
}

// legacyError answers a call the engine refused: 202 for the POST, the
// JSON-RPC error in the stream.
func (p *Proxy) legacyError(w http.ResponseWriter, s *legacySession, id json.RawMessage, err error) {
	var ee *engine.Error
	if !errors.As(err, &ee) {
		ee = &engine.Error{Code: mcpmsg.CodeInternalError, Message: err.Error()}
	}
	w.WriteHeader(http.StatusAccepted)
	s.inject(mcpmsg.ErrorResponse(id, ee.Code, ee.Message))
}

func (p *Proxy) runLegacyCall(ctx context.Context, s *legacySession, plan *engine.Plan, c *legacyCall, call *engine.Call[struct{}]) {
	defer p.cancels.Release(call)
	out, err := p.engine.Execute(ctx, plan, func(ctx context.Context) (engine.Upstream, error) {
		p.cancels.Hold(call)
		defer p.cancels.Release(call)
		return p.forwardLegacy(ctx, s, c)
	})
	var ee *engine.Error
	switch {
	case err == nil && out.Kind == engine.Replayed:
		s.inject(mcpmsg.WithID(out.Response, c.id))
	case err == nil:
		// Executed or forwarded: the server's response was relayed on the
		// stream, unless the server refused the message.
		if why := c.refused.Load(); why != nil {
			s.inject(mcpmsg.ErrorResponse(c.id, mcpmsg.CodeUpstreamUnavailable, fmt.Sprintf(
				"the MCP server refused the message (%s); nothing was stored, so a retry runs the call", *why)))
		}
	case errors.As(err, &ee):
		engine.CallSpanFrom(ctx).Error(ee.Code)
		s.inject(mcpmsg.ErrorResponse(c.id, ee.Code, ee.Message))
	case errors.Is(err, engine.ErrDetached), s.client.Err() != nil:
		p.log.Debug("Legacy SSE client left while its call runs upstream", "tool", plan.Tool)
	default:
		s.inject(mcpmsg.ErrorResponse(c.id, mcpmsg.CodeUpstreamUnavailable, fmt.Sprintf(
			"the MCP server could not be reached (%v); nothing was stored, so a retry runs the call", err)))
	}
}

// forwardLegacy POSTs a deduplicated call upstream with ctx (detached from
// the client) and waits for its response on the session's stream.
func (p *Proxy) forwardLegacy(ctx context.Context, s *legacySession, c *legacyCall) (engine.Upstream, error) {
	ch, ok := s.await(c.id)
	if !ok {
		return engine.Upstream{}, errors.New("the session's event stream from the MCP server has ended")
	}
	defer s.unawait(c.id, ch)
	// Some servers never answer a POST for a session they dropped: give up
	// on it when the session's stream ends.
	postCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-s.endedCh:
			cancel()
		case <-postCtx.Done():
		}
	}()
	req, err := p.newUpstreamRequest(postCtx, c.in, c.body)
	if err != nil {
		return engine.Upstream{}, err
	}
	resp, err := p.send(req)
	if err != nil {
		return engine.Upstream{}, fmt.Errorf("calling the MCP server: %w", err)
	}
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	_ = resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		why := fmt.Sprintf("HTTP %d", resp.StatusCode)
		if m := strings.TrimSpace(string(msg)); m != "" {
			why += ": " + m
		}
		c.refused.Store(&why)
		return engine.Upstream{Status: resp.StatusCode}, nil
	}
	got := func(r legacyResponse) (engine.Upstream, error) {
		if r.data == nil {
			return engine.Upstream{Status: resp.StatusCode, TooLarge: true, Size: r.tooLarge}, nil
		}
		return engine.Upstream{Status: resp.StatusCode, Response: r.data}, nil
	}
	select {
	case r := <-ch:
		return got(r)
	case <-s.endedCh:
		select {
		case r := <-ch:
			return got(r)
		default:
		}
		return engine.Upstream{}, errors.New("the session's event stream from the MCP server ended before the call's response")
	}
}
