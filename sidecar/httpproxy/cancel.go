package httpproxy

import (
	"encoding/json"
	"net/http"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

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
