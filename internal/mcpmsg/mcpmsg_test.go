package mcpmsg

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	tests := []struct {
		body    string
		wantErr string
		method  string
	}{
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x"}}`, "", "tools/call"},
		{`{"jsonrpc":"2.0","method":"notifications/initialized"}`, "", "notifications/initialized"},
		{`{"jsonrpc":"2.0","id":"a","result":{}}`, "", ""},
		{`{"jsonrpc":"2.0","id":1}`, `no "method"`, ""},
		{`{"jsonrpc":"2.0","id":{},"method":"x"}`, `"id" must be a string or a number`, "x"},
		{`{"jsonrpc":`, "not valid JSON", ""},
	}
	for _, tt := range tests {
		m, err := Parse([]byte(tt.body))
		if tt.wantErr == "" {
			if err != nil || m.Method != tt.method {
				t.Errorf("Parse(%s) = %v, %v", tt.body, m, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
			t.Errorf("Parse(%s) error = %v, want %q", tt.body, err, tt.wantErr)
		}
	}
}

func TestSniff(t *testing.T) {
	if k, err := Sniff([]byte(" \n[{}]")); err != nil || k != Batch {
		t.Errorf("batch sniffed as %v %v", k, err)
	}
	if k, err := Sniff([]byte("{}")); err != nil || k != Single {
		t.Errorf("object sniffed as %v %v", k, err)
	}
	for _, b := range []string{"", "  ", "hello", "42"} {
		if _, err := Sniff([]byte(b)); err == nil {
			t.Errorf("Sniff(%q) accepted", b)
		}
	}
}

func TestWithIDKeepsType(t *testing.T) {
	stored := []byte(`{"jsonrpc":"2.0","result":{"x":1}}`)
	for _, id := range []string{`7`, `"seven"`, `1.5`} {
		out := WithID(stored, json.RawMessage(id))
		var m map[string]json.RawMessage
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("WithID produced invalid JSON %s: %v", out, err)
		}
		if string(m["id"]) != id || string(m["result"]) != `{"x":1}` {
			t.Errorf("WithID(%s) = %s", id, out)
		}
	}
}

func TestErrorResponse(t *testing.T) {
	var m struct {
		ID    any
		Error struct {
			Code    int
			Message string
		}
	}
	if err := json.Unmarshal(ErrorResponse(nil, CodeParseError, `bad "json"`), &m); err != nil {
		t.Fatal(err)
	}
	if m.ID != nil || m.Error.Code != -32700 || m.Error.Message != `bad "json"` {
		t.Errorf("got %+v", m)
	}
}

func TestSameID(t *testing.T) {
	if !SameID(json.RawMessage(`1`), json.RawMessage(`1.0`)) || !SameID(json.RawMessage(`"a"`), json.RawMessage(`"\u0061"`)) {
		t.Error("equal ids differ")
	}
	if SameID(json.RawMessage(`1`), json.RawMessage(`"1"`)) {
		t.Error("number 1 and string \"1\" are different ids")
	}
	if IDKey(json.RawMessage(`1`)) != IDKey(json.RawMessage(`1.0`)) || IDKey(json.RawMessage(`1`)) == IDKey(json.RawMessage(`"1"`)) {
		t.Error("IDKey disagrees with SameID")
	}
}

// BenchmarkParseToolCall: the envelope and params of a typical
// deduplicated call, as the proxy reads every request.
func BenchmarkParseToolCall(b *testing.B) {
	body := []byte(`{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"_meta":{"io.modelcontextprotocol/clientCapabilities":{"roots":{"listChanged":true}},"io.modelcontextprotocol/clientInfo":{"name":"idemcp-bench","version":"1.0.0"},"io.modelcontextprotocol/protocolVersion":"2026-07-28"},"name":"charge_card","arguments":{"amount":10,"card":"4000-1"}}}`)
	b.ReportAllocs()
	for b.Loop() {
		m, err := Parse(body)
		if err != nil || m.Call == nil || m.Call.Name != "charge_card" {
			b.Fatal(m, err)
		}
	}
}
