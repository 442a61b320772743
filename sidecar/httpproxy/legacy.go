package httpproxy

// Legacy HTTP+SSE (2024-11-05). The client opens a GET event stream; the
// server's first event, "endpoint", names the URL the client POSTs its
// messages to, and every response comes back on the GET stream, not in the
// POST's response (202 Accepted).
//
// Nothing needs configuring: a GET that asks for an event stream and
// carries no Mcp-Session-Id is relayed here event by event, and if its
// first event is "endpoint", the stream is a legacy session, remembered by
// the endpoint's path and query. A POST to a remembered endpoint is a
// legacy message; every other request is Streamable HTTP. For a
// deduplicated tools/call the client's POST is answered 202 at once; the
// call goes upstream and its response is matched by id on the session's
// stream (still relayed to the client) and handed to the engine. Replays
// and idemcp's errors are written into the client's stream with the
// caller's id. The upstream stream of a session outlives its client while
// a deduplicated call waits for its response on it, so a client that
// leaves mid-call does not lose the result its retry will ask for.

import (
	"bufio"
	"bytes"
	"context"
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

	"github.com/idemcp/idemcp/sidecar/engine"
	"github.com/idemcp/idemcp/sidecar/mcpmsg"
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
	sessions map[string]*legacySession
}

func (h *legacyHub) add(s *legacySession) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.sessions == nil {
		h.sessions = make(map[string]*legacySession)
	}
	h.sessions[s.endpoint] = s
	h.n.Store(int64(len(h.sessions)))
}

func (h *legacyHub) remove(s *legacySession) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.sessions[s.endpoint] == s {
		delete(h.sessions, s.endpoint)
	}
	h.n.Store(int64(len(h.sessions)))
}

