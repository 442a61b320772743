package mcpmsg

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// Error is why a message is refused, with the JSON-RPC code to answer it.
// Nothing is forwarded for a message refused with an Error.
type Error struct {
	Code    int
	Message string
}

func (e *Error) Error() string { return e.Message }

// ErrorCode is the JSON-RPC code for an error returned by this package:
// CodeInvalidRequest unless the error says otherwise.
func ErrorCode(err error) int {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return CodeInvalidRequest
}

func invalidRequest(format string, args ...any) *Error {
	return &Error{Code: CodeInvalidRequest, Message: fmt.Sprintf(format, args...)}
}

func invalidParams(format string, args ...any) *Error {
	return &Error{Code: CodeInvalidParams, Message: fmt.Sprintf(format, args...)}
}

// Why decoding is strict: Go's encoding/json matches member names without
// regard to case (and to Unicode folds such as "ſ" for "s"), keeps the last
// of duplicate members and turns lone surrogates into U+FFFD, while servers
// read exact names. Had the proxy decoded a message differently from the
// server, two calls could share a key, or a reply carry an id the server
// never saw. So a member's name is read only when it is spelled exactly, an
// object whose members repeat a name or differ from a name read only in case
// is refused, and so is a string that is not I-JSON (RFC 7493).

// member is one member of a JSON object: its decoded name and raw value.
type member struct {
	name  string
	value json.RawMessage
}

// objectMembers returns the members of raw, a JSON value that Valid
// accepted, in order. where names the object in errors. It refuses an
// object whose member names repeat or are not I-JSON, and any member whose
// name equals one of known without regard to case but is not spelled
// exactly like it.
func objectMembers(raw []byte, where string, known ...string) ([]member, error) {
	i := skipSpace(raw, 0)
	if i >= len(raw) || raw[i] != '{' {
		return nil, fmt.Errorf("%s must be a JSON object, not %s", where, kindOf(raw))
	}
	// Room for the members known and a few more, in one allocation: most
	// objects read here have no more (a message's envelope, a call's
	// params), and growing from nil took four.
	ms := make([]member, 0, len(known)+2)
	var names nameIndex
	i = skipSpace(raw, i+1)
	if raw[i] == '}' {
		return ms, nil
	}
	for {
		name, end, ok := readString(raw, i)
		if !ok {
			return nil, fmt.Errorf("%s has a member name that is not I-JSON (a lone surrogate escape or invalid UTF-8): %s", where, raw[i:end])
		}
		dup := names.repeated(ms, name)
		if dup {
			return nil, fmt.Errorf("%s has the member %q twice; a message must be read one way only", where, name)
		}
		for _, k := range known {
			if name != k && strings.EqualFold(name, k) {
				return nil, fmt.Errorf("%s has a member %q, which differs from %q only in letter case; only the exact name %q is read", where, name, k, k)
			}
		}
		i = skipSpace(raw, end)
		i = skipSpace(raw, i+1) // ':'
		vend := skipValue(raw, i)
		ms = append(ms, member{name: name, value: raw[i:vend]})
		i = skipSpace(raw, vend)
		if raw[i] == '}' {
			return ms, nil
		}
		i = skipSpace(raw, i+1) // ','
	}
}

// nameIndex finds a repeated member name: by comparing names while the
// object is small, with a map once it is large, so that a hostile body
// with many members cannot make reading it quadratic.
type nameIndex struct {
	set map[string]struct{}
	// compared counts the names compared one by one: the work that would
	// grow with the square of the members without the map.
	compared int
}

// smallObject is how many members are compared one by one.
const smallObject = 16

// repeated reports whether name is among the names of ms, the members read
// before it.
func (x *nameIndex) repeated(ms []member, name string) bool {
	if x.set != nil {
		_, dup := x.set[name]
		x.set[name] = struct{}{}
		return dup
	}
	dup := false
	for _, m := range ms {
		x.compared++
		dup = dup || m.name == name
	}
	if len(ms) >= smallObject {
		x.set = make(map[string]struct{}, 2*len(ms))
		for _, m := range ms {
			x.set[m.name] = struct{}{}
		}
		x.set[name] = struct{}{}
	}
	return dup
}

