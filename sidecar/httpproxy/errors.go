package httpproxy

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

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
