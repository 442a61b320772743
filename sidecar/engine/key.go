package engine

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/sidecar/canonical"
	"github.com/idemcp/idemcp/sidecar/mcpmsg"
	"github.com/idemcp/idemcp/sidecar/policy"
)

// MetaKeys are the params._meta members that carry an explicit idempotency
// key, in the order they are checked (after the Idempotency-Key header).
var MetaKeys = []string{"idemcp.io/idempotency-key", "idempotency-key", "idempotencyKey"}

// MaxKeyLength is the longest explicit key accepted.
const MaxKeyLength = 255

// ToolCall is the part of a tools/call request the engine reads. Everything
// else in params (_meta, task, inputResponses, requestState) is neither part
// of the key nor of the fingerprint.
type ToolCall struct {
	Name      string                     `json:"name"`
	Arguments json.RawMessage            `json:"arguments,omitempty"`
	Meta      map[string]json.RawMessage `json:"_meta,omitempty"`
}

// ParseToolCall decodes the params of a tools/call request.
func ParseToolCall(params json.RawMessage) (*ToolCall, error) {
	var tc ToolCall
	if len(params) == 0 {
		return nil, invalidParams("tools/call has no params; it needs params.name")
	}
	if err := json.Unmarshal(params, &tc); err != nil {
		return nil, invalidParams(fmt.Sprintf("tools/call params are not an object with a string name: %v", err))
	}
	if tc.Name == "" {
		return nil, invalidParams("tools/call params.name is missing or empty: name the tool to call")
	}
	return &tc, nil
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
	h := sha256.New()
	h.Write([]byte(tool))
	h.Write([]byte{0})
	var canon []byte
	if len(args) == 0 || string(args) == "null" {
		canon = []byte("{}")
	} else {
		v, err := canonical.Decode(args)
		if err != nil {
			return "", invalidParams(fmt.Sprintf("tools/call params.arguments is not valid JSON: %v", err))
		}
		for _, p := range ignore {
			v = p.Remove(v)
		}
		if canon, err = canonical.Append(make([]byte, 0, len(args)), v); err != nil {
			return "", invalidParams(fmt.Sprintf("tools/call params.arguments: %v", err))
		}
	}
	h.Write(canon)
	return hex.EncodeToString(h.Sum(nil)), nil
}

// deriveKey returns the store key for a call: only hashes, never the raw
// arguments or the raw explicit key.
func deriveKey(rule *policy.Rule, c Caller, explicit, fingerprint string) string {
	principal := sha256.Sum256([]byte(c.Principal))
	h := sha256.New()
	if explicit != "" {
		// Explicit keys are always the caller's own: another principal
		// using the same key runs anew and never sees this result.
		h.Write([]byte("explicit\x00"))
		h.Write(principal[:])
		h.Write([]byte{0})
		h.Write([]byte(explicit))
		return hex.EncodeToString(h.Sum(nil))
	}
	switch rule.KeyScope {
	case v1alpha1.ScopeGlobal:
		h.Write([]byte("global\x00"))
	case v1alpha1.ScopePrincipal:
		h.Write([]byte("principal\x00"))
		h.Write(principal[:])
	default:
		if c.Session == "" {
			// A stateless server has no sessions: the principal alone.
			h.Write([]byte("principal\x00"))
			h.Write(principal[:])
		} else {
			h.Write([]byte("session\x00"))
			h.Write(principal[:])
			h.Write([]byte{0})
			h.Write([]byte(c.Session))
		}
	}
	h.Write([]byte{0})
	h.Write([]byte(fingerprint))
	return hex.EncodeToString(h.Sum(nil))
}
