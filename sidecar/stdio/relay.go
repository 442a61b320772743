package stdio

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// readClient relays the client's messages to the child until stdin ends.
func (w *Wrapper) readClient() {
	lr := newLineReader(w.in, w.opts.MaxLineBytes)
	for {
		line, over, err := lr.next()
		switch {
		case over != nil:
			w.clientLineTooLong(over)
		case line != nil:
			w.fromClient(line)
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				w.log.Error("Reading from the client failed; treating it as hung up", "err", err)
			}
			return
		}
	}
}

func (w *Wrapper) fromClient(line []byte) {
	if len(bytes.TrimSpace(line)) == 0 {
		return
	}
	kind, err := mcpmsg.Sniff(line)
	if err != nil {
		w.refuse(nil, mcpmsg.ErrorCode(err), "a line from the client is not a JSON-RPC message: "+err.Error())
		return
	}
	if !mcpmsg.Valid(line) {
		w.refuse(nil, mcpmsg.CodeParseError, "a line from the client is not JSON")
		return
	}
	if kind == mcpmsg.Batch {
		// Batches (2025-03-26 only) are forwarded whole, not deduplicated.
		w.toChild(line, nil)
		return
	}
	msg, err := mcpmsg.Parse(line)
	if err != nil {
		// Strict: a message the server could read another way is refused.
		var id json.RawMessage
		if msg != nil {
			id = msg.ID
		}
		w.refuse(id, mcpmsg.ErrorCode(err), fmt.Sprintf("a line from the client is not one unambiguous JSON-RPC message: %v", err))
		return
	}
	w.noteProtocolMeta(msg)
	switch msg.Method {
	case "tools/call":
		w.onToolCall(line, msg)
		return
	case "tools/list":
		if msg.IsRequest() {
			w.lists.add(mcpmsg.IDKey(msg.ID))
		}
	case "notifications/cancelled":
		if w.swallowCancel(msg) {
			return
		}
	case "notifications/initialized":
		w.toChild(line, msg)
		w.sessionOpen(nil)
		return
	}
	w.toChild(line, msg)
}

// sessionOpen is called when the client's session is open: the wrapper
// can list the tools itself. A 2026-07-28 client opens none (it may send
// server/discover, then requests carrying the protocol in
// params._meta); the wrapper's own requests carry that _meta too.
func (w *Wrapper) sessionOpen(meta json.RawMessage) {
	if w.ownList.Open(meta) {
		w.lister.Start(w.base)
	}
}

// noteProtocolMeta opens the session for the wrapper's listing when a
// client request carries the 2026-07-28 protocol members in params._meta.
func (w *Wrapper) noteProtocolMeta(msg *mcpmsg.Message) {
	if w.ownList.Opened() || !msg.IsRequest() || msg.Method == "initialize" || msg.Method == "server/discover" {
		return
	}
	if meta := mcpmsg.ProtocolMeta(msg.Params); meta != nil {
		w.sessionOpen(meta)
	}
}

// refuse answers a line that is not forwarded, and says why on stderr.
func (w *Wrapper) refuse(id json.RawMessage, code int, why string) {
	w.log.Error("Refused a message from the client; nothing was forwarded", "code", code, "reason", why)
	_ = w.out.writeLine(mcpmsg.ErrorResponse(id, code, why+"; idemcp did not forward it"))
}

// toChild forwards a line as it came; a request that cannot be written
// is answered with an error.
func (w *Wrapper) toChild(line []byte, msg *mcpmsg.Message) {
	err := w.childIn.writeLine(line)
	if err == nil {
		return
	}
	if msg != nil && msg.IsRequest() {
		_ = w.out.writeLine(mcpmsg.ErrorResponse(msg.ID, mcpmsg.CodeUpstreamUnavailable, w.gone(err)))
		return
	}
	w.log.Warn("Dropped a message for the MCP server, which is not running", "method", methodOf(msg), "err", err)
}

func methodOf(msg *mcpmsg.Message) string {
	if msg == nil {
		return "batch"
	}
	if msg.Method == "" {
		return "response"
	}
	return msg.Method
}