// Member is one member of a JSON object: its name, decoded, and where its
// value is in the object's bytes.
type Member struct {
	Name       string
	Start, End int
}

// Members lists the members of obj, a JSON value that Valid accepted,
// in order, duplicates included; ok is false for anything that is not an
// object. It is the cheap, lenient reader for what the proxy only looks
// at (a server's response); names that are not I-JSON are decoded as
// readString does, so they never equal an ASCII name.
func Members(obj []byte) (ms []Member, ok bool) {
	ms, _, _, _, ok = scanObject(obj, "")
	return ms, ok
}

// MembersWithin is Members, which also lists the members of the value of
// the last member named name (inner, at offsets in that value), and
// reports whether that value is an object: a response's members and its
// result's, in one scan, where Members of each would scan a large result
// twice.
func MembersWithin(obj []byte, name string) (ms, inner []Member, innerObject, ok bool) {
	ms, inner, innerObject, _, ok = scanObject(obj, name)
	return ms, inner, innerObject, ok
}

// scanObject reads the object that obj starts with (after whitespace):
// its members, those of its last member named name ("": none) if that
// one's value is an object, and where the object ends.
func scanObject(obj []byte, name string) (ms, inner []Member, innerObject bool, end int, ok bool) {
	i := skipSpace(obj, 0)
	if i >= len(obj) || obj[i] != '{' {
		return nil, nil, false, 0, false
	}
	i = skipSpace(obj, i+1)
	if i < len(obj) && obj[i] == '}' {
		return nil, nil, false, i + 1, true
	}
	for i < len(obj) && obj[i] == '"' {
		n, nend, _ := readString(obj, i)
		i = skipSpace(obj, nend)
		i = skipSpace(obj, i+1) // ':'
		if i >= len(obj) {
			return nil, nil, false, 0, false
		}
		var vend int
		if name != "" && n == name {
			var vok bool
			if inner, _, _, vend, vok = scanObject(obj[i:], ""); vok {
				vend += i
				innerObject = true
			} else {
				inner, innerObject = nil, false
				vend = skipValue(obj, i)
			}
		} else {
			vend = skipValue(obj, i)
		}
		ms = append(ms, Member{Name: n, Start: i, End: vend})
		i = skipSpace(obj, vend)
		if i < len(obj) && obj[i] == '}' {
			return ms, inner, innerObject, i + 1, true
		}
		i = skipSpace(obj, i+1) // ','
	}
	return nil, nil, false, 0, false
}

func kindOf(raw []byte) string {
	i := skipSpace(raw, 0)
	if i >= len(raw) {
		return "nothing"
	}
	switch raw[i] {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	default:
		return "a number"
	}
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipValue returns the end of the value starting at b[i]; b is valid JSON.
func skipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				i = skipString(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return i
	default:
		for i < len(b) {
			switch b[i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return i
			}
			i++
		}
		return i
	}
}

// skipString returns the end of the string starting at b[i]. It finds
// quotes and backslashes with bytes.IndexByte, not a byte at a time: a
// 1 MiB result is skipped several times. A quote found is kept until the
// scan passes it, so a string of many escapes is still read once.
func skipString(b []byte, i int) int {
	i++
	q := -1 // the first quote at or after i, or len(b)
	for i < len(b) {
		if q < i {
			q = bytes.IndexByte(b[i:], '"')
			if q < 0 {
				q = len(b)
			} else {
				q += i
			}
		}
		k := bytes.IndexByte(b[i:q], '\\')
		if k < 0 {
			return min(q+1, len(b))
		}
		i += k + 2 // past the backslash and the byte it escapes
	}
	return i
}

