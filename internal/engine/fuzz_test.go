package engine

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/idemcp/idemcp/internal/canonical"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store"
)

// FuzzReplayable: whatever an upstream sends as result, with whatever id,
// deciding what to store never panics, and what is stored replays as valid
// JSON with the caller's id, marked in _meta where _meta can hold the mark.
func FuzzReplayable(f *testing.F) {
	for _, seed := range []struct{ result, id string }{
		{`null`, `1`}, {`[]`, `"a"`}, {`"x"`, `9007199254740993`}, {`5`, `-1.5e3`}, {`true`, `0`},
		{`{}`, `1`}, {`{"_meta":null}`, `1`}, {`{"_meta":5}`, `1`}, {`{"_meta":{"idemcp.io/replayed":false}}`, `1`},
		{`{"_meta":{},"_meta":null}`, `1`}, {`{"isError":true}`, `1`}, {`{"resultType":"input_required"}`, `1`},
		{`{"task":{"taskId":"t","status":"working"}}`, `"t"`}, {` { "a" : [ 1 , {"_meta":1} ] } `, `1`},
		{`{"text":"<\u2028>\ud800"}`, `1`}, {`{`, `1`}, {``, ``},
	} {
		f.Add(seed.result, seed.id)
	}
	e := New(Options{Policy: mustPolicy(f, "spec: {defaultMode: Deduplicate}"), Store: store.NewMemory(0)})
	tc, _ := ParseToolCall(json.RawMessage(`{"name":"t"}`))
	p, _ := e.Plan(tc, alice)
	f.Fuzz(func(t *testing.T, result, id string) {
		resp := []byte(`{"jsonrpc":"2.0","id":` + id + `,"result":` + result + `}`)
		stored, reason := e.replayable(p, resp)
		if stored == nil {
			return
		}
		if reason != "" {
			if reason != ReasonTooLarge {
				t.Fatalf("stored %s with reason %s", stored, reason)
			}
			return
		}
		_, body := taskSession(stored)
		if !json.Valid([]byte(id)) || !json.Valid(resp) {
			return // the response was stored as it came; only valid JSON has a meaning to check
		}
		replay := mcpmsg.WithID(body, json.RawMessage(id))
		if !json.Valid(replay) {
			t.Fatalf("replay %s of %s is not JSON", replay, resp)
		}
		var got, orig struct{ Result json.RawMessage }
		_ = json.Unmarshal(replay, &got)
		_ = json.Unmarshal(resp, &orig)
		var obj map[string]json.RawMessage
		if r := bytes.TrimSpace(orig.Result); len(r) == 0 || r[0] != '{' || json.Unmarshal(r, &obj) != nil {
			if !bytes.Equal(bytes.TrimSpace(got.Result), bytes.TrimSpace(orig.Result)) {
				t.Fatalf("a result that is not an object changed: %s became %s", orig.Result, got.Result)
			}
			return
		}
		var out map[string]json.RawMessage
		if err := json.Unmarshal(got.Result, &out); err != nil {
			t.Fatalf("replayed result %s is not an object: %v", got.Result, err)
		}
		meta, had := obj["_meta"]
		trimmed := bytes.TrimSpace(meta)
		if had && string(trimmed) != "null" && (len(trimmed) == 0 || trimmed[0] != '{') {
			if !bytes.Equal(bytes.TrimSpace(out["_meta"]), trimmed) {
				t.Fatalf("a _meta that is not an object changed: %s became %s", meta, out["_meta"])
			}
			return
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(out["_meta"], &m); err != nil || string(m[ReplayedMeta]) != "true" {
			t.Fatalf("replay %s is not marked in _meta", replay)
		}
	})
}

// FuzzFingerprint: equal canonical values give equal fingerprints and
// keys, however they are written; different ones give different keys; no
// input panics.
func FuzzFingerprint(f *testing.F) {
	for _, seed := range [][2]string{
		{`{"a":1,"b":[1,2]}`, `{"b":[1.0,2],"a":1}`},
		{`{"a":1}`, `{"a":2}`},
		{`{"n":9007199254740993}`, `{"n":9007199254740992}`},
		{`{"s":"\u00e9"}`, `{"s":"é"}`},
		{`{"x":1e999}`, `{}`},
		{`{"a":1,"a":2}`, `{"a":2}`},
		{`null`, `{}`},
		{"null ", "\tnull"},
		{`[1,2]`, `[2,1]`},
		{`"\ud800"`, `"x"`},
	} {
		f.Add("t", seed[0], seed[1])
	}
	f.Fuzz(func(t *testing.T, tool, a, b string) {
		fa, errA := Fingerprint(tool, json.RawMessage(a), nil)
		fb, errB := Fingerprint(tool, json.RawMessage(b), nil)
		if errA != nil || errB != nil {
			return
		}
		ca, cb := canon(a), canon(b)
		if (ca == cb) != (fa == fb) {
			t.Fatalf("canonical forms %q and %q equal = %v, but fingerprints equal = %v", ca, cb, ca == cb, fa == fb)
		}
		// Rewriting a value (reordered members, other whitespace) keeps its key.
		var v any
		dec := json.NewDecoder(bytes.NewReader([]byte(a)))
		dec.UseNumber()
		if dec.Decode(&v) == nil {
			if re, err := json.Marshal(v); err == nil {
				if fr, err := Fingerprint(tool, re, nil); err == nil && fr != fa {
					t.Fatalf("%s rewritten as %s changed its fingerprint", a, re)
				}
			}
		}
		rule := mustPolicy(t, "spec: {defaultMode: Deduplicate}").RuleFor(tool)
		if (deriveKey("", rule, alice, "", fa) == deriveKey("", rule, alice, "", fb)) != (fa == fb) {
			t.Fatal("derived keys do not follow fingerprints")
		}
		if deriveKey("", rule, alice, "", fa) == deriveKey("", rule, Caller{Principal: "Bearer bob"}, "", fa) {
			t.Fatal("two principals share a derived key")
		}
		if other, err := Fingerprint(tool+"x", json.RawMessage(a), nil); err == nil && other == fa {
			t.Fatal("two tools share a fingerprint")
		}
	})
}

func canon(s string) string {
	if s == "" || s == "null" {
		return "{}"
	}
	v, err := canonical.Decode([]byte(s))
	if err != nil {
		return "error"
	}
	if v == nil {
		return "{}"
	}
	out, err := canonical.Append(nil, v)
	if err != nil {
		return "error"
	}
	return string(out)
}
