package mcpmsg

import (
	"bytes"
	"encoding/json"
	"math/big"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/idemcp/idemcp/internal/canonical"
)

// folds returns every spelling of name that encoding/json would match to
// it (each letter in either case, and the Unicode folds ſ for s and the
// Kelvin sign for k), except name itself.
func folds(name string) []string {
	out := []string{""}
	for _, r := range name {
		alts := []rune{r}
		if unicode.IsLetter(r) {
			alts = []rune{unicode.ToLower(r), unicode.ToUpper(r)}
			switch unicode.ToLower(r) {
			case 's':
				alts = append(alts, 'ſ')
			case 'k':
				alts = append(alts, 'K')
			}
		}
		var next []string
		for _, prefix := range out {
			for _, a := range alts {
				next = append(next, prefix+string(a))
			}
		}
		out = next
	}
	var res []string
	for _, s := range out {
		if s != name {
			res = append(res, s)
		}
	}
	return res
}

// TestFoldedMembersAreRefused: a member whose name differs from an envelope
// member's only in case is refused, whether it stands beside the exact
// member or instead of it, at every level the proxy reads: the server reads
// exact names, so the proxy must not read the message another way.
func TestFoldedMembersAreRefused(t *testing.T) {
	top := func(member, value string) func(n, v string, keep bool) string {
		return func(n, v string, keep bool) string {
			members := map[string]string{"jsonrpc": `"2.0"`, "id": `1`, "method": `"tools/call"`, "params": `{"name":"charge","arguments":{"a":1}}`}
			if member == "result" || member == "error" {
				members = map[string]string{"jsonrpc": `"2.0"`, "id": `1`, "result": `{}`}
			}
			var b strings.Builder
			b.WriteString("{")
			first := true
			for _, k := range []string{"jsonrpc", "id", "method", "params", "result"} {
				val, ok := members[k]
				if !ok || (k == member && !keep) {
					continue
				}
				if !first {
					b.WriteString(",")
				}
				first = false
				b.WriteString(`"` + k + `":` + val)
			}
			b.WriteString(`,"` + n + `":` + v + "}")
			return b.String()
		}
	}
	params := func(n, v string, keep bool) string {
		p := `"name":"charge","arguments":{"a":1},"_meta":{"progressToken":1}`
		if keep {
			return `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{` + p + `,"` + n + `":` + v + `}}`
		}
		return `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge",` + `"` + n + `":` + v + `}}`
	}
	meta := func(n, v string, keep bool) string {
		m := ""
		if keep {
			m = `"idempotencyKey":"k1",`
		}
		return `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","_meta":{` + m + `"` + n + `":` + v + `}}}`
	}
	cancel := func(n, v string, keep bool) string {
		m := ""
		if keep {
			m = `"requestId":7,`
		}
		return `{"jsonrpc":"2.0","method":"notifications/cancelled","params":{` + m + `"` + n + `":` + v + `}}`
	}
	places := []struct {
		member, value string
		code          int
		build         func(n, v string, keep bool) string
	}{
		{"jsonrpc", `"2.0"`, CodeInvalidRequest, top("jsonrpc", "")},
		{"id", `2`, CodeInvalidRequest, top("id", "")},
		{"method", `"tools/list"`, CodeInvalidRequest, top("method", "")},
		{"params", `{"name":"other"}`, CodeInvalidRequest, top("params", "")},
		{"result", `{"x":1}`, CodeInvalidRequest, top("result", "")},
		{"error", `{"code":1,"message":"m"}`, CodeInvalidRequest, top("error", "")},
		{"name", `"other"`, CodeInvalidParams, params},
		{"arguments", `{"a":2}`, CodeInvalidParams, params},
		{"_meta", `{"idempotencyKey":"k2"}`, CodeInvalidParams, params},
		{"idempotencyKey", `"k2"`, CodeInvalidParams, meta},
		{"idempotency-key", `"k2"`, CodeInvalidParams, meta},
		{"requestId", `8`, CodeInvalidParams, cancel},
	}
	n := 0
	for _, p := range places {
		for _, f := range folds(p.member) {
			for _, keep := range []bool{true, false} {
				body := p.build(f, p.value, keep)
				if !json.Valid([]byte(body)) {
					t.Fatalf("test bug: %s", body)
				}
				_, err := Parse([]byte(body))
				if err == nil || ErrorCode(err) != p.code || !strings.Contains(err.Error(), "only in letter case") {
					t.Fatalf("Parse(%s) = %v (code %d), want code %d for the alias %q of %q", body, err, ErrorCode(err), p.code, f, p.member)
				}
				n++
			}
		}
	}
	t.Logf("%d aliased messages refused", n)
}

