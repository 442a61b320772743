package httpproxy

// Stream polling (2025-11-25, SEP-1699). A server may answer a POST with a
// priming event that carries an event id, close the stream, and deliver
// the response later on a GET that resumes the stream with Last-Event-ID.
// For a deduplicated call such an early end is not a failure: the outcome
// is pending (design rule 4). The sidecar gets the response where the
// client would. It taps the client's resumed GET stream (a GET whose
// session and Last-Event-ID name an event the call's streams carried) and
// matches the response there by JSON-RPC id; if the client does not resume
// within the server's retry interval plus ResumeGrace, the sidecar resumes
// the stream upstream itself, with the call's session and the last event
// id seen. Only when the server refuses the resumption, or cannot be
// reached for a lease, is the outcome unknown: the claim then lapses and
// onAbandoned decides.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// DefaultResumeGrace is how long past the server's retry interval the
// sidecar waits for the client to resume a stream before it resumes it.
const DefaultResumeGrace = 2 * time.Second

const (
	// defaultRetryHint is what clients wait before resuming when the server
	// names no retry interval (the TypeScript and Go SDKs wait 1s).
	defaultRetryHint = time.Second
	maxRetryHint     = 30 * time.Second
	// maxEventIDs bounds the event ids a pending call remembers to know
	// its resumed streams by.
	maxEventIDs = 256
	// headerLastEventID is the SSE resumption header.
	headerLastEventID = "Last-Event-Id"
)

// pendingCall is a deduplicated call whose response stream carried event
// ids: the streams that resume it are recognized by those ids.
type pendingCall struct {
	session string
	id      json.RawMessage // the request's JSON-RPC id
	target  string
	header  http.Header // for the sidecar's own resumption
	host    string

	done chan struct{} // closed once up is set
	wake chan struct{} // a tap started or ended

	mu     sync.Mutex
	ids    map[string]struct{}
	order  []string // ids in arrival order, oldest first
	lastID string
	retry  time.Duration
	taps   int                // client streams being tapped for this call
	own    context.CancelFunc // the sidecar's own resumption, while it runs
	ownEnd chan struct{}      // closed when it has ended
	up     engine.Upstream
}

func (p *Proxy) newPendingCall(in *http.Request, id json.RawMessage) *pendingCall {
	h := in.Header.Clone()
	removeHopHeaders(h)
	for _, k := range []string{"Content-Type", "Content-Length", "Content-Encoding", "Accept-Encoding",
		HeaderIdempotencyKey, HeaderMethod, HeaderName, headerLastEventID} {
		h.Del(k)
	}
	h.Set("Accept", "text/event-stream")
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = []string{""} // send none, as the client sent none
	}
	return &pendingCall{
		session: in.Header.Get(HeaderSessionID),
		id:      bytes.Clone(id),
		target:  p.target(in.URL).String(),
		header:  h,
		host:    p.outHost(in.Host),
		done:    make(chan struct{}),
		wake:    make(chan struct{}, 1),
		ids:     make(map[string]struct{}),
	}
}

// sawEvent records an event's id and retry fields; an event with a
// non-empty id is one the stream can be resumed from.
func (c *pendingCall) sawEvent(raw []byte) {
	id, hasID, retry, hasRetry := eventFields(raw)
	if !hasID && !hasRetry {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if hasRetry {
		c.retry = min(retry, maxRetryHint)
	}
	if !hasID {
		return
	}
	c.lastID = id
	if id == "" {
		return
	}
	if _, ok := c.ids[id]; !ok {
		if len(c.order) >= maxEventIDs {
			delete(c.ids, c.order[0])
			c.order = c.order[1:]
		}
		c.ids[id] = struct{}{}
		c.order = append(c.order, id)
	}
}

// resumeFrom returns the Last-Event-ID to resume with, "" if none.
func (c *pendingCall) resumeFrom() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lastID
}