// readString decodes the string starting at b[i] (b is valid JSON) and
// returns its end. ok is false when the string is not I-JSON: a lone
// surrogate escape or invalid UTF-8. Lone surrogates are then kept as their
// own three-byte sequences (WTF-8), so that two different strings never
// decode to the same one.
func readString(b []byte, i int) (s string, end int, ok bool) {
	end = skipString(b, i)
	body := b[i+1 : end-1]
	if bytes.IndexByte(body, '\\') < 0 {
		return string(body), end, utf8.Valid(body)
	}
	ok = true
	out := make([]byte, 0, len(body))
	for j := 0; j < len(body); {
		c := body[j]
		if c != '\\' {
			if c < utf8.RuneSelf {
				out = append(out, c)
				j++
				continue
			}
			r, n := utf8.DecodeRune(body[j:])
			if r == utf8.RuneError && n == 1 {
				ok = false
			}
			out = append(out, body[j:j+n]...)
			j += n
			continue
		}
		e := body[j+1]
		j += 2
		switch e {
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r := hex4(body[j:])
			j += 4
			if utf16.IsSurrogate(r) {
				if r < 0xDC00 && j+6 <= len(body) && body[j] == '\\' && body[j+1] == 'u' {
					if lo := hex4(body[j+2:]); lo >= 0xDC00 && lo <= 0xDFFF {
						out = utf8.AppendRune(out, utf16.DecodeRune(r, lo))
						j += 6
						continue
					}
				}
				ok = false
				out = append(out, 0xE0|byte(r>>12), 0x80|byte(r>>6)&0x3F, 0x80|byte(r)&0x3F)
				continue
			}
			out = utf8.AppendRune(out, r)
		default: // '"', '\\', '/'
			out = append(out, e)
		}
	}
	return string(out), end, ok
}

func hex4(b []byte) rune {
	var r rune
	for _, c := range b[:4] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		default:
			r = r<<4 | rune(c-'A'+10)
		}
	}
	return r
}

// stringValue decodes a member's value that must be an I-JSON string.
func stringValue(raw json.RawMessage, field string) (string, error) {
	if len(raw) == 0 || raw[0] != '"' {
		return "", fmt.Errorf("%s must be a string, not %s", field, kindOf(raw))
	}
	s, _, ok := readString(raw, 0)
	if !ok {
		return "", fmt.Errorf("%s is not an I-JSON string (it has a lone surrogate escape or invalid UTF-8): %s", field, raw)
	}
	return s, nil
}

// validID checks an id: an I-JSON string, a number, or null (which
// responses to unreadable requests carry).
func validID(id json.RawMessage, field string) error {
	if len(id) == 0 {
		return fmt.Errorf("%s is empty", field)
	}
	switch c := id[0]; {
	case c == '"':
		_, err := stringValue(id, field)
		return err
	case c == '-' || (c >= '0' && c <= '9'):
		return nil
	case c == 'n':
		return nil
	}
	return fmt.Errorf("%s must be a string or a number, not %s", field, kindOf(id))
}

// ToolCall is what the proxy reads of a tools/call request's params.
type ToolCall struct {
	Name      string
	Arguments json.RawMessage
	Meta      map[string]json.RawMessage
}

// ExplicitKeyMembers are the params._meta members that carry an explicit
// idempotency key.
var ExplicitKeyMembers = []string{"idemcp.io/idempotency-key", "idempotency-key", "idempotencyKey"}

// DecodeToolCall reads a tools/call request's params strictly: exact member
// names, no duplicate members in params or params._meta, and a tool name
// that is an I-JSON string. Its errors are CodeInvalidParams.
func DecodeToolCall(params json.RawMessage) (*ToolCall, error) {
	return decodeToolCall(params, false)
}

// decodeToolCall is DecodeToolCall; valid says params is part of a message
// Valid already accepted (Parse), so it is not scanned again.
func decodeToolCall(params json.RawMessage, valid bool) (*ToolCall, error) {
	if len(params) == 0 || string(params) == "null" {
		return nil, invalidParams("tools/call has no params; it needs params.name")
	}
	if !valid && !Valid(params) {
		return nil, invalidParams("tools/call params are not valid JSON")
	}
	ms, err := objectMembers(params, "tools/call params", "name", "arguments", "_meta")
	if err != nil {
		return nil, invalidParams("%v", err)
	}
	var tc ToolCall
	for _, m := range ms {
		switch m.name {
		case "name":
			if tc.Name, err = stringValue(m.value, "tools/call params.name"); err != nil {
				return nil, invalidParams("%v", err)
			}
		case "arguments":
			tc.Arguments = m.value
		case "_meta":
			if string(m.value) == "null" {
				continue
			}
			metas, err := objectMembers(m.value, "tools/call params._meta", ExplicitKeyMembers...)
			if err != nil {
				return nil, invalidParams("%v", err)
			}
			tc.Meta = make(map[string]json.RawMessage, len(metas))
			for _, mm := range metas {
				tc.Meta[mm.name] = mm.value
			}
		}
	}
	if tc.Name == "" {
		return nil, invalidParams("tools/call params.name is missing or empty: name the tool to call")
	}
	return &tc, nil
}