func TestDuplicateMembersAreRefused(t *testing.T) {
	for _, tt := range []struct {
		body string
		code int
	}{
		{`{"jsonrpc":"2.0","jsonrpc":"2.0","id":1,"method":"ping"}`, CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":1,"id":2,"method":"ping"}`, CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":1,"method":"ping","method":"tools/call"}`, CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a"},"params":{"name":"b"}}`, CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":1,"result":{},"result":{}}`, CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":1,"error":{},"error":{}}`, CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":1,"\u006d\u0065thod":"tools/call","method":"ping"}`, CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","name":"b"}}`, CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","arguments":{},"arguments":{"x":1}}}`, CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","_meta":{},"_meta":{}}}`, CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","_meta":{"idempotencyKey":"1","idempotencyKey":"2"}}}`, CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","x":1,"x":2}}`, CodeInvalidParams},
		{`{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1,"requestId":2}}`, CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":1,"method":"ping","extra":1,"extra":2}`, CodeInvalidRequest},
	} {
		_, err := Parse([]byte(tt.body))
		if err == nil || ErrorCode(err) != tt.code || !strings.Contains(err.Error(), "twice") {
			t.Errorf("Parse(%s) = %v, want code %d naming the repeated member", tt.body, err, tt.code)
		}
	}
}

