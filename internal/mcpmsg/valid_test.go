package mcpmsg

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
)

var validCases = []string{
	``, ` `, `0`, `-0`, `01`, `-`, `1.`, `1.5`, `1e`, `1e+`, `1E-7`, `-12.5e10`, `1x`,
	`true`, `tru`, `truex`, `false`, `null`, `nul`, `"`, `""`, `"a`, `"\"`, `"\u00e9"`, `"\u00g9"`,
	`"\x"`, `"\/\b\f\n\r\t\\"`, "\"\x1f\"", "\"\x7f\x80\xff\"", `[]`, `[`, `[1,]`, `[1 2]`, `[1, 2 ]`,
	`{}`, `{`, `{"a":1}`, `{"a" : [true , {"b":null}] }`, `{"a":1,}`, `{"a"}`, `{1:2}`, `{"a":1}}`,
	" \t\r\n{ \"a\" :\n1 } \n", `{"a":1} x`, `"abcdefghijklmnopqrstuvwxyz\"0123456789"`,
	`"abcdefgh` + "\x01" + `ijkl"`, `"abcdefghijklmnop\`,
	strings.Repeat("[", 10000) + strings.Repeat("]", 10000),
	strings.Repeat("[", 10001) + strings.Repeat("]", 10001),
	strings.Repeat(`{"a":`, 10000) + "1" + strings.Repeat("}", 10000),
}

func TestValidAsEncodingJSON(t *testing.T) {
	for _, c := range validCases {
		if got, want := Valid([]byte(c)), json.Valid([]byte(c)); got != want {
			t.Errorf("Valid(%.60q) = %v, json.Valid says %v", c, got, want)
		}
	}
}

func FuzzValid(f *testing.F) {
	for _, c := range validCases {
		f.Add([]byte(c))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := Valid(b), json.Valid(b); got != want {
			t.Errorf("Valid(%q) = %v, json.Valid says %v", b, got, want)
		}
	})
}

// skipStringByBytes is skipString as it was, a byte at a time.
func skipStringByBytes(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return i
}

func FuzzSkipString(f *testing.F) {
	for _, c := range []string{`""`, `"a\"b"`, `"\\"`, `"abc`, `"ab\`, `"\\\\\"\\"x"`} {
		f.Add([]byte(c))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) == 0 {
			return
		}
		if got, want := skipString(b, 0), skipStringByBytes(b, 0); got != want {
			t.Errorf("skipString(%q) = %d, want %d", b, got, want)
		}
	})
}

// FuzzMembersWithin: MembersWithin's one scan finds what Members finds,
// of the object and of its last "result" member's value.
func FuzzMembersWithin(f *testing.F) {
	for _, c := range append(validCases,
		`{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"a\"}"}],"isError":false}}`,
		`{"result":1,"result":{"a":{"b":2}} , "id":"x"}`, `{"result":{"a":1},"result":"s"}`, `{ "result" : { } }`,
		`{"resul\u0074":{"a":1}}`, `{"error":{"code":1},"result":[{"a":1}]}`) {
		f.Add([]byte(c))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if !Valid(b) {
			return
		}
		ms, inner, innerObject, ok := MembersWithin(b, "result")
		wantMs, wantOK := Members(b)
		if ok != wantOK || !slices.Equal(ms, wantMs) {
			t.Fatalf("MembersWithin(%q): %v %v, Members: %v %v", b, ms, ok, wantMs, wantOK)
		}
		var wantInner []Member
		wantObject := false
		for _, m := range wantMs {
			if m.Name == "result" {
				wantInner, wantObject = Members(b[m.Start:m.End])
			}
		}
		if innerObject != wantObject || !slices.Equal(inner, wantInner) {
			t.Fatalf("MembersWithin(%q) result: %v %v, Members of it: %v %v", b, inner, innerObject, wantInner, wantObject)
		}
	})
}
