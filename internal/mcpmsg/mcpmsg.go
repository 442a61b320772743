// Package mcpmsg reads and writes the few parts of JSON-RPC messages the
// proxy needs, without decoding more than it must: most messages are only
// classified and forwarded byte for byte.
package mcpmsg

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
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
	// CodeTaskElsewhere means the first call with this key created a task in
	// another session, where alone the task can be read; it is not run again.
	CodeTaskElsewhere = -32016
	// CodeOverloaded means the caller (or all callers together) is over a
	// bound of the sidecar: waiters on a call in flight, open streams. The
	// call was not forwarded; retry later.
	CodeOverloaded = -32017
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
	// Call is a tools/call request's params as DecodeToolCall reads them,
	// set by Parse, so that nobody decodes them twice.
	Call *ToolCall `json:"-"`
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
// batches can be forwarded without being decoded. Its error is an *Error:
// CodeParseError for a body that is not JSON, CodeInvalidRequest for JSON
// that is neither an object nor an array.
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
			if !Valid(body) {
				return 0, &Error{Code: CodeParseError, Message: "body is not JSON: a JSON-RPC message must be a JSON object (or an array, for a batch)"}
			}
			return 0, invalidRequest("body is %s, not a JSON-RPC message: it must be a JSON object (or an array, for a batch)", kindOf(body))
		}
	}
	return 0, &Error{Code: CodeParseError, Message: "body is empty: a JSON-RPC message was expected"}
}

// envelopeMembers are the members of a JSON-RPC message the proxy reads.
var envelopeMembers = []string{"jsonrpc", "id", "method", "params", "result", "error"}

// Parse decodes the envelope of one message and checks that it is a
// request, a notification or a response. It decodes strictly (see
// objectMembers): a message the server could read another way than the
// proxy is refused. Its errors are *Error: CodeParseError when the body is
// not JSON (the message is then nil), CodeInvalidRequest when it is not one
// unambiguous JSON-RPC message, and CodeInvalidParams when the params of a
// tools/call or notifications/cancelled are ambiguous. The message returned
// with an error carries the id when that could be read.
func Parse(body []byte) (*Message, error) {
	if !Valid(body) {
		var v any
		err := json.Unmarshal(body, &v)
		return nil, &Error{Code: CodeParseError, Message: fmt.Sprintf("body is not valid JSON: %v", err)}
	}
	ms, err := objectMembers(body, "the message", envelopeMembers...)
	if err != nil {
		// Answer with the id if only one member could be it.
		var m Message
		if ids := LooseIDs(body); len(ids) == 1 && validID(ids[0], "id") == nil && idMemberExact(body) {
			m.ID = ids[0]
		}
		return &m, invalidRequest("%v", err)
	}
	var m Message
	for _, mb := range ms {
		switch mb.name {
		case "jsonrpc":
			if m.JSONRPC, err = stringValue(mb.value, `"jsonrpc"`); err != nil {
				return &m, invalidRequest("%v", err)
			}
		case "id":
			if err := validID(mb.value, `"id"`); err != nil {
				return &m, invalidRequest("%v", err)
			}
			m.ID = mb.value
		case "method":
			if m.Method, err = stringValue(mb.value, `"method"`); err != nil {
				return &m, invalidRequest("%v", err)
			}
		case "params":
			m.Params = mb.value
		case "result":
			m.Result = mb.value
		case "error":
			m.Error = mb.value
		}
	}
	if m.Method == "" && len(m.Result) == 0 && len(m.Error) == 0 {
		return &m, invalidRequest(`message has no "method" (a request or notification) and no "result" or "error" (a response)`)
	}
	switch m.Method {
	case "tools/call":
		if m.Call, err = decodeToolCall(m.Params, true); err != nil {
			return &m, err
		}
	case "notifications/cancelled":
		if _, err := CancelledRequestID(m.Params); err != nil {
			return &m, err
		}
	}
	return &m, nil
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

// SameID reports whether two raw ids are the same id: numbers by exact
// value (1 and 1.0 are one id, 9007199254740992 and 9007199254740993 are
// two), strings by content; a number is never the same id as a string.
func SameID(a, b json.RawMessage) bool {
	if len(a) == 0 || len(b) == 0 {
		return false
	}
	return bytes.Equal(a, b) || IDKey(a) == IDKey(b)
}

// IDKey is a map key for an id: "n:" and the exact value of a number in
// canonical form, "s:" and the content of a string, "r:" and the raw text
// of anything else. It never goes through float64.
func IDKey(id json.RawMessage) string {
	if len(id) > 0 && id[0] == '"' && json.Valid(id) {
		s, _, _ := readString(id, 0)
		return "s:" + s
	}
	if n, ok := exactNumber(id); ok && json.Valid(id) {
		return "n:" + n
	}
	return "r:" + string(id)
}

// exactNumber writes a JSON number's exact value canonically, as
// [-]DIGITSeEXP with no leading or trailing zeros in DIGITS ("0" for zero).
func exactNumber(raw []byte) (string, bool) {
	s := string(raw)
	neg := false
	if strings.HasPrefix(s, "-") {
		neg, s = true, s[1:]
	}
	mant, expPart, hasExp := strings.Cut(strings.ToLower(s), "e")
	intPart, frac, _ := strings.Cut(mant, ".")
	if intPart == "" || !allDigits(intPart) || !allDigits(frac) || (len(intPart) > 1 && intPart[0] == '0') ||
		(strings.Contains(mant, ".") && frac == "") {
		return "", false
	}
	exp := int64(0)
	if hasExp {
		e, err := strconv.ParseInt(strings.TrimPrefix(expPart, "+"), 10, 64)
		if err != nil || !allDigits(strings.TrimLeft(expPart, "+-")) {
			return "", false
		}
		// Beyond this, adding the digit count could overflow; such ids
		// are keyed by their text.
		if e > 1<<60 || e < -(1<<60) {
			return "", false
		}
		exp = e
	}
	digits := strings.TrimLeft(intPart+frac, "0")
	exp -= int64(len(frac))
	if digits == "" {
		return "0", true
	}
	trimmed := strings.TrimRight(digits, "0")
	exp += int64(len(digits) - len(trimmed))
	out := trimmed + "e" + strconv.FormatInt(exp, 10)
	if neg {
		out = "-" + out
	}
	return out, true
}

func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