func TestStringsMustBeIJSON(t *testing.T) {
	for _, tt := range []struct {
		body string
		code int
	}{
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"ls\ud800"}}`, CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"ls\udbff"}}`, CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"ls\udc00\ud800"}}`, CodeInvalidParams},
		{"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"ls\xff\"}}", CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":"\ud800","method":"ping"}`, CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call\ud800"}`, CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":1,"method":"ping","\ud800":1}`, CodeInvalidRequest},
		{`{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"\udfff"}}`, CodeInvalidParams},
	} {
		_, err := Parse([]byte(tt.body))
		if err == nil || ErrorCode(err) != tt.code || !strings.Contains(err.Error(), "I-JSON") {
			t.Errorf("Parse(%q) = %v, want code %d saying it is not I-JSON", tt.body, err, tt.code)
		}
	}
	// A valid pair is one character, and escapes decode exactly.
	m, err := Parse([]byte(`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"ls\ud83d\ude00\u00e9\n"}}`))
	if err != nil {
		t.Fatal(err)
	}
	tc, err := DecodeToolCall(m.Params)
	if err != nil || tc.Name != "ls😀é\n" {
		t.Errorf("tool name = %q, %v", tc.Name, err)
	}
	if IDKey(json.RawMessage(`"ls\ud800"`)) == IDKey(json.RawMessage(`"ls\udbff"`)) {
		t.Error(`IDKey collapses the lone surrogates \ud800 and \udbff`)
	}
}

func TestNotAnObjectIsInvalidRequest(t *testing.T) {
	for body, code := range map[string]int{
		`5`: CodeInvalidRequest, `"x"`: CodeInvalidRequest, `true`: CodeInvalidRequest, `null`: CodeInvalidRequest,
		`charge my card`: CodeParseError, `{"a":`: CodeParseError, ``: CodeParseError, `5 5`: CodeParseError,
	} {
		_, err := Sniff([]byte(body))
		if strings.HasPrefix(body, "{") {
			_, err = Parse([]byte(body))
		}
		if err == nil || ErrorCode(err) != code {
			t.Errorf("%q: %v (code %d), want code %d", body, err, ErrorCode(err), code)
		}
	}
}

func TestIDKeyExact(t *testing.T) {
	same := [][2]string{
		{`1`, `1.0`}, {`1`, `1e0`}, {`100`, `1e2`}, {`0.5`, `5e-1`}, {`0`, `-0`}, {`0`, `0.000e5`},
		{`9007199254740993`, `9007199254740993.0`}, {`"a"`, `"\u0061"`}, {`"\ud83d\ude00"`, `"😀"`},
	}
	differ := [][2]string{
		{`9007199254740992`, `9007199254740993`}, {`1`, `"1"`}, {`1e400`, `1e401`},
		{`12345678901234567890123`, `12345678901234567890124`}, {`0.1`, `0.10000000000000001`},
		{`"ls\ud800"`, `"ls\udbff"`}, {`-1`, `1`},
	}
	for _, p := range same {
		if !SameID(json.RawMessage(p[0]), json.RawMessage(p[1])) || IDKey(json.RawMessage(p[0])) != IDKey(json.RawMessage(p[1])) {
			t.Errorf("%s and %s are one id", p[0], p[1])
		}
	}
	for _, p := range differ {
		if SameID(json.RawMessage(p[0]), json.RawMessage(p[1])) || IDKey(json.RawMessage(p[0])) == IDKey(json.RawMessage(p[1])) {
			t.Errorf("%s and %s are different ids", p[0], p[1])
		}
	}
}

func TestDecodeToolsListStrict(t *testing.T) {
	tools, next, err := DecodeToolsList(json.RawMessage(`{"tools":[
		{"name":"read","annotations":{"readOnlyHint":true}},
		{"name":"write","annotations":{"readOnlyHint":true,"ReadOnlyHint":false}},
		{"name":"dup","name":"other","annotations":{"readOnlyHint":true}},
		{"name":"plain"}],"nextCursor":"c2"}`))
	if err != nil || next != "c2" {
		t.Fatalf("DecodeToolsList: %v, next %q", err, next)
	}
	got := map[string]bool{}
	for _, tl := range tools {
		got[tl.Name] = tl.ReadOnly
	}
	if len(got) != 2 || !got["read"] || got["plain"] {
		t.Errorf("learned %v, want read (read-only) and plain only: ambiguous entries teach nothing", got)
	}
}

// TestDecodeToolsListHints: both hints the engine reads, and whether the
// server gave them; a hint that is not a boolean is not given.
func TestDecodeToolsListHints(t *testing.T) {
	tools, _, err := DecodeToolsList(json.RawMessage(`{"tools":[
		{"name":"write","annotations":{"readOnlyHint":false,"idempotentHint":true,"destructiveHint":true}},
		{"name":"read","annotations":{"readOnlyHint":true}},
		{"name":"titled","annotations":{"title":"Titled"}},
		{"name":"odd","annotations":{"idempotentHint":"yes"}},
		{"name":"folded","annotations":{"IdempotentHint":true}},
		{"name":"bare"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Tool{}
	for _, tl := range tools {
		got[tl.Name] = tl
	}
	want := map[string]Tool{
		"write":  {Name: "write", Idempotent: true, HasReadOnly: true, HasIdempotent: true},
		"read":   {Name: "read", ReadOnly: true, HasReadOnly: true},
		"titled": {Name: "titled"},
		"odd":    {Name: "odd"},
		"bare":   {Name: "bare"},
	}
	if len(got) != len(want) {
		t.Errorf("learned %v, want %v (a case-folded hint makes the entry ambiguous)", got, want)
	}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s: %+v, want %+v", name, got[name], w)
		}
	}
}

func FuzzDecodeEnvelope(f *testing.F) {
	for _, s := range []string{
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"a":1},"_meta":{"idempotencyKey":"k"}}}`,
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","argumentſ":{"a":2}}}`,
		`{"jsonrpc":"2.0","id":1,"ID":2,"method":"ping"}`,
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"ls\ud800"}}`,
		`{"jsonrpc":"2.0","id":9007199254740993,"result":{}}`,
		`{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"\udbff","RequestId":1}}`,
		`5`, `[{"jsonrpc":"2.0","id":1,"method":"ping"}]`, `{"a":`, "{\"m\xff\":1}",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		_, _ = Sniff(body)
		_ = LooseIDs(body)
		_, _ = BatchElements(body)
		_, _, _ = DecodeToolsList(body)
		_ = ProtocolMeta(body)
		_, _ = CancelledRequestID(body)
		_, _ = DecodeToolCall(body)
		m, err := Parse(body)
		if err != nil {
			if c := ErrorCode(err); c != CodeParseError && c != CodeInvalidRequest && c != CodeInvalidParams {
				t.Fatalf("code %d", c)
			}
			return
		}
		if !json.Valid(body) {
			t.Fatal("accepted a body that is not JSON")
		}
		checkExactlyOnce(t, body, envelopeMembers)
		if m.Method == "tools/call" {
			checkExactlyOnce(t, m.Params, []string{"name", "arguments", "_meta"})
			tc, err := DecodeToolCall(m.Params)
			if err != nil {
				t.Fatalf("Parse accepted tools/call params that DecodeToolCall refuses: %v", err)
			}
			if _, err := canonical.Decode(json.RawMessage(strconvQuote(tc.Name))); err != nil {
				t.Fatalf("accepted a tool name that is not I-JSON: %q", tc.Name)
			}
		}
	})
}

func strconvQuote(s string) []byte { b, _ := json.Marshal(s); return b }

// checkExactlyOnce walks an accepted object with encoding/json's tokenizer
// (not the code under test): no member name repeats, and none differs from
// a name in names only in case.
func checkExactlyOnce(t *testing.T, obj []byte, names []string) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(obj))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("accepted %s, which is not an object", obj)
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		name := tok.(string)
		if seen[name] {
			t.Fatalf("accepted %s with %q twice", obj, name)
		}
		seen[name] = true
		for _, n := range names {
			if name != n && strings.EqualFold(name, n) {
				t.Fatalf("accepted %s with %q, an alias of %q", obj, name, n)
			}
		}
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			t.Fatal(err)
		}
	}
}

func FuzzIDKey(f *testing.F) {
	for _, p := range [][2]string{
		{`9007199254740992`, `9007199254740993`}, {`1`, `1.0`}, {`1`, `"1"`}, {`"ls\ud800"`, `"ls\udbff"`},
		{`1e2`, `100`}, {`-0`, `0`}, {`"a"`, `"\u0061"`}, {`0.1`, `1e-1`}, {`1E+2`, `100.00`},
	} {
		f.Add(p[0], p[1])
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		ka, kb := IDKey(json.RawMessage(a)), IDKey(json.RawMessage(b))
		va, okA := exactValue(a)
		vb, okB := exactValue(b)
		if !okA || !okB {
			return
		}
		if want := va == vb; (ka == kb) != want {
			t.Fatalf("IDKey(%s)=%q, IDKey(%s)=%q; exact values equal: %v", a, ka, b, kb, want)
		}
		if SameID(json.RawMessage(a), json.RawMessage(b)) != (va == vb) {
			t.Fatalf("SameID(%s, %s) disagrees with the exact values", a, b)
		}
	})
}

// exactValue is an id's exact value by other means than IDKey: a number
// as an exact rational, an I-JSON string as decoded by encoding/json.
func exactValue(raw string) (string, bool) {
	if !json.Valid([]byte(raw)) {
		return "", false
	}
	switch v := strings.TrimSpace(raw); {
	case v != raw:
		return "", false
	case strings.HasPrefix(v, `"`):
		if _, err := canonical.Decode([]byte(v)); err != nil {
			return "", false // not I-JSON: no exact value to compare
		}
		var s string
		_ = json.Unmarshal([]byte(v), &s)
		return "s:" + s, true
	case v[0] == '-' || (v[0] >= '0' && v[0] <= '9'):
		if i := strings.IndexAny(v, "eE"); i >= 0 && len(v)-i > 4 {
			return "", false // exponents too large for big.Rat to be quick
		}
		r, ok := new(big.Rat).SetString(v)
		if !ok {
			return "", false
		}
		return "n:" + r.RatString(), true
	}
	return "", false
}

