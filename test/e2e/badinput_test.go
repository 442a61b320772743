package e2e_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/sidecar"
)

type rpcReply struct {
	ID    json.RawMessage `json:"id"`
	Error *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
	Result json.RawMessage `json:"result"`
}

func post(t *testing.T, url, body string, hdr http.Header) (*http.Response, rpcReply) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	for k, v := range hdr {
		req.Header[k] = v
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	data, _ := io.ReadAll(resp.Body)
	var r rpcReply
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		for _, line := range strings.Split(string(data), "\n") {
			if d, ok := strings.CutPrefix(line, "data: "); ok {
				data = []byte(d)
			}
		}
	}
	_ = json.Unmarshal(data, &r)
	return resp, r
}

func TestBadInputIsRefusedAndNeverForwarded(t *testing.T) {
	h := newHarness(t, revisions[0], "", nil)
	tests := []struct {
		name    string
		body    string
		hdr     http.Header
		status  int
		code    int
		message string
		id      string
	}{
		{"not json", `charge my card`, nil, 400, mcpmsg.CodeParseError, "must be a JSON object", "null"},
		{"json but not an object", `5`, nil, 400, mcpmsg.CodeInvalidRequest, "body is a number", "null"},
		{"case-folded arguments", `{"jsonrpc":"2.0","id":11,"method":"tools/call","params":{"name":"charge_card","arguments":{},"argumentſ":{"amount":5}}}`, nil, 200, mcpmsg.CodeInvalidParams, "only in letter case", "11"},
		{"case-folded method", `{"jsonrpc":"2.0","id":12,"METHOD":"tools/list","method":"tools/call","params":{"name":"charge_card"}}`, nil, 400, mcpmsg.CodeInvalidRequest, "only in letter case", "12"},
		{"duplicate id", `{"jsonrpc":"2.0","id":13,"id":14,"method":"tools/call","params":{"name":"charge_card"}}`, nil, 400, mcpmsg.CodeInvalidRequest, "twice", "null"},
		{"lone surrogate in the tool name", `{"jsonrpc":"2.0","id":15,"method":"tools/call","params":{"name":"charge_card\ud800"}}`, nil, 200, mcpmsg.CodeInvalidParams, "I-JSON", "15"},
		{"truncated json", `{"jsonrpc":"2.0","id":1,"method":"tools/call"`, nil, 400, mcpmsg.CodeParseError, "not valid JSON", "null"},
		{"empty body", ``, nil, 400, mcpmsg.CodeParseError, "body is empty", "null"},
		{"no method", `{"jsonrpc":"2.0","id":3}`, nil, 400, mcpmsg.CodeInvalidRequest, `no "method"`, "3"},
		{"object id", `{"jsonrpc":"2.0","id":{"a":1},"method":"tools/call"}`, nil, 400, mcpmsg.CodeInvalidRequest, `"id" must be a string or a number`, "null"},
		{"tools/call without name", `{"jsonrpc":"2.0","id":"x","method":"tools/call","params":{"arguments":{}}}`, nil, 200, mcpmsg.CodeInvalidParams, "params.name is missing", `"x"`},
		{"tools/call without params", `{"jsonrpc":"2.0","id":5,"method":"tools/call"}`, nil, 200, mcpmsg.CodeInvalidParams, "has no params", "5"},
		{"arguments not json-representable", `{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"charge_card","arguments":{"amount":1e999}}}`, http.Header{"Authorization": {"Bearer agent"}}, 200, mcpmsg.CodeInvalidParams, "out of the IEEE 754 range", "6"},
		{"bad key header", `{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge_card","arguments":{}}}`, http.Header{"Idempotency-Key": {strings.Repeat("k", 300)}}, 200, mcpmsg.CodeInvalidParams, "the Idempotency-Key header is 300 characters long", "7"},
		{"bad _meta key", `{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"charge_card","_meta":{"idempotencyKey":["a"]}}}`, nil, 200, mcpmsg.CodeInvalidParams, `params._meta["idempotencyKey"] must be a string`, "8"},
		{"oversized body", `{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"charge_card","arguments":{"pad":"` + strings.Repeat("x", 5<<20) + `"}}}`, nil, 413, mcpmsg.CodeInvalidRequest, "request body is over 4194304 bytes", "null"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := h.posts.Load()
			resp, r := post(t, h.proxy.URL, tt.body, tt.hdr)
			if resp.StatusCode != tt.status {
				t.Errorf("status %d, want %d", resp.StatusCode, tt.status)
			}
			if r.Error == nil || r.Error.Code != tt.code || !strings.Contains(r.Error.Message, tt.message) {
				t.Fatalf("reply %+v, want code %d with %q", r.Error, tt.code, tt.message)
			}
			if string(r.ID) != tt.id {
				t.Errorf("reply id %s, want %s", r.ID, tt.id)
			}
			if n := h.posts.Load() - before; n != 0 {
				t.Errorf("%d requests reached the server, want none", n)
			}
		})
	}
	// The sidecar keeps serving.
	cs := h.connect(t, h.proxy.URL, clientOpts{})
	mustCall(t, cs, "charge_card", card, nil)
	if n := h.srv.Counts.Get("charge_card"); n != 1 {
		t.Fatalf("charge_card ran %d times, want 1", n)
	}
}

