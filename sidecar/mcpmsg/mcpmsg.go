// Package mcpmsg reads and writes the few parts of JSON-RPC messages the
// proxy needs, without decoding more than it must: most messages are only
// classified and forwarded byte for byte.
package mcpmsg

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
)

// JSON-RPC and idemcp error codes. idemcp's own codes sit in the
// implementation-defined range -32000..-32019 the design reserves, from
// -32010 up: the SDKs already give meaning to -32000..-32005 (the Go SDK
// reads -32003 and -32004 as "connection closing", the MCP spec uses
// -32002 for a missing resource).
const (
	CodeParseError     = -32700
	CodeInvalidRequest = -32600
	CodeInvalidParams  = -32602
	CodeInternalError  = -32603

	// CodeKeyConflict means an explicit key was reused with other arguments.
	CodeKeyConflict = -32010
	// CodeInFlight means the first call with this key is still running and
	// the policy says Reject, or waitTimeout ran out.
	CodeInFlight = -32011
	// CodeOutcomeUnknown means the first call's owner died mid-call and the
	// policy says onAbandoned: Error.
	CodeOutcomeUnknown = -32012
	// CodeStoreUnavailable means the store cannot be reached and the policy
	// says FailClosed; nothing ran.
	CodeStoreUnavailable = -32013
	// CodeResultNotStored means the first call completed but its result was
	// over maxResultBytes, so there is nothing to replay; it is not run again.
	CodeResultNotStored = -32014
	// CodeUpstreamUnavailable means the MCP server could not be reached.
	CodeUpstreamUnavailable = -32015
)

// Message is the envelope of one JSON-RPC message. Params, Result and Error
// stay raw until someone needs them.
type Message struct {
	JSONRPC string          `json:"jsonrpc"`
	ID      json.RawMessage `json:"id,omitempty"`
	Method  string          `json:"method,omitempty"`
	Params  json.RawMessage `json:"params,omitempty"`
	Result  json.RawMessage `json:"result,omitempty"`
	Error   json.RawMessage `json:"error,omitempty"`
}

// IsRequest reports a message with a method and an id.
func (m *Message) IsRequest() bool { return m.Method != "" && len(m.ID) > 0 }

// Kind says how a body is shaped.
type Kind int

const (
	// Single is one JSON object.
	Single Kind = iota + 1
	// Batch is a JSON array (2025-03-26 batching).
	Batch
)

// Sniff tells a single message from a batch by the first non-space byte, so
// batches can be forwarded without being decoded.
func Sniff(body []byte) (Kind, error) {
	for _, c := range body {
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		case '{':
			return Single, nil
		case '[':
			return Batch, nil
		default:
			return 0, errors.New("body is not a JSON-RPC message: it must be a JSON object (or an array, for a batch)")
		}
	}
	return 0, errors.New("body is empty: a JSON-RPC message was expected")
}

// Parse decodes the envelope of one message and checks that it is a
// request, a notification or a response.
func Parse(body []byte) (*Message, error) {
	var m Message
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("body is not valid JSON: %w", err)
	}
	if m.Method == "" && len(m.Result) == 0 && len(m.Error) == 0 {
		return &m, errors.New(`message has no "method" (a request or notification) and no "result" or "error" (a response)`)
	}
	if len(m.ID) > 0 && !validID(m.ID) {
		return &m, fmt.Errorf(`"id" must be a string or a number, not %s`, m.ID)
	}
	return &m, nil
}

func validID(id json.RawMessage) bool {
	if len(id) == 0 {
		return false
	}
	switch id[0] {
	case '"':
		return true
	case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
		return true
	case 'n': // null is tolerated in responses to unparseable requests
		return bytes.Equal(id, []byte("null"))
	}
	return false
}

// ErrorResponse builds a JSON-RPC error response. A nil id becomes null.
func ErrorResponse(id json.RawMessage, code int, message string) []byte {
	if len(id) == 0 {
		id = json.RawMessage("null")
	}
	msg, _ := json.Marshal(message)
	var b bytes.Buffer
	b.Grow(64 + len(id) + len(msg))
	b.WriteString(`{"jsonrpc":"2.0","id":`)
	b.Write(id)
	b.WriteString(`,"error":{"code":`)
	b.WriteString(strconv.Itoa(code))
	b.WriteString(`,"message":`)
	b.Write(msg)
	b.WriteString(`}}`)
	return b.Bytes()
}

// WithID returns a stored response (a JSON object written without an id)
// with id inserted as its first member. The id is kept exactly as the
// caller sent it, string or number.
func WithID(stored []byte, id json.RawMessage) []byte {
	if len(id) == 0 {
		id = json.RawMessage("null")
	}
	out := make([]byte, 0, len(stored)+len(id)+8)
	out = append(out, `{"id":`...)
	out = append(out, id...)
	out = append(out, ',')
	return append(out, stored[1:]...)
}

// SameID reports whether two raw ids are the same id. Numbers compare by
// value (1 and 1.0 are one id), strings by content.
func SameID(a, b json.RawMessage) bool {
	if bytes.Equal(a, b) {
		return true
	}
	if len(a) == 0 || len(b) == 0 || a[0] == '"' || b[0] == '"' {
		var sa, sb string
		return a != nil && b != nil && json.Unmarshal(a, &sa) == nil && json.Unmarshal(b, &sb) == nil && sa == sb
	}
	fa, errA := strconv.ParseFloat(string(a), 64)
	fb, errB := strconv.ParseFloat(string(b), 64)
	return errA == nil && errB == nil && fa == fb
}

// IDKey is a map key for an id: numbers by value, strings by content.
func IDKey(id json.RawMessage) string {
	if len(id) > 0 && id[0] == '"' {
		var s string
		if json.Unmarshal(id, &s) == nil {
			return "s:" + s
		}
	}
	if f, err := strconv.ParseFloat(string(id), 64); err == nil {
		return "n:" + strconv.FormatFloat(f, 'g', -1, 64)
	}
	return "r:" + string(id)
}
