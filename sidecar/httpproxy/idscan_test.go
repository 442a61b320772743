package httpproxy

import "testing"

func TestIDScanner(t *testing.T) {
	for _, tc := range []struct {
		msg, id string
		ok      bool
	}{
		{`{"jsonrpc":"2.0","id":7,"result":{}}`, `7`, true},
		{`{"result":{"content":[{"text":"a \"id\": 1, }"}],"id":99},"jsonrpc":"2.0","id":"x"}`, `"x"`, true},
		{`{"result":{},"\u0069d" : 9007199254740993 }`, `9007199254740993`, true},
		{`{"jsonrpc":"2.0","method":"notifications/progress","id":1}`, ``, false},
		{`{"id":1,"id":2,"result":{}}`, ``, false},
		{`{"id":null,"error":{}}`, ``, false},
		{`{"id":{"a":1},"result":{}}`, ``, false},
		{`[{"id":1}]`, ``, false},
		{`{"id":1,"result":{}`, ``, false}, // cut short
	} {
		var s idScanner
		// In pieces, as an oversized event streams by.
		for i := 0; i < len(tc.msg); i += 3 {
			_, _ = s.Write([]byte(tc.msg[i:min(i+3, len(tc.msg))]))
		}
		id, ok := s.responseID()
		if ok != tc.ok || string(id) != tc.id {
			t.Errorf("%s: id %s, %v; want %s, %v", tc.msg, id, ok, tc.id, tc.ok)
		}
	}
}