func TestBadPolicyFileStopsStartup(t *testing.T) {
	for yaml, want := range map[string]string{
		"spec: {tools: [{name: charge_*, mode: Sometimes}]}": `spec.tools[0].mode: "Sometimes" is not one of Auto, Deduplicate, Passthrough`,
		"spec: {ttl: 90d}":  "90d",
		"spec: {tl: 1h}":    `spec.tl: unknown field; did you mean "ttl"?`,
		"":                  "the policy is empty",
		"spec: {ttl: 800h}": "spec.ttl: 800h0m0s is outside 1s..720h",
	} {
		path := filepath.Join(t.TempDir(), "p.yaml")
		if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := sidecar.New(sidecar.Options{Upstream: "http://127.0.0.1:1", PolicyFile: path, LogLevel: "error"})
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), path) {
			t.Errorf("policy %q: error %v, want one naming the file and %q", yaml, err, want)
		}
	}
}

func TestBatchIsForwardedByteForByte(t *testing.T) {
	var got []byte
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, _ = io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`[{"jsonrpc":"2.0","id":1,"result":{}},{"jsonrpc":"2.0","id":2,"result":{}}]`))
	}))
	defer upstream.Close()
	sc, err := sidecar.New(sidecar.Options{Upstream: upstream.URL, LogLevel: "error"})
	if err != nil {
		t.Fatal(err)
	}
	proxy := httptest.NewServer(sc.Handler())
	defer proxy.Close()
	batch := ` [{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge_card","arguments":{"b":1,"a":2}}},{"jsonrpc":"2.0","id":2,"method":"ping"}]`
	resp, err := http.Post(proxy.URL, "application/json", strings.NewReader(batch))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	reply, _ := io.ReadAll(resp.Body)
	if string(got) != batch {
		t.Errorf("server got %q, want the batch unchanged", got)
	}
	if !strings.HasPrefix(string(reply), `[{"jsonrpc":"2.0","id":1`) {
		t.Errorf("client got %q", reply)
	}
}

