package httpproxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

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
	resp, err := p.send(req)           //nolint:bodyclose // closed below, or by the sink once the rest is relayed
	if err != nil {
		return engine.Upstream{}, fmt.Errorf("calling the MCP server: %w", err)
	}
	// The response is ours alone: relay its header without a copy, read
	// what the sidecar needs of it first.
	h := resp.Header
	encodings := h.Values("Content-Encoding")
	mt, _, _ := mime.ParseMediaType(h.Get("Content-Type"))
	removeHopHeaders(h)
	rb := &readTracker{r: resp.Body}
	if resp.StatusCode < 200 || resp.StatusCode > 299 || mt != "text/event-stream" {
		return p.relayJSON(resp, rb, encodings, id, s)
	}
	return p.relaySSE(in, resp, rb, encodings, id, s, lease)
}

// relayJSON relays a response that is one body (a JSON response, or
// whatever an error status carries) and returns it as the call's outcome
// when it is the response to id.
func (p *Proxy) relayJSON(resp *http.Response, rb *readTracker, encodings []string, id json.RawMessage, s *sink) (engine.Upstream, error) {
	up := engine.Upstream{Status: resp.StatusCode}
	defer drainAndClose(resp.Body)
	s.header(resp.StatusCode, resp.Header)
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

// relaySSE relays an event stream event by event until the response to id
// passes, and returns it; the rest of the stream is the sink's to relay.
func (p *Proxy) relaySSE(in *http.Request, resp *http.Response, rb *readTracker, encodings []string, id json.RawMessage, s *sink, lease time.Duration) (engine.Upstream, error) {
	h := resp.Header
	up := engine.Upstream{Status: resp.StatusCode}
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
	defer er.Release()
	// A large event (a large result) is relayed as it is read, up to an
	// id line, rather than after its end: the client gets its last byte
	// about when the sidecar does.
	er.Stream(s)
	var oversized int64
	for {
		ev, err := er.Next()
		if errors.Is(err, mcpmsg.ErrEventTooLarge) {
			// Relay it whole without keeping it, and read on: if it was
			// not our response, the response still follows.
			s.write(ev.Raw[ev.Sent:])
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
			s.write(ev.Raw[ev.Sent:])
			if err == nil && ev.HasData && isResponseTo(ev.Data, id) {
				if c != nil {
					p.resumes.remove(c)
				}
				// Data is the reader's own (a run of Raw): no copy.
				up.Response, up.Valid = ev.Data, true
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
