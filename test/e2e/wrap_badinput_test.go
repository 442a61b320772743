package e2e_test

import (
	"encoding/json"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/mcpmsg"
)

const (
	wrapInitialize  = `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"raw","version":"1"}}}`
	wrapInitialized = `{"jsonrpc":"2.0","method":"notifications/initialized"}`
)

func parseReply(t *testing.T, line string) rpcReply {
	t.Helper()
	var r rpcReply
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		t.Fatalf("idemcp wrap wrote a line that is not JSON: %q", line)
	}
	return r
}

func expectError(t *testing.T, line string, id string, code int) {
	t.Helper()
	r := parseReply(t, line)
	if r.Error == nil || r.Error.Code != code || string(r.ID) != id {
		t.Fatalf("got %s, want a JSON-RPC error %d with id %s", line, code, id)
	}
}

// TestWrapBadInputIsRefusedAndRelayingGoesOn: lines that are not JSON,
// not JSON-RPC, or over --max-line-bytes are answered with an error (with
// the request's id when there is one, wherever it sits in the line), said
// on stderr, never forwarded, and the session goes on.
func TestWrapBadInputIsRefusedAndRelayingGoesOn(t *testing.T) {
	t.Parallel()
	bins := buildWrapBins(t)
	count := newCounter(t)
	w := startRawWrap(t, bins, []string{"--max-line-bytes", "2048"}, count.env())

	w.send(t, wrapInitialize)
	if r := parseReply(t, w.next(t)); r.Error != nil || len(r.Result) == 0 {
		t.Fatalf("initialize through the wrapper failed: %+v", r)
	}
	w.send(t, wrapInitialized)

	big := strings.Repeat("x", 4000)
	tests := []struct {
		name string
		line string
		id   string
		code int
	}{
		{"not JSON", "hello there", "null", mcpmsg.CodeParseError},
		{"truncated JSON", `{"jsonrpc":"2.0","id":5,"method":"tools/call"`, "null", mcpmsg.CodeParseError},
		{"not JSON-RPC", `{"hello":"world","id":6}`, "6", mcpmsg.CodeInvalidRequest},
		{"over the limit, id first", `{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge_card","arguments":{"card":"` + big + `","amount":1}}}`, "7", mcpmsg.CodeInvalidRequest},
		{"over the limit, id last", `{"jsonrpc":"2.0","method":"tools/call","params":{"name":"charge_card","arguments":{"card":"` + big + `","id":"nested"}},"id":"late"}`, `"late"`, mcpmsg.CodeInvalidRequest},
		{"over the limit, no id", `{"jsonrpc":"2.0","method":"tools/call","params":{"name":"charge_card","arguments":{"card":"` + big + `","amount":1}}}`, "null", mcpmsg.CodeInvalidRequest},
	}
	for _, tc := range tests {
		w.send(t, tc.line)
		if tc.name == "over the limit, no id" {
			continue // nothing to answer: only stderr says it
		}
		expectError(t, w.next(t), tc.id, tc.code)
	}

	w.send(t, `{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"charge_card","arguments":{"card":"4242","amount":1}}}`)
	if r := parseReply(t, w.next(t)); r.Error != nil || string(r.ID) != "8" {
		t.Fatalf("a good call after bad lines: %+v", r)
	}
	if n := count.get(t, "charge_card"); n != 1 {
		t.Errorf("charge_card ran %d times, want 1: no bad line may reach the server", n)
	}
	_ = w.stdin.Close()
	if code := w.wait(t); code != 0 {
		t.Errorf("idemcp wrap exited with %d, want 0", code)
	}
	log := w.stderr.String()
	for _, want := range []string{"is not JSON", "over the limit of 2048 (--max-line-bytes)"} {
		if !strings.Contains(log, want) {
			t.Errorf("stderr does not say %q:\n%s", want, log)
		}
	}
}

// TestWrapHangUpLetsCallsFinish: a client that sends a slow deduplicated
// call and closes stdin at once still gets its response, and the server
// sees no cancel; then the wrapper exits with the server's code.
func TestWrapHangUpLetsCallsFinish(t *testing.T) {
	t.Parallel()
	bins := buildWrapBins(t)
	count := newCounter(t)
	w := startRawWrap(t, bins, nil, count.env())
	w.send(t, wrapInitialize)
	w.next(t)
	w.send(t, wrapInitialized)
	w.send(t, `{"jsonrpc":"2.0","id":"slow","method":"tools/call","params":{"name":"charge_card","arguments":{"card":"4242","amount":1,"delayMs":500}}}`)
	_ = w.stdin.Close()
	if r := parseReply(t, w.next(t)); r.Error != nil || string(r.ID) != `"slow"` {
		t.Fatalf("the call in flight when the client hung up: %+v", r)
	}
	if code := w.wait(t); code != 0 {
		t.Errorf("idemcp wrap exited with %d, want 0", code)
	}
	if n := count.get(t, "charge_card"); n != 1 {
		t.Errorf("charge_card ran %d times, want 1", n)
	}
}

// TestWrapPassesSignalsAndExitCode: SIGTERM to the wrapper reaches the
// server, and the wrapper exits as the server did (128+15).
func TestWrapPassesSignalsAndExitCode(t *testing.T) {
	t.Parallel()
	bins := buildWrapBins(t)
	w := startRawWrap(t, bins, nil)
	w.send(t, wrapInitialize)
	w.next(t) // the server is up
	if err := w.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := w.wait(t); code != 128+int(syscall.SIGTERM) {
		t.Errorf("idemcp wrap exited with %d after SIGTERM, want %d (the server killed by SIGTERM)", code, 128+int(syscall.SIGTERM))
	}
}

// TestWrapQuietOnNormalClose: a client ends the session the way the MCP
// stdio transport says (stdin closed, then SIGTERM to a server that is
// still there, as the TypeScript SDK does after 2s), in front of a server
// that does not exit on its own when stdin closes. That is a normal end:
// the wrapper exits 0 and logs nothing above debug about the server's
// exit.
func TestWrapQuietOnNormalClose(t *testing.T) {
	t.Parallel()
	bins := buildWrapBins(t)
	w := startRawWrap(t, bins, nil, "LINGER=1")
	w.send(t, wrapInitialize)
	w.next(t)
	_ = w.stdin.Close()
	// The wrapper closes the server's stdin at once; the server lingers.
	time.Sleep(500 * time.Millisecond)
	if err := w.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := w.wait(t); code != 0 {
		t.Errorf("idemcp wrap exited with %d after a normal close, want 0", code)
	}
	for _, line := range strings.Split(w.stderr.String(), "\n") {
		if strings.Contains(line, "level=INFO") && strings.Contains(line, "exited") ||
			strings.Contains(line, "level=WARN") || strings.Contains(line, "level=ERROR") {
			t.Errorf("a normal close logged %q", line)
		}
	}
	if !strings.Contains(w.stderr.String(), "stopped on a signal after the client closed the session") {
		t.Errorf("the debug log does not say how the server stopped:\n%s", w.stderr.String())
	}
}