// TestTransparency checks what a client of the server must not notice:
// Host, status codes, headers, and SSE events flushed one at a time.
func TestTransparency(t *testing.T) {
	release := make(chan struct{})
	var seen http.Header
	var host string
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen, host = r.Header.Clone(), r.Host
		switch r.Method {
		case http.MethodGet:
			w.Header().Set("Content-Type", "text/event-stream")
			w.Header().Set("Mcp-Session-Id", "sess-1")
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte("id: 1\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{}}\n\n"))
			w.(http.Flusher).Flush()
			<-release // the second event comes only after the client saw the first
			_, _ = w.Write([]byte("id: 2\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{\"n\":2}}\n\n"))
		case http.MethodDelete:
			w.WriteHeader(http.StatusNoContent)
		default:
			body, _ := io.ReadAll(r.Body)
			if bytes.Contains(body, []byte(`"tools/call"`)) {
				// A deduplicated call whose progress must arrive before its result.
				w.Header().Set("Content-Type", "text/event-stream")
				w.Header().Set("X-Upstream", "yes")
				w.WriteHeader(http.StatusOK)
				_, _ = w.Write([]byte("event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progressToken\":1,\"progress\":1}}\n\n"))
				w.(http.Flusher).Flush()
				<-release
				_, _ = w.Write([]byte("event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"content\":[]}}\n\n"))
				return
			}
			w.Header().Set("X-Upstream", "yes")
			http.Error(w, "teapot", http.StatusTeapot)
		}
	}))
	defer upstream.Close()
	sc, err := sidecar.New(sidecar.Options{Upstream: upstream.URL, LogLevel: "error"})
	if err != nil {
		t.Fatal(err)
	}
	proxy := httptest.NewServer(sc.Handler())
	defer proxy.Close()

	// Status and headers of a passthrough POST, and the Host the server sees.
	req, _ := http.NewRequest(http.MethodPost, proxy.URL+"/mcp?x=1", strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"ping"}`))
	req.Host = "mcp.example.internal"
	req.Header.Set("Mcp-Session-Id", "sess-1")
	req.Header.Set("MCP-Protocol-Version", "2025-11-25")
	req.Header.Set("Authorization", "Bearer t")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusTeapot || resp.Header.Get("X-Upstream") != "yes" {
		t.Errorf("status %d X-Upstream %q, want 418 and the server's header", resp.StatusCode, resp.Header.Get("X-Upstream"))
	}
	if host != "mcp.example.internal" {
		t.Errorf("server saw Host %q, want the client's", host)
	}
	for _, k := range []string{"Mcp-Session-Id", "Mcp-Protocol-Version", "Authorization"} {
		if seen.Get(k) != req.Header.Get(k) {
			t.Errorf("server saw %s %q, want %q", k, seen.Get(k), req.Header.Get(k))
		}
	}

	readsEventsOneByOne := func(name string, resp *http.Response) {
		t.Helper()
		defer func() { _ = resp.Body.Close() }()
		br := bufio.NewReader(resp.Body)
		first := readEvent(t, br)
		if !strings.Contains(first, "notifications/") {
			t.Fatalf("%s: first event %q", name, first)
		}
		release <- struct{}{} // only now does the server send the rest
		if second := readEvent(t, br); second == "" {
			t.Fatalf("%s: no second event", name)
		}
	}

	// A GET stream: each event arrives before the server writes the next.
	get, _ := http.NewRequest(http.MethodGet, proxy.URL, nil)
	get.Header.Set("Last-Event-ID", "0")
	gresp, err := http.DefaultClient.Do(get)
	if err != nil {
		t.Fatal(err)
	}
	if seen.Get("Last-Event-Id") != "0" || gresp.Header.Get("Mcp-Session-Id") != "sess-1" {
		t.Errorf("Last-Event-ID %q reached the server, session header %q came back", seen.Get("Last-Event-Id"), gresp.Header.Get("Mcp-Session-Id"))
	}
	readsEventsOneByOne("GET stream", gresp)

	// A deduplicated tools/call: its progress is relayed before the result.
	presp, err := http.Post(proxy.URL, "application/json", strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge_card"}}`))
	if err != nil {
		t.Fatal(err)
	}
	if presp.Header.Get("X-Upstream") != "yes" {
		t.Error("the server's headers did not reach the client of a deduplicated call")
	}
	readsEventsOneByOne("tools/call stream", presp)

	del, _ := http.NewRequest(http.MethodDelete, proxy.URL, nil)
	dresp, err := http.DefaultClient.Do(del)
	if err != nil {
		t.Fatal(err)
	}
	_ = dresp.Body.Close()
	if dresp.StatusCode != http.StatusNoContent {
		t.Errorf("DELETE status %d, want the server's 204", dresp.StatusCode)
	}
}

func readEvent(t *testing.T, br *bufio.Reader) string {
	t.Helper()
	done := make(chan string, 1)
	go func() {
		var ev strings.Builder
		for {
			line, err := br.ReadString('\n')
			ev.WriteString(line)
			if err != nil || line == "\n" {
				done <- ev.String()
				return
			}
		}
	}()
	select {
	case ev := <-done:
		return ev
	case <-time.After(5 * time.Second):
		t.Fatal("an event did not arrive: the proxy buffered it")
		return ""
	}
}
