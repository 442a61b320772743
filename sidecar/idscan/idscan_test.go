package idscan

import (
	"strings"
	"testing"
)

func TestScanner(t *testing.T) {
	for _, tc := range []struct {
		msg, id        string
		method, closed bool
	}{
		{`{"jsonrpc":"2.0","id":7,"result":{}}`, `7`, false, true},
		{`{"method":"x","p":{"id":1},"id":"late"}`, `"late"`, true, true},
		{`{"result":{"id":3},"id":-1.5e3`, `-1.5e3`, false, false}, // cut short after a number
		{`{"id":"a\"b","m":"x"}`, `"a\"b"`, false, true},
		{`{"\u0069d":9}`, `9`, false, true},
		{`{"id":{"a":1},"method":"m"}`, ``, true, true},
		{`{"id":null}`, ``, false, true},
		{`{"id":true}`, ``, false, true},
		{`{"x":"\"id\":5"}`, ``, false, true},
		{`{"id":"unterminated`, ``, false, false},
		{`[{"id":1}]`, ``, false, false},
		{`{"id":"` + strings.Repeat("a", MaxID) + `"}`, ``, false, true},
	} {
		var s Scanner
		for i := 0; i < len(tc.msg); i += 5 {
			_, _ = s.Write([]byte(tc.msg[i:min(i+5, len(tc.msg))]))
		}
		if got := string(s.ID()); got != tc.id || s.Method() != tc.method || s.Complete() != tc.closed {
			t.Errorf("%.60s: id %q, method %v, complete %v; want %q, %v, %v", tc.msg, got, s.Method(), s.Complete(), tc.id, tc.method, tc.closed)
		}
	}
}