// gone explains why the server cannot take a message.
func (w *Wrapper) gone(err error) string {
	if why := w.stopReason(); why != "" {
		return "the MCP server is not running (" + why + "); nothing was sent to it"
	}
	return fmt.Sprintf("the MCP server could not be reached (%v); nothing was sent to it", err)
}

// swallowCancel keeps a client's cancel of a deduplicated call from
// reaching the server: agents cancel on timeout and then retry, and the
// retry must get the result of the call that ran, not run it again.
func (w *Wrapper) swallowCancel(msg *mcpmsg.Message) bool {
	// Parse has checked the params: the id is read as the server reads it.
	reqID, _ := mcpmsg.CancelledRequestID(msg.Params)
	if len(reqID) == 0 || !w.calls.cancelled(engine.CancelKey(reqID)) {
		return false
	}
	w.log.Debug("Kept the client's cancel of a deduplicated call from the MCP server; the call goes on and its result is kept", "requestId", string(reqID))
	return true
}

func (w *Wrapper) onToolCall(line []byte, msg *mcpmsg.Message) {
	if len(msg.ID) == 0 {
		w.toChild(line, msg) // a notification: nothing to answer or deduplicate
		return
	}
	tc, err := engine.CallOf(msg)
	var span *engine.CallSpan
	if err == nil {
		var plan *engine.Plan
		var ctx context.Context
		ctx, span = w.engine.StartCall(w.base, engine.CallInfo{Tool: tc.Name, RequestID: msg.ID, Meta: tc.Meta, Transport: "pipe"})
		if plan, err = w.engine.PlanCall(ctx, tc, w.caller); err == nil && plan == nil { // counted by Plan
			span.Forwarded()
			span.End()
			w.toChild(line, msg)
			return
		} else if err == nil {
			w.dedup(ctx, line, msg.ID, plan)
			return
		}
	}
	var ee *engine.Error
	if !errors.As(err, &ee) {
		ee = &engine.Error{Code: mcpmsg.CodeInternalError, Message: err.Error()}
	}
	span.Error(ee.Code)
	span.End()
	_ = w.out.writeLine(mcpmsg.ErrorResponse(msg.ID, ee.Code, ee.Message))
}

// dedup answers a deduplicated call on its own goroutine: it may wait for
// another caller's result.
//
// base carries the call's span (engine.StartCall), which ends when the
// call is answered.
func (w *Wrapper) dedup(base context.Context, line []byte, id json.RawMessage, plan *engine.Plan) {
	span := engine.CallSpanFrom(base)
	key := mcpmsg.IDKey(id)
	ctx, cancel := context.WithCancel(base)
	c := w.calls.start(engine.CancelKey(id), cancel)
	if c == nil {
		span.End()
		cancel()
		w.refuse(id, mcpmsg.CodeInvalidRequest, fmt.Sprintf("request id %s is already used by a call in flight", id))
		return
	}
	if !w.tasks.add() {
		span.End()
		w.calls.release(c)
		cancel()
		_ = w.out.writeLine(mcpmsg.ErrorResponse(id, mcpmsg.CodeUpstreamUnavailable, w.gone(errClosed)))
		return
	}
	w.engine.Go("wrap", func() {
		defer w.tasks.done()
		defer span.End()
		defer cancel()
		defer w.calls.release(c)
		out, err := w.engine.Execute(ctx, plan, func(context.Context) (engine.Upstream, error) {
			w.calls.hold(c)
			defer w.calls.release(c)
			up, err := w.forward(line, key, c)
			c.fwdErr = err
			close(c.fwdDone)
			return up, err
		})
		w.answer(c, id, plan, out, err)
	})
}

// forward writes a deduplicated call to the child and waits for the
// response with its id, which the child reader relays to the client.
func (w *Wrapper) forward(line []byte, key string, c *dedupCall) (engine.Upstream, error) {
	p, err := w.router.expect(key, c)
	if err != nil {
		return engine.Upstream{}, err
	}
	if err := w.childIn.writeLine(line); err != nil {
		w.router.drop(key, p)
		return engine.Upstream{}, &upstreamError{code: mcpmsg.CodeUpstreamUnavailable, msg: w.gone(err)}
	}
	<-p.done
	if p.err != nil {
		return engine.Upstream{}, p.err
	}
	if p.tooLarge > 0 {
		return engine.Upstream{TooLarge: true, Size: p.tooLarge}, nil
	}
	return engine.Upstream{Response: p.resp}, nil
}