func (h *legacyHub) lookup(u *url.URL) *legacySession {
	if h.n.Load() == 0 {
		return nil
	}
	key := requestKey(u)
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.sessions[key]
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
	endpoint  string          // the path and query the client POSTs to
	principal string          // the GET's principal header, for POSTs without one
	client    context.Context // the client's GET: done when it leaves

	wmu    sync.Mutex // serializes writes into the client's stream
	w      http.ResponseWriter
	rc     *http.ResponseController
	gone   bool // the client left, or a write to it failed
	closed bool // the handler returned: w must not be touched

	mu       sync.Mutex
	waiters  map[string]chan []byte // response ids awaited by deduplicated calls
	lists    map[string]struct{}    // tools/list ids whose responses teach hints
	holds    int                    // deduplicated calls awaiting a response
	left     bool                   // the client's GET ended
	stopping bool                   // the upstream stream is being closed
	tooLarge bool                   // the stream ended on an oversized event
	ended    bool                   // the upstream stream ended
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

// markTooLarge records that the stream ended on an event over the relay
// buffer.
func (s *legacySession) markTooLarge() {
	s.mu.Lock()
	s.tooLarge = true
	s.mu.Unlock()
}

func (s *legacySession) oversized() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tooLarge
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
func (s *legacySession) await(id json.RawMessage) (chan []byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended || s.stopping {
		// The upstream stream is over or being closed: a response sent
		// on it would be lost.
		return nil, false
	}
	if s.waiters == nil {
		s.waiters = make(map[string]chan []byte)
	}
	ch := make(chan []byte, 1)
	s.waiters[mcpmsg.IDKey(id)] = ch
	s.holds++
	return ch, true
}

func (s *legacySession) unawait(id json.RawMessage, ch chan []byte) {
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
	var m struct {
		ID     json.RawMessage `json:"id"`
		Method string          `json:"method"`
	}
	if json.Unmarshal(data, &m) != nil || m.Method != "" || len(m.ID) == 0 {
		return
	}
	k := mcpmsg.IDKey(m.ID)
	s.mu.Lock()
	ch, waiting := s.waiters[k]
	if waiting {
		delete(s.waiters, k)
	}
	_, listed := s.lists[k]
	if listed {
		delete(s.lists, k)
	}
	s.mu.Unlock()
	if waiting {
		ch <- bytes.Clone(data)
	}
	if listed {
		observe(data)
	}
}

// serveLegacy takes the requests that may belong to legacy sessions: GETs
// that ask for an event stream without a Streamable HTTP session, and
// POSTs to a legacy session's endpoint. It reports whether it served r.
func (p *Proxy) serveLegacy(w http.ResponseWriter, r *http.Request) bool {
	switch r.Method {
	case http.MethodGet:
		if r.Header.Get(HeaderSessionID) != "" || !acceptsEventStream(r.Header.Values("Accept")) {
			return false
		}
		p.serveEventStream(w, r)
		return true
	case http.MethodPost:
		s := p.legacy.lookup(r.URL)
		if s == nil {
			return false
		}
		p.serveLegacyPost(w, r, s)
		return true
	}
	return false
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

// serveEventStream relays a GET event stream event by event. If its first
// event is "endpoint", it is a legacy session: the endpoint is rewritten
// to reach the sidecar if need be and remembered, and responses on the
// stream are matched to the deduplicated calls waiting for them. Any other
// stream is relayed byte for byte.
func (p *Proxy) serveEventStream(w http.ResponseWriter, r *http.Request) {
	upCtx, cancelUp := context.WithCancel(context.WithoutCancel(r.Context()))
	defer cancelUp()
	req, err := http.NewRequestWithContext(upCtx, http.MethodGet, p.target(r.URL).String(), nil)
	if err != nil {
		writeError(w, r, http.StatusBadRequest, nil, mcpmsg.CodeInvalidRequest, err.Error())
		return
	}
	req.Header = r.Header.Clone()
	removeHopHeaders(req.Header)
	req.Header.Del("Accept-Encoding") // events must be readable to find the endpoint and responses
	if _, ok := req.Header["User-Agent"]; !ok {
		req.Header.Set("User-Agent", "") // as httputil.ReverseProxy: no Go default
	}
	req.Host = r.Host

	s := &legacySession{
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

	resp, err := p.client.Do(req)
	if err != nil {
		p.upstreamError(w, r, err)
		return
	}
	defer func() { _ = resp.Body.Close() }()
	h := resp.Header.Clone()
	removeHopHeaders(h)
	dst := w.Header()
	for k, v := range h {
		dst[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	_ = s.rc.Flush()
	br := bufio.NewReaderSize(resp.Body, 32<<10) // NewEventReader uses br itself
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if resp.StatusCode < 200 || resp.StatusCode > 299 || mt != "text/event-stream" {
		relayBytes(s, br)
		return
	}

	er := mcpmsg.NewEventReader(br, int(p.opts.MaxResponseBytes))
	ev, err := er.Next()
	if len(ev.Raw) > 0 && eventName(ev.Raw) == "endpoint" && err == nil {
		p.serveLegacySession(s, r, ev, er)
		return
	}
	if len(ev.Raw) > 0 && !s.write(ev.Raw) {
		return
	}
	if err == nil {
		relayBytes(s, br)
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
		ev, err := er.Next()
		if len(ev.Raw) > 0 {
			// After the client left, keep reading: a call detached from
			// it still waits for its response here.
			s.write(ev.Raw)
		}
		if errors.Is(err, mcpmsg.ErrEventTooLarge) {
			// Most likely a response too large to keep: the calls that
			// wait on this stream ran, and must not run again.
			s.markTooLarge()
		}
		if err != nil {
			if !errors.Is(err, io.EOF) && s.client.Err() == nil && !errors.Is(err, context.Canceled) {
				p.log.Debug("Legacy SSE stream from the MCP server ended", "err", err)
			}
			return
		}
		if name := eventName(ev.Raw); name == "" || name == "message" {
			s.dispatch(ev.Data, p.observeToolsList)
		}
	}
}

// clientEndpoint returns the endpoint event's data as the client must see
// it, the key the client's POSTs to it will have, and whether those POSTs
// reach the sidecar. An absolute URL to the upstream's host becomes a
// path; a path under the upstream URL's own path loses that prefix (the
// sidecar adds it back). Relative references resolve as they did.
func (p *Proxy) clientEndpoint(data string, in *http.Request) (string, string, bool) {
	u, err := url.Parse(strings.TrimSpace(data))
	if err != nil {
		return data, "", false
	}
	changed := false
	if u.Scheme != "" || u.Host != "" {
		switch {
		case strings.EqualFold(u.Host, p.opts.Upstream.Host):
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

// eventName returns the value of an event's "event" field.
func eventName(raw []byte) string {
	name := ""
	for _, line := range bytes.Split(raw, []byte("\n")) {
		line = bytes.TrimRight(line, "\r")
		if v, ok := bytes.CutPrefix(line, []byte("event:")); ok {
			name = string(bytes.TrimPrefix(v, []byte(" ")))
		}
	}
	return name
}

// replaceData rewrites an event's data, keeping its other fields.
func replaceData(raw []byte, data string) []byte {
	var out []byte
	done := false
	for _, line := range bytes.SplitAfter(raw, []byte("\n")) {
		if bytes.HasPrefix(line, []byte("data:")) {
			if !done {
				out = append(out, "data: "...)
				out = append(out, data...)
				out = append(out, '\n')
				done = true
			}
			continue
		}
		out = append(out, line...)
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
		var params struct {
			RequestID json.RawMessage `json:"requestId"`
		}
		if json.Unmarshal(msg.Params, &params) == nil && len(params.RequestID) > 0 &&
			p.swallowsCancel(legacyCancelKey(s, params.RequestID)) {
			// A deduplicated call runs to the end for its retry (design rule 5).
			w.WriteHeader(http.StatusAccepted)
			return
		}
	}
	p.forwardBody(w, r, body, false)
}

func legacyCancelKey(s *legacySession, id json.RawMessage) string {
	return engine.CancelKey(id, "legacy", s.endpoint)
}

// legacyCall is a deduplicated call's request, kept past its POST handler.
type legacyCall struct {
	id      json.RawMessage
	body    []byte
	target  string
	header  http.Header
	host    string
	refused atomic.Pointer[string] // why the server refused the POST, if it did
}

func (p *Proxy) serveLegacyCall(w http.ResponseWriter, r *http.Request, s *legacySession, body []byte, msg *mcpmsg.Message) {
	tc, err := engine.ParseToolCall(msg.Params)
	if err != nil {
		p.legacyError(w, s, msg.ID, err)
		return
	}
	key, hasKey := headerValue(r.Header, HeaderIdempotencyKey)
	principal := r.Header.Get(p.engine.Policy().PrincipalHeader)
	if principal == "" {
		principal = s.principal
	}
	plan, err := p.engine.Plan(tc, engine.Caller{
		HeaderKey:    key,
		HasHeaderKey: hasKey,
		Principal:    principal,
		Session:      s.endpoint,
	})
	if err != nil {
		p.legacyError(w, s, msg.ID, err)
		return
	}
	if plan == nil {
		p.engine.CountPassthrough()
		p.forwardBody(w, r, body, false)
		return
	}
	c := &legacyCall{
		id:     bytes.Clone(msg.ID),
		body:   body,
		target: p.target(r.URL).String(),
		header: r.Header.Clone(),
		host:   r.Host,
	}
	removeHopHeaders(c.header)
	cancelKey := legacyCancelKey(s, msg.ID)
	call := p.cancels.Acquire(cancelKey, struct{}{})
	// The response goes into the stream, as the server's would.
	w.WriteHeader(http.StatusAccepted)
	done := p.engine.Track()
	go func() {
		defer done()
		p.runLegacyCall(s, plan, c, call)
	}()
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

func (p *Proxy) runLegacyCall(s *legacySession, plan *engine.Plan, c *legacyCall, call *engine.Call[struct{}]) {
	defer p.cancels.Release(call)
	out, err := p.engine.Execute(s.client, plan, func(ctx context.Context) (engine.Upstream, error) {
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
	req, err := http.NewRequestWithContext(postCtx, http.MethodPost, c.target, bytes.NewReader(c.body))
	if err != nil {
		return engine.Upstream{}, err
	}
	req.Header = c.header.Clone()
	req.Host = c.host
	resp, err := p.client.Do(req)
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
	select {
	case data := <-ch:
		return engine.Upstream{Status: resp.StatusCode, Response: data}, nil
	case <-s.endedCh:
		select {
		case data := <-ch:
			return engine.Upstream{Status: resp.StatusCode, Response: data}, nil
		default:
		}
		if s.oversized() {
			return engine.Upstream{Status: resp.StatusCode, TooLarge: true}, nil
		}
		return engine.Upstream{}, errors.New("the session's event stream from the MCP server ended before the call's response")
	}
}