// resolve sets the call's outcome; the first one wins.
func (c *pendingCall) resolve(up engine.Upstream) {
	c.mu.Lock()
	defer c.mu.Unlock()
	select {
	case <-c.done:
	default:
		c.up = up
		close(c.done)
	}
}

func (c *pendingCall) result() (engine.Upstream, bool) {
	select {
	case <-c.done:
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.up, true
	default:
		return engine.Upstream{}, false
	}
}

func (c *pendingCall) notify() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// tapStart marks a client stream as resuming this call. The sidecar's own
// resumption, if it runs, gives way: servers allow one live stream per
// resumed stream.
func (c *pendingCall) tapStart() {
	c.mu.Lock()
	c.taps++
	own, ownEnd := c.own, c.ownEnd
	c.mu.Unlock()
	if own != nil {
		own()
		t := time.NewTimer(time.Second)
		select {
		case <-ownEnd:
		case <-t.C:
		}
		t.Stop()
	}
	c.notify()
}

func (c *pendingCall) tapEnd() {
	c.mu.Lock()
	c.taps--
	c.mu.Unlock()
	c.notify()
}

// startOwn registers the sidecar's own resumption unless a client stream
// is being tapped.
func (c *pendingCall) startOwn(cancel context.CancelFunc) (end func(), ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.taps > 0 {
		return nil, false
	}
	ch := make(chan struct{})
	c.own, c.ownEnd = cancel, ch
	return func() {
		c.mu.Lock()
		c.own, c.ownEnd = nil, nil
		c.mu.Unlock()
		close(ch)
	}, true
}

// waitHint is how long a client waits before it resumes.
func (c *pendingCall) waitHint() (time.Duration, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	hint := c.retry
	if hint <= 0 {
		hint = defaultRetryHint
	}
	return hint, c.taps
}

// resumeHub holds the pending calls whose streams may be resumed, by
// session. The zero value is ready to use.
type resumeHub struct {
	n     atomic.Int64 // calls held, read without the lock
	mu    sync.Mutex
	calls map[string]map[*pendingCall]struct{}
}

func (h *resumeHub) add(c *pendingCall) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.calls == nil {
		h.calls = make(map[string]map[*pendingCall]struct{})
	}
	m := h.calls[c.session]
	if m == nil {
		m = make(map[*pendingCall]struct{})
		h.calls[c.session] = m
	}
	if _, ok := m[c]; !ok {
		m[c] = struct{}{}
		h.n.Add(1)
	}
}

func (h *resumeHub) remove(c *pendingCall) {
	h.mu.Lock()
	defer h.mu.Unlock()
	m := h.calls[c.session]
	if _, ok := m[c]; !ok {
		return
	}
	delete(m, c)
	h.n.Add(-1)
	if len(m) == 0 {
		delete(h.calls, c.session)
	}
}