func (w *Wrapper) answer(c *dedupCall, id json.RawMessage, plan *engine.Plan, out engine.Outcome, err error) {
	if errors.Is(err, engine.ErrDetached) && !c.cancelled.Load() {
		// The wrapper is stopping while the call runs: its response is
		// relayed when it comes; if it never does, say so.
		<-c.fwdDone
		if err = c.fwdErr; err == nil {
			return
		}
	}
	if c.cancelled.Load() {
		// A cancelled request gets no answer; a call it started goes on.
		return
	}
	var ee *engine.Error
	var ue *upstreamError
	var resp []byte
	switch {
	case err == nil && out.Kind == engine.Replayed:
		resp = mcpmsg.WithID(out.Response, id)
	case err == nil:
		return // relayed by the child reader
	case errors.As(err, &ee):
		resp = mcpmsg.ErrorResponse(id, ee.Code, ee.Message)
	case errors.As(err, &ue) && ue.relayed:
		w.log.Warn("A deduplicated call's response could not be read one way only; it was relayed as is, and its key is released", "tool", plan.Tool, "reason", ue.msg)
		return
	case errors.As(err, &ue):
		w.log.Warn("A deduplicated call failed upstream; its key is released, so a retry runs it again", "tool", plan.Tool, "reason", ue.msg)
		resp = mcpmsg.ErrorResponse(id, ue.code, ue.msg)
	default:
		resp = mcpmsg.ErrorResponse(id, mcpmsg.CodeUpstreamUnavailable, fmt.Sprintf(
			"%q was not called: idemcp wrap is stopping (%s)", plan.Tool, w.stopReason()))
	}
	_ = w.out.writeLine(resp)
}

func (w *Wrapper) clientLineTooLong(o *overlong) {
	why := fmt.Sprintf("a message from the client is %d bytes, over the limit of %d (--max-line-bytes)", o.size, w.opts.MaxLineBytes)
	switch {
	case o.id != nil && o.method:
		w.refuse(o.id, mcpmsg.CodeInvalidRequest, why)
	case o.id != nil:
		// A response to the server's request: tell the server, so it does
		// not wait for it forever.
		w.log.Error("Dropped the client's response to a request of the MCP server", "reason", why, "id", string(o.id))
		_ = w.childIn.writeLine(mcpmsg.ErrorResponse(o.id, mcpmsg.CodeInternalError, why+"; idemcp dropped it"))
	default:
		w.log.Error("Dropped a message from the client", "reason", why)
	}
}

// readChild relays the child's messages to the client until its stdout
// ends, then fails the calls still waiting for a response.
func (w *Wrapper) readChild(exited <-chan struct{}) {
	lr := newLineReader(w.childOut, w.opts.MaxResponseBytes)
	for {
		line, over, err := lr.next()
		switch {
		case over != nil:
			w.childLineTooLong(over)
		case line != nil:
			w.fromChild(line)
		}
		if err != nil {
			break
		}
	}
	// The exit code makes the error clearer; it usually follows at once.
	why := "the MCP server closed its stdout before answering"
	select {
	case <-exited:
		why = fmt.Sprintf("the MCP server exited with code %d before answering", exitCode(w.cmd.ProcessState))
	case <-time.After(time.Second):
	}
	w.router.close(&upstreamError{code: mcpmsg.CodeUpstreamUnavailable,
		msg: why + "; nothing was stored, so a retry runs the call again"})
}

func (w *Wrapper) fromChild(line []byte) {
	if len(bytes.TrimSpace(line)) == 0 {
		return
	}
	kind, err := mcpmsg.Sniff(line)
	if err != nil || !mcpmsg.Valid(line) {
		// Servers must log to stderr; a stray line on stdout would break
		// the client's stream.
		w.log.Warn("Dropped a line the MCP server wrote to stdout that is not JSON-RPC", "line", truncate(line, 200))
		return
	}
	if kind == mcpmsg.Batch {
		// A batch answer (also to a single request): each response in it
		// settles its call; the line goes to the client as it came.
		elems, _ := mcpmsg.BatchElements(line)
		own := 0
		for _, e := range elems {
			if w.settle(e, true) == settledOwn {
				own++
			}
		}
		if own < len(elems) {
			_ = w.out.writeLine(line)
		}
		return
	}
	if w.settle(line, false) == unsettled {
		_ = w.out.writeLine(line)
	}
}