// CancelledRequestID returns params.requestId of a notifications/cancelled
// (nil if it has none), read strictly like every envelope member.
func CancelledRequestID(params json.RawMessage) (json.RawMessage, error) {
	if len(params) == 0 || string(params) == "null" {
		return nil, nil
	}
	if !Valid(params) {
		return nil, invalidParams("notifications/cancelled params are not valid JSON")
	}
	ms, err := objectMembers(params, "notifications/cancelled params", "requestId", "reason")
	if err != nil {
		return nil, invalidParams("%v", err)
	}
	for _, m := range ms {
		if m.name == "requestId" {
			if err := validID(m.value, "notifications/cancelled params.requestId"); err != nil {
				return nil, invalidParams("%v", err)
			}
			return m.value, nil
		}
	}
	return nil, nil
}

// arrayElements returns the raw elements of raw, a JSON array that
// Valid accepted.
func arrayElements(raw []byte, where string) ([]json.RawMessage, error) {
	i := skipSpace(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return nil, fmt.Errorf("%s must be a JSON array, not %s", where, kindOf(raw))
	}
	var out []json.RawMessage
	i = skipSpace(raw, i+1)
	if raw[i] == ']' {
		return out, nil
	}
	for {
		end := skipValue(raw, i)
		out = append(out, raw[i:end])
		i = skipSpace(raw, end)
		if raw[i] == ']' {
			return out, nil
		}
		i = skipSpace(raw, i+1)
	}
}

// IsResponseTo reports whether data is a response (a message without a
// method) to the request with id. A message that cannot be read one way
// only is nobody's response.
func IsResponseTo(data []byte, id json.RawMessage) bool {
	if len(data) == 0 || data[0] != '{' {
		return false
	}
	m, err := Parse(data)
	return err == nil && m.Method == "" && SameID(m.ID, id)
}

// Tool is what the proxy learns of a tool from tools/list: its
// readOnlyHint and idempotentHint, and whether the server gave each at
// all (a hint that is not true or false counts as not given).
type Tool struct {
	Name          string
	ReadOnly      bool
	Idempotent    bool
	HasReadOnly   bool
	HasIdempotent bool
}

// DecodeToolsList reads a tools/list result strictly. A tool entry that is
// ambiguous (a repeated or case-folded member, a name that is not I-JSON)
// is left out, so it stays unknown and is deduplicated; a result that is not
// a list of tools is an error.
func DecodeToolsList(result json.RawMessage) (tools []Tool, nextCursor string, err error) {
	if !Valid(result) {
		return nil, "", errors.New("tools/list result is not valid JSON")
	}
	ms, err := objectMembers(result, "tools/list result", "tools", "nextCursor")
	if err != nil {
		return nil, "", err
	}
	for _, m := range ms {
		switch m.name {
		case "nextCursor":
			if string(m.value) != "null" {
				if nextCursor, err = stringValue(m.value, "tools/list result.nextCursor"); err != nil {
					return nil, "", err
				}
			}
		case "tools":
			elems, err := arrayElements(m.value, "tools/list result.tools")
			if err != nil {
				return nil, "", err
			}
			for _, e := range elems {
				if t, ok := decodeTool(e); ok {
					tools = append(tools, t)
				}
			}
		}
	}
	return tools, nextCursor, nil
}