// match returns the pending calls of session that carried the event id a
// GET resumes from.
func (h *resumeHub) match(session, lastEventID string) []*pendingCall {
	if h.n.Load() == 0 || lastEventID == "" {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []*pendingCall
	for c := range h.calls[session] {
		c.mu.Lock()
		_, ok := c.ids[lastEventID]
		c.mu.Unlock()
		if ok {
			out = append(out, c)
		}
	}
	return out
}

// serveResumedStream relays a client's GET that resumes a pending call's
// stream, as a reverse proxy would, and hands the call its response when it
// passes by.
func (p *Proxy) serveResumedStream(w http.ResponseWriter, r *http.Request, calls []*pendingCall) {
	for _, c := range calls {
		c.tapStart()
	}
	defer func() {
		for _, c := range calls {
			c.tapEnd()
		}
	}()
	req, err := http.NewRequestWithContext(r.Context(), http.MethodGet, p.target(r.URL).String(), nil)
	if err != nil {
		writeError(w, r, http.StatusBadRequest, nil, mcpmsg.CodeInvalidRequest, err.Error())
		return
	}
	req.Header = r.Header.Clone()
	removeHopHeaders(req.Header)
	req.Header.Del("Accept-Encoding") // events must be readable to find the response
	if _, ok := req.Header["User-Agent"]; !ok {
		req.Header["User-Agent"] = []string{""}
	}
	req.Host = p.outHost(r.Host)
	resp, err := p.send(req)
	if err != nil {
		p.upstreamError(w, r, err)
		return
	}
	defer func() { _ = resp.Body.Close() }()
	h := resp.Header.Clone()
	removeHopHeaders(h)
	s := newSink(w, p.opts.ClientWriteTimeout)
	defer s.detach()
	s.header(resp.StatusCode, h)
	body := &readTracker{r: resp.Body}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if resp.StatusCode < 200 || resp.StatusCode > 299 || mt != "text/event-stream" {
		_, _ = io.Copy(s, body)
		if body.err != nil && !s.isGone() {
			panic(http.ErrAbortHandler)
		}
		return
	}
	er := mcpmsg.NewEventReader(body, int(p.opts.MaxResponseBytes))
	defer er.Release()
	var oversized int64
	for !s.isGone() {
		ev, err := er.Next()
		if errors.Is(err, mcpmsg.ErrEventTooLarge) {
			s.write(ev.Raw)
			n, serr := er.SkipEvent(s, nil)
			oversized = max(oversized, int64(len(ev.Raw))+n)
			if serr != nil {
				break
			}
			continue
		}
		if len(ev.Raw) > 0 {
			s.write(ev.Raw)
			for _, c := range calls {
				c.sawEvent(ev.Raw)
				if isResponseTo(ev.Data, c.id) {
					c.resolve(engine.Upstream{Status: resp.StatusCode, Response: bytes.Clone(ev.Data)})
				}
			}
		}
		if err != nil {
			break
		}
	}
	if body.err != nil {
		if !s.isGone() {
			panic(http.ErrAbortHandler) // the client sees the abort the server made
		}
		return
	}
	if oversized > 0 && !s.isGone() {
		// The stream ended on an event too large to keep: most likely the
		// response. The call ran.
		for _, c := range calls {
			c.resolve(engine.Upstream{Status: resp.StatusCode, TooLarge: true, Size: oversized})
		}
	}
}

// awaitPending gets a pending call's response: from the client's resumed
// stream, or from the sidecar's own resumption when the client does not
// resume. It gives up (engine.ErrOutcomeUnknown) when the server refuses
// the resumption or cannot be reached for a lease.
func (p *Proxy) awaitPending(ctx context.Context, c *pendingCall, lease time.Duration) (engine.Upstream, error) {
	defer p.resumes.remove(c)
	contact := time.Now()
	quiet := 0 // own resumptions in a row that brought nothing
	for {
		if up, ok := c.result(); ok {
			return up, nil
		}
		hint, taps := c.waitHint()
		if taps > 0 {
			select {
			case <-c.done:
			case <-c.wake:
			}
			contact = time.Now()
			continue
		}
		if time.Since(contact) > lease {
			return engine.Upstream{}, fmt.Errorf("%w: the MCP server's stream could not be resumed for %s", engine.ErrOutcomeUnknown, lease)
		}
		wait := time.Duration(float64(hint) * math.Pow(1.5, float64(min(quiet, 10))))
		t := time.NewTimer(min(wait, maxRetryHint) + p.opts.ResumeGrace)
		select {
		case <-c.done:
			t.Stop()
			continue
		case <-c.wake:
			t.Stop()
			continue
		case <-t.C:
		}
		progress, refused, err := p.resumeUpstream(ctx, c)
		switch {
		case refused != "":
			return engine.Upstream{}, fmt.Errorf("%w: the MCP server refused to resume the call's stream (%s)", engine.ErrOutcomeUnknown, refused)
		case err != nil:
			quiet++
			p.log.Debug("Resuming a call's stream failed", "err", err)
		case progress:
			contact, quiet = time.Now(), 0
		default:
			contact = time.Now()
			quiet++
		}
	}
}

// resumeUpstream resumes a pending call's stream from the last event id
// seen, as a client would, and reads it until it ends or brings the
// response. It reports whether any event came, and why the server refused
// the resumption if it did.
func (p *Proxy) resumeUpstream(ctx context.Context, c *pendingCall) (progress bool, refused string, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	end, ok := c.startOwn(cancel)
	if !ok {
		return false, "", nil // the client is resuming it
	}
	defer end()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.target, nil)
	if err != nil {
		return false, err.Error(), nil
	}
	req.Header = c.header.Clone()
	req.Header.Set(headerLastEventID, c.resumeFrom())
	req.Host = c.host
	resp, err := p.send(req)
	if err != nil {
		if ctx.Err() != nil {
			return false, "", nil // a client stream took over
		}
		return false, "", err
	}
	defer func() { _ = resp.Body.Close() }()
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if resp.StatusCode < 200 || resp.StatusCode > 299 || mt != "text/event-stream" {
		if ctx.Err() != nil {
			return false, "", nil
		}
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		why := fmt.Sprintf("HTTP %d", resp.StatusCode)
		if m := strings.TrimSpace(string(msg)); m != "" {
			why += ": " + m
		}
		return false, why, nil
	}
	er := mcpmsg.NewEventReader(resp.Body, int(p.opts.MaxResponseBytes))
	defer er.Release()
	var oversized int64
	for {
		ev, err := er.Next()
		if errors.Is(err, mcpmsg.ErrEventTooLarge) {
			progress = true
			n, serr := er.SkipEvent(io.Discard, nil)
			oversized = max(oversized, int64(len(ev.Raw))+n)
			if serr != nil {
				break
			}
			continue
		}
		if len(ev.Raw) > 0 {
			progress = true
			c.sawEvent(ev.Raw)
			if isResponseTo(ev.Data, c.id) {
				c.resolve(engine.Upstream{Status: resp.StatusCode, Response: bytes.Clone(ev.Data)})
				return true, "", nil
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				break
			}
			return progress, "", err
		}
	}
	if oversized > 0 && ctx.Err() == nil {
		c.resolve(engine.Upstream{Status: resp.StatusCode, TooLarge: true, Size: oversized})
	}
	return progress, "", nil
}

