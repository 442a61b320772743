package httpproxy

import (
	"context"
	"encoding/json"
	"net/http"
	"sync"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// A server may list some tools only to clients that declare a capability
// (roots, sampling, elicitation): the proxy remembers what each session's
// client declared at initialize, so that a tool the sidecar's own listing
// does not name is looked for in a listing made with the same
// capabilities and credentials (engine.ListingContext).

// maxClientSessions bounds the sessions whose capabilities are kept;
// session ids come from the server, one per client initialize.
const maxClientSessions = 4096

// maxCapabilitiesBytes bounds the capabilities kept for one session.
const maxCapabilitiesBytes = 16 << 10

type clientCaps struct {
	mu       sync.Mutex
	sessions map[string]json.RawMessage
}

func (c *clientCaps) put(session string, caps json.RawMessage) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sessions == nil || len(c.sessions) >= maxClientSessions {
		c.sessions = map[string]json.RawMessage{} // start over: a lost entry costs one listing without them
	}
	c.sessions[session] = caps
}

func (c *clientCaps) get(session string) json.RawMessage {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sessions[session]
}

const initCapsKey ctxKey = 1

// forwardInitialize forwards a client's initialize, and keeps the
// capabilities it declares for the session the response names.
func (p *Proxy) forwardInitialize(w http.ResponseWriter, r *http.Request, body []byte, msg *mcpmsg.Message) {
	var params struct {
		Capabilities json.RawMessage `json:"capabilities"`
	}
	if json.Unmarshal(msg.Params, &params) == nil && len(params.Capabilities) > 0 && len(params.Capabilities) <= maxCapabilitiesBytes && params.Capabilities[0] == '{' {
		r = r.WithContext(context.WithValue(r.Context(), initCapsKey, params.Capabilities))
	}
	p.forwardBody(w, r, body, false)
}

// rememberClient keeps an initialize's capabilities under the session id
// its response carries.
func (p *Proxy) rememberClient(resp *http.Response) {
	caps, ok := resp.Request.Context().Value(initCapsKey).(json.RawMessage)
	if !ok || resp.StatusCode != http.StatusOK {
		return
	}
	if session := resp.Header.Get(HeaderSessionID); session != "" {
		p.clients.put(session, caps)
	}
}

// listingContext is where a caller stands for the tools the server lists:
// its session's capabilities and its credentials (nil: nothing to list
// with that the sidecar's own listing lacks).
func (p *Proxy) listingContext(session, header, value string) *engine.ListingContext {
	var caps json.RawMessage
	if session != "" {
		caps = p.clients.get(session)
	}
	if caps == nil && value == "" {
		return nil
	}
	return &engine.ListingContext{Capabilities: caps, Header: header, Value: value}
}
