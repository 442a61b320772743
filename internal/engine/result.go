package engine

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"

	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// ReplayedMeta is the result._meta member set on every replayed response
// whose result is an object.
const ReplayedMeta = "idemcp.io/replayed"

// replayable returns what to store for a response, or why it is not kept.
// What is stored is the response without its id and with
// result._meta["idemcp.io/replayed"] set, so a replay only splices an id in.
// A result that is not an object (null, an array, a string, a number, a
// boolean: no conforming server sends one, but some do) is stored as it is:
// there is nowhere to put the marker, and the HTTP header still marks the
// replay. Member names are matched exactly, as the client reads them.
func (e *Engine) replayable(p *Plan, resp []byte) ([]byte, string) {
	return e.replayableChecked(p, resp, false)
}

// replayableChecked is replayable of a response the transport has already
// checked is JSON when valid is true.
func (e *Engine) replayableChecked(p *Plan, resp []byte, valid bool) ([]byte, string) {
	if !valid && !mcpmsg.Valid(resp) {
		return nil, ReasonTransport
	}
	// The response's members and its result's, in one scan.
	top, members, isObject, ok := mcpmsg.MembersWithin(resp, "result")
	if !ok {
		return nil, ReasonTransport
	}
	var result, rpcErr []byte
	for _, mb := range top { // the last of duplicates, as a client reads them
		switch mb.Name {
		case "result":
			result = resp[mb.Start:mb.End]
		case "error":
			rpcErr = resp[mb.Start:mb.End]
		}
	}
	if rpcErr != nil && string(rpcErr) != "null" {
		return nil, ReasonRPCError
	}
	if result == nil {
		return nil, ReasonTransport
	}
	var task bool
	if isObject {
		for _, mb := range members {
			v := result[mb.Start:mb.End]
			switch mb.Name {
			case "resultType":
				if string(v) == `"input_required"` {
					return nil, ReasonInputRequired
				}
			case "isError":
				if string(v) == "true" && !p.Rule.CacheToolErrors {
					return nil, ReasonToolError
				}
			case "task":
				task = isTask(v)
			}
		}
	}
	if int64(len(resp)) > p.Policy.MaxResultBytes {
		// Keep a marker, not the result: a retry learns the call ran
		// instead of running it a second time.
		return tooLargeMarker(p, len(resp)), ReasonTooLarge
	}
	// The marker is spliced in as the response is copied: one copy of a
	// large result, not two.
	from, to, marker := len(result), len(result), ""
	if isObject {
		if f, t, m, ok := metaEdit(result, members, ReplayedMeta, "true"); ok {
			from, to, marker = f, t, m
		}
	}
	out := make([]byte, 0, len(result)-(to-from)+len(marker)+len(taskSessionPrefix)+96)
	out = append(out, `{"jsonrpc":"2.0",`...)
	if task {
		// A task lives in the session that created it (the reference
		// server keeps tasks per session): remember which one.
		out = append(out, taskSessionPrefix[len(`{"jsonrpc":"2.0",`):]...)
		out = append(out, sessionHash(p.caller)...)
		out = append(out, `",`...)
	}
	out = append(out, `"result":`...)
	out = append(out, result[:from]...)
	out = append(out, marker...)
	out = append(out, result[to:]...)
	return append(out, '}'), ""
}

// isTask reports a CreateTaskResult's task: an object with a taskId.
func isTask(v []byte) bool {
	ms, ok := objectMembers(v)
	for _, m := range ms {
		if m.Name == "taskId" {
			return ok
		}
	}
	return false
}

// taskSessionPrefix starts a stored CreateTaskResult: the hash of the
// session that created the task follows, then the response. The member is
// removed before a replay leaves the engine.
const taskSessionPrefix = `{"jsonrpc":"2.0","idemcp.io/task-session":"`

// sessionHash names a caller's session in a stored record without
// revealing it.
func sessionHash(c Caller) string {
	h := sha256.Sum256([]byte(c.Principal + "\x00" + c.Session))
	return hex.EncodeToString(h[:16])
}

// taskSession splits a stored response into the session its task belongs
// to ("" for a response that created no task) and the response to replay.
func taskSession(stored []byte) (session string, resp []byte) {
	rest, ok := bytes.CutPrefix(stored, []byte(taskSessionPrefix))
	if !ok {
		return "", stored
	}
	session, rest, ok = cutString(rest)
	if !ok || len(rest) == 0 || rest[0] != ',' {
		return "", stored
	}
	out := make([]byte, 0, len(rest)+16)
	out = append(out, `{"jsonrpc":"2.0",`...)
	return session, append(out, rest[1:]...)
}

func cutString(b []byte) (string, []byte, bool) {
	i := bytes.IndexByte(b, '"')
	if i < 0 {
		return "", nil, false
	}
	return string(b[:i]), b[i+1:], true
}

// member is one member of a JSON object: its name and where its value is.
type member = mcpmsg.Member

// objectMembers lists the members of a JSON object (valid JSON) in order,
// with the byte span of each value; ok is false for anything that is not
// an object.
func objectMembers(obj []byte) (members []member, ok bool) {
	return mcpmsg.Members(bytes.TrimLeft(obj, " \t\r\n"))
}

// setMeta returns the result object with _meta[name] set to the JSON
// value raw, every other byte as the server sent it. A missing or null
// _meta becomes an object holding the marker; a _meta that is neither an
// object nor null is the server's own business and is left alone,
// unmarked.
func setMeta(result []byte, members []member, name, raw string) []byte {
	result = bytes.TrimLeft(result, " \t\r\n")
	from, to, s, ok := metaEdit(result, members, name, raw)
	if !ok {
		return result
	}
	return splice(result, from, to, s)
}

// metaEdit is setMeta as an edit of result (its leading space trimmed):
// result[from:to] becomes s; ok is false for a result left alone.
func metaEdit(result []byte, members []member, name, raw string) (from, to int, s string, ok bool) {
	marker := `"` + name + `":` + raw
	meta := -1
	for i, mb := range members {
		if mb.Name == "_meta" {
			meta = i // the last one is what a client reads
		}
	}
	if meta < 0 {
		sep := ""
		if len(members) > 0 {
			sep = ","
		}
		return 1, 1, `"_meta":{` + marker + `}` + sep, true
	}
	mb := members[meta]
	v := result[mb.Start:mb.End]
	switch {
	case string(v) == "null":
		return mb.Start, mb.End, `{` + marker + `}`, true
	case v[0] == '{':
		inner, isObj := objectMembers(v)
		if !isObj {
			return 0, 0, "", false
		}
		for i := len(inner) - 1; i >= 0; i-- {
			if inner[i].Name == name {
				return mb.Start + inner[i].Start, mb.Start + inner[i].End, raw, true
			}
		}
		sep := ""
		if len(inner) > 0 {
			sep = ","
		}
		return mb.Start + 1, mb.Start + 1, marker + sep, true
	}
	return 0, 0, "", false
}

// splice returns b with b[from:to] replaced by s, in a new slice.
func splice(b []byte, from, to int, s string) []byte {
	out := make([]byte, 0, len(b)-(to-from)+len(s))
	out = append(out, b[:from]...)
	out = append(out, s...)
	return append(out, b[to:]...)
}