// eventFields returns an event's id and retry fields as an SSE client
// reads them: an id without NUL sets the last event id (empty resets it);
// a retry of ASCII digits sets the reconnection time in milliseconds.
func eventFields(raw []byte) (id string, hasID bool, retry time.Duration, hasRetry bool) {
	// SSE lines end in CRLF, LF or a bare CR.
	raw = bytes.ReplaceAll(raw, []byte("\r\n"), []byte("\n"))
	raw = bytes.ReplaceAll(raw, []byte("\r"), []byte("\n"))
	for _, line := range bytes.Split(raw, []byte("\n")) {
		name, value, found := bytes.Cut(line, []byte(":"))
		if len(name) == 0 {
			continue // a comment or a blank line
		}
		if found {
			value = bytes.TrimPrefix(value, []byte(" "))
		}
		switch string(name) {
		case "id":
			if bytes.IndexByte(value, 0) < 0 {
				id, hasID = string(value), true
			}
		case "retry":
			if n, err := strconv.ParseUint(string(value), 10, 31); err == nil {
				retry, hasRetry = time.Duration(n)*time.Millisecond, true
			}
		}
	}
	return id, hasID, retry, hasRetry
}

// readTracker remembers the first error of a read that was not the end of
// the body: the upstream aborted, and the client must see an abort too.
type readTracker struct {
	r   io.Reader
	err error
}

func (t *readTracker) Read(b []byte) (int, error) {
	n, err := t.r.Read(b)
	if err != nil && !errors.Is(err, io.EOF) && t.err == nil {
		t.err = err
	}
	return n, err
}
