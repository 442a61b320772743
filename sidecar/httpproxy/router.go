package httpproxy

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strings"

	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// ServeHTTP implements http.Handler. It routes each request once, by its
// method, then by what the proxy knows of it:
//
//	GET      resuming a pending call's stream    serveResumedStream (resume.go)
//	         an event stream with no session     serveEventStream (legacy.go; a legacy SSE session if its first event is an endpoint)
//	         any other (Streamable GET stream)   forwarded untouched
//	POST     to a legacy session's endpoint      serveLegacyPost, or serveSharedEndpointPost (legacy.go)
//	         any other                           serveStreamablePost (below; tools/call goes on to dedup.go)
//	DELETE   the end of a session                serveDelete (holds.go: it waits for the session's calls)
//	OPTIONS  a CORS preflight                    forwarded untouched
//	other    not MCP                             405, not forwarded
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet, http.MethodPost, http.MethodDelete, http.MethodOptions:
	default:
		refuseMethod(w, r)
		return
	}
	release, ok := p.admit(w, r)
	if !ok {
		return
	}
	defer release()
	switch r.Method {
	case http.MethodGet:
		p.serveGet(w, r)
	case http.MethodPost:
		p.servePost(w, r)
	case http.MethodDelete:
		p.serveDelete(w, r)
	default:
		p.rp.ServeHTTP(w, r) // OPTIONS: only the MCP server can answer it
	}
}

// refuseMethod answers a method MCP does not use; none is forwarded:
// CONNECT would ask the server for a tunnel, TRACE would echo the
// caller's headers back, and a server's router may treat PUT or HEAD like
// POST or GET behind the dedup's back.
func refuseMethod(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Allow", allowedMethods)
	w.Header().Set("Connection", "close")
	writeError(w, r, http.StatusMethodNotAllowed, nil, mcpmsg.CodeInvalidRequest,
		fmt.Sprintf("method %s is not used by MCP; the idemcp sidecar takes %s", r.Method, allowedMethods))
}

func (p *Proxy) serveGet(w http.ResponseWriter, r *http.Request) {
	if calls := p.resumes.match(r.Header.Get(HeaderSessionID), r.Header.Get(headerLastEventID)); len(calls) > 0 {
		p.serveResumedStream(w, r, calls)
		return
	}
	if isLegacyStream(r) {
		p.serveEventStream(w, r)
		return
	}
	p.rp.ServeHTTP(w, r) // a Streamable HTTP GET stream: untouched
}

func (p *Proxy) servePost(w http.ResponseWriter, r *http.Request) {
	if s, shared := p.legacy.lookup(r.URL); s != nil {
		if shared {
			p.serveSharedEndpointPost(w, r)
			return
		}
		p.serveLegacyPost(w, r, s)
		return
	}
	p.serveStreamablePost(w, r)
}

// serveStreamablePost serves a Streamable HTTP POST: one message (or a
// batch), classified by its Mcp-Method header when it has one, else by
// its body. A tools/call goes on to the dedup path (dedup.go).
func (p *Proxy) serveStreamablePost(w http.ResponseWriter, r *http.Request) {
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

func headerValue(h http.Header, name string) (string, bool) {
	v, ok := h[name]
	if !ok || len(v) == 0 {
		return "", false
	}
	return v[0], true
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