func decodeTool(raw json.RawMessage) (Tool, bool) {
	ms, err := objectMembers(raw, "tool", "name", "annotations")
	if err != nil {
		return Tool{}, false
	}
	var t Tool
	for _, m := range ms {
		switch m.name {
		case "name":
			if t.Name, err = stringValue(m.value, "tool name"); err != nil {
				return Tool{}, false
			}
		case "annotations":
			if string(m.value) == "null" {
				continue
			}
			as, err := objectMembers(m.value, "tool annotations", "readOnlyHint", "idempotentHint")
			if err != nil {
				return Tool{}, false
			}
			for _, a := range as {
				v := string(a.value)
				if v != "true" && v != "false" {
					continue
				}
				switch a.name {
				case "readOnlyHint":
					t.ReadOnly, t.HasReadOnly = v == "true", true
				case "idempotentHint":
					t.Idempotent, t.HasIdempotent = v == "true", true
				}
			}
		}
	}
	return t, t.Name != ""
}

// BatchElements returns the messages of a batch (a JSON array), or an
// error if body is not valid JSON or not an array.
func BatchElements(body []byte) ([]json.RawMessage, error) {
	if !Valid(body) {
		return nil, errors.New("batch is not valid JSON")
	}
	return arrayElements(body, "batch")
}

// LooseIDs returns the value of every top-level member of data whose name
// is "id" in any letter case, duplicates included: the ids a lenient
// reader might take from a message the strict decoder refused.
func LooseIDs(data []byte) []json.RawMessage {
	if !Valid(data) {
		return nil
	}
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		return nil
	}
	var ids []json.RawMessage
	i = skipSpace(data, i+1)
	if data[i] == '}' {
		return nil
	}
	for {
		name, end, _ := readString(data, i)
		i = skipSpace(data, skipSpace(data, end)+1)
		vend := skipValue(data, i)
		if strings.EqualFold(name, "id") {
			ids = append(ids, json.RawMessage(data[i:vend]))
		}
		i = skipSpace(data, vend)
		if data[i] == '}' {
			return ids
		}
		i = skipSpace(data, i+1)
	}
}

// idMemberExact reports whether data has a member named exactly "id".
func idMemberExact(data []byte) bool {
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		return false
	}
	i = skipSpace(data, i+1)
	if data[i] == '}' {
		return false
	}
	for {
		name, end, _ := readString(data, i)
		if name == "id" {
			return true
		}
		i = skipSpace(data, skipSpace(data, end)+1)
		i = skipSpace(data, skipValue(data, i))
		if data[i] == '}' {
			return false
		}
		i = skipSpace(data, i+1)
	}
}

// OtherTypeIDKey is the IDKey of the id a peer may have meant when it
// answered with the id in the other type: the string "1" for the number 1,
// the number 1 for the string "1". ok is false when there is none.
func OtherTypeIDKey(id json.RawMessage) (string, bool) {
	if len(id) == 0 {
		return "", false
	}
	if id[0] == '"' {
		s, _, ok := readString(id, 0)
		if !ok || !Valid([]byte(s)) {
			return "", false
		}
		if n, ok := exactNumber([]byte(s)); ok {
			return "n:" + n, true
		}
		return "", false
	}
	if _, ok := exactNumber(id); ok {
		return "s:" + string(id), true
	}
	return "", false
}

// ProtocolMeta returns the members of params._meta that the MCP spec
// reserves (names starting "io.modelcontextprotocol/"), as a JSON object,
// when one of them is the protocol version (2026-07-28 requests carry it
// there); nil otherwise.
func ProtocolMeta(params json.RawMessage) json.RawMessage {
	if len(params) == 0 || params[0] != '{' || !Valid(params) {
		return nil
	}
	ms, err := objectMembers(params, "params")
	if err != nil {
		return nil
	}
	for _, m := range ms {
		if m.name != "_meta" {
			continue
		}
		metas, err := objectMembers(m.value, "params._meta")
		if err != nil {
			return nil
		}
		out := map[string]json.RawMessage{}
		for _, mm := range metas {
			if strings.HasPrefix(mm.name, "io.modelcontextprotocol/") {
				out[mm.name] = mm.value
			}
		}
		if _, ok := out["io.modelcontextprotocol/protocolVersion"]; !ok {
			return nil
		}
		b, _ := json.Marshal(out)
		return b
	}
	return nil
}
