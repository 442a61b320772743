package engine

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/canonical"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/policy"
)

// MetaKeys are the params._meta members that carry an explicit idempotency
// key, in the order they are checked (after the Idempotency-Key header).
var MetaKeys = mcpmsg.ExplicitKeyMembers

// MaxKeyLength is the longest explicit key accepted.
const MaxKeyLength = 255

// ToolCall is the part of a tools/call request the engine reads. Everything
// else in params (_meta, task, inputResponses, requestState) is neither part
// of the key nor of the fingerprint.
type ToolCall = mcpmsg.ToolCall

// ParseToolCall decodes the params of a tools/call request strictly, with
// the decoder every transport uses (mcpmsg.DecodeToolCall): exact member
// names, no duplicates, an I-JSON tool name.
func ParseToolCall(params json.RawMessage) (*ToolCall, error) {
	tc, err := mcpmsg.DecodeToolCall(params)
	if err != nil {
		return nil, invalidParams(err.Error())
	}
	return tc, nil
}

// CallOf returns the tool call of a tools/call message, as mcpmsg.Parse
// already decoded it (or decoding it now for a message built otherwise).
func CallOf(msg *mcpmsg.Message) (*ToolCall, error) {
	if msg.Call != nil {
		return msg.Call, nil
	}
	return ParseToolCall(msg.Params)
}

// Caller is who sent a call, as the transport saw it.
type Caller struct {
	// HeaderKey is the Idempotency-Key header, if the transport has headers.
	HeaderKey    string
	HasHeaderKey bool
	// Principal is the raw value of the policy's principal header.
	Principal string
	// Session is the Mcp-Session-Id, or a run id for stdio; "" when the
	// server is stateless.
	Session string
	// Listing is where the caller stands for the tools the server lists
	// (nil: the sidecar's own listing only).
	Listing *ListingContext
	// Local marks the one user of a local stdio wrapper: with no principal,
	// its explicit keys are still its own across runs (and machines sharing
	// a Redis), as `idemcp wrap` documents. A network caller with no
	// principal never has that: its explicit keys are its session's.
	Local bool
}

// ExplicitKey returns the caller's explicit key, checked in the documented
// order, or "" when there is none.
func ExplicitKey(c Caller, meta map[string]json.RawMessage) (string, error) {
	if c.HasHeaderKey {
		return c.HeaderKey, validateKey("the Idempotency-Key header", c.HeaderKey)
	}
	for _, name := range MetaKeys {
		raw, ok := meta[name]
		if !ok {
			continue
		}
		field := fmt.Sprintf("params._meta[%q]", name)
		var k string
		if err := json.Unmarshal(raw, &k); err != nil {
			return "", invalidParams(fmt.Sprintf("%s must be a string of 1-%d printable ASCII characters, not %s", field, MaxKeyLength, raw))
		}
		return k, validateKey(field, k)
	}
	return "", nil
}

func validateKey(field, k string) error {
	if len(k) == 0 || len(k) > MaxKeyLength {
		return invalidParams(fmt.Sprintf("%s is %d characters long; an idempotency key has 1-%d printable ASCII characters", field, len(k), MaxKeyLength))
	}
	for i := 0; i < len(k); i++ {
		if k[i] < 0x20 || k[i] > 0x7e {
			return invalidParams(fmt.Sprintf("%s has a byte 0x%02x at position %d; an idempotency key has only printable ASCII characters (0x20-0x7e)", field, k[i], i))
		}
	}
	return nil
}

func invalidParams(msg string) *Error {
	return &Error{Code: mcpmsg.CodeInvalidParams, Message: msg}
}

// Fingerprint hashes a tool name and the canonical form of its arguments
// with the rule's ignored pointers removed. Absent and null arguments are
// the empty object.
func Fingerprint(tool string, args json.RawMessage, ignore []canonical.Pointer) (string, error) {
	// One buffer, hashed at once: tool, a NUL, the canonical arguments.
	buf := make([]byte, 0, len(tool)+1+max(len(args), 2))
	buf = append(append(buf, tool...), 0)
	if len(args) == 0 || string(args) == "null" {
		buf = append(buf, "{}"...)
	} else {
		v, err := canonical.DecodeShared(args) // hashed before this returns
		if err != nil {
			return "", invalidParams(fmt.Sprintf("tools/call params.arguments is not valid JSON: %v", err))
		}
		for _, p := range ignore {
			v = p.Remove(v)
		}
		if v == nil {
			v = map[string]any{} // null however it is spaced: no arguments, as when absent
		}
		if buf, err = canonical.Append(buf, v); err != nil {
			return "", invalidParams(fmt.Sprintf("tools/call params.arguments: %v", err))
		}
	}
	return hexSum(buf), nil
}

// hexSum is the hex sha256 of b.
func hexSum(b []byte) string {
	sum := sha256.Sum256(b)
	var out [2 * sha256.Size]byte
	hex.Encode(out[:], sum[:])
	return string(out[:])
}

// explicitScope says what an explicit key is scoped to: the caller's
// principal; without one, its session (another anonymous caller using the
// same key runs its own call and never sees this result); with neither,
// nothing, and the call is unscoped. Under keyScope: Global, chosen
// knowingly, and for a local wrapper's user, anonymous callers share keys.
func explicitScope(rule *policy.Rule, c Caller) (scope string, ok bool) {
	switch {
	case c.Principal != "" || c.Local || rule.KeyScope == v1alpha1.ScopeGlobal:
		principal := sha256.Sum256([]byte(c.Principal))
		return "explicit\x00" + string(principal[:]), true
	case c.Session != "":
		return "explicit-session\x00" + c.Session, true
	}
	return "", false
}

// deriveKey returns the store key for a call: only hashes, never the raw
// arguments or the raw explicit key. An explicit key must have a scope
// (Plan checks explicitScope first).
func deriveKey(keySpace string, rule *policy.Rule, c Caller, explicit, fingerprint string) string {
	h := make([]byte, 0, 256)
	if keySpace != "" {
		// One key space per MCP server: two workloads under one policy
		// never share a key. Without one, the key is as it always was.
		h = append(h, "space\x00"...)
		h = append(h, keySpace...)
		h = append(h, 0)
	}
	if explicit != "" {
		// Explicit keys are always the caller's own: another principal
		// (or, for anonymous callers, another session) using the same key
		// runs anew and never sees this result.
		scope, _ := explicitScope(rule, c)
		h = append(h, scope...)
		h = append(h, 0)
		h = append(h, explicit...)
		return hexSum(h)
	}
	principal := sha256.Sum256([]byte(c.Principal))
	switch rule.KeyScope {
	case v1alpha1.ScopeGlobal:
		h = append(h, "global\x00"...)
	case v1alpha1.ScopePrincipal:
		h = append(h, "principal\x00"...)
		h = append(h, principal[:]...)
	default:
		if c.Session == "" {
			// A stateless server has no sessions: the principal alone.
			h = append(h, "principal\x00"...)
			h = append(h, principal[:]...)
		} else {
			h = append(h, "session\x00"...)
			h = append(h, principal[:]...)
			h = append(h, 0)
			h = append(h, c.Session...)
		}
	}
	h = append(h, 0)
	h = append(h, fingerprint...)
	return hexSum(h)
}