// What settle did with a message.
const (
	unsettled  = iota // nothing: the caller relays it
	settled           // it settled a call, and relayed it unless told not to
	settledOwn        // it answered the wrapper's own request: not for the client
)

// settle hands a message from the server to whoever waits for it: the
// wrapper's own tools/list, a deduplicated call, a client's tools/list to
// learn from. relayed says the caller relays the message in any case. Every response that names
// a waiting call settles it, so that no call waits forever: one with the
// id in the other type (1 for "1") is taken as its response, as SDK
// clients that compare ids by value take it; one that cannot be read one
// way only fails the call.
func (w *Wrapper) settle(data []byte, relayed bool) int {
	msg, err := mcpmsg.Parse(data)
	if err != nil {
		for _, id := range mcpmsg.LooseIDs(data) {
			if p := w.takePending(id); p != nil {
				p.err = &upstreamError{code: mcpmsg.CodeInternalError, relayed: true, msg: fmt.Sprintf(
					"the MCP server's response to request %s cannot be read one way only (%v); nothing was stored, so a retry runs the call again", id, err)}
				close(p.done)
			}
		}
		return unsettled
	}
	if msg.Method == "notifications/tools/list_changed" {
		w.lister.Changed()
		return unsettled
	}
	if msg.Method != "" || len(msg.ID) == 0 {
		return unsettled
	}
	if w.ownList.Deliver(msg) {
		return settledOwn
	}
	if p := w.takePending(msg.ID); p != nil {
		if !relayed && !p.call.cancelled.Load() {
			_ = w.out.writeLine(data)
		}
		p.resp = data
		close(p.done)
		return settled
	}
	if w.lists.take(mcpmsg.IDKey(msg.ID)) && len(msg.Result) > 0 {
		w.engine.Hints().ObserveListResult(msg.Result)
	}
	return unsettled
}

// takePending returns the deduplicated call waiting for a response with
// id: the exact id first, then the same id in the other type.
func (w *Wrapper) takePending(id json.RawMessage) *pending {
	if p := w.router.take(mcpmsg.IDKey(id)); p != nil {
		return p
	}
	if k, ok := mcpmsg.OtherTypeIDKey(id); ok {
		if p := w.router.take(k); p != nil {
			w.log.Warn("The MCP server answered a request with its id in another type; taking it as the response", "id", string(id))
			return p
		}
	}
	return nil
}

func (w *Wrapper) childLineTooLong(o *overlong) {
	why := fmt.Sprintf("a message from the MCP server is %d bytes, over the limit of %d (--max-response-bytes)", o.size, w.opts.MaxResponseBytes)
	w.log.Error("Dropped a message from the MCP server", "reason", why, "id", string(o.id))
	switch {
	case o.id != nil && o.method:
		_ = w.childIn.writeLine(mcpmsg.ErrorResponse(o.id, mcpmsg.CodeInternalError, why+"; idemcp dropped it"))
	case o.id != nil:
		if p := w.router.take(mcpmsg.IDKey(o.id)); p != nil {
			// A deduplicated call ran: its retries get an error rather
			// than a second run. A request its client cancelled gets no
			// answer.
			if !p.call.cancelled.Load() {
				_ = w.out.writeLine(mcpmsg.ErrorResponse(o.id, mcpmsg.CodeResultNotStored,
					why+"; idemcp dropped it; the call ran, so a retry gets this error instead of running it again"))
			}
			p.tooLarge = o.size
			close(p.done)
			return
		}
		_ = w.out.writeLine(mcpmsg.ErrorResponse(o.id, mcpmsg.CodeInternalError, why+"; idemcp dropped it"))
	}
}

func truncate(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return string(b[:n]) + "..."
}