// TestManyMembersStayLinear: a body with a great many members is read,
// and a repeated one found, with a bounded number of one-by-one name
// comparisons however many members there are (a map takes over past
// smallObject), so that a hostile body cannot make reading quadratic.
func TestManyMembersStayLinear(t *testing.T) {
	var b strings.Builder
	b.WriteString(`{"jsonrpc":"2.0","id":1,"method":"ping"`)
	for i := range 200_000 {
		b.WriteString(`,"m` + strconv.Itoa(i) + `":1`)
	}
	b.WriteString(`,"m5":2}`)
	_, err := Parse([]byte(b.String()))
	if err == nil || !strings.Contains(err.Error(), `"m5" twice`) {
		t.Fatalf("a repeated member among 200000: %v", err)
	}

	const bound = smallObject * (smallObject + 1) / 2
	for _, n := range []int{1, smallObject, smallObject + 1, 1000, 200_000} {
		var x nameIndex
		var ms []member
		for i := range n {
			name := "m" + strconv.Itoa(i)
			if x.repeated(ms, name) {
				t.Fatalf("%d members: %q reported repeated", n, name)
			}
			ms = append(ms, member{name: name})
		}
		if !x.repeated(ms, "m0") {
			t.Errorf("%d members: a repeated first name was not found", n)
		}
		if x.compared > bound {
			t.Errorf("%d members: %d names compared one by one, want at most %d however many members", n, x.compared, bound)
		}
	}
}
