package e2e_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/test/procs"
)

// hostileBins is the wrap test binaries with test/mcpserver/cmd/hostilestdio
// as the server.
func hostileBins(t *testing.T) wrapBins {
	t.Helper()
	bins := buildWrapBins(t)
	// Built without -race, as before: it is the server, not the code under test.
	return wrapBins{idemcp: bins.idemcp, server: procs.Build(t, "github.com/idemcp/idemcp/test/mcpserver/cmd/hostilestdio")}
}

// TestWrapHostileAnswersNeverHang: a server that answers a deduplicated
// call with the id in the other type, inside a batch, or with the id twice
// gets its line relayed as it came, and the call settles at once: the
// retry is answered within a bound (replayed where the answer could be
// read as the call's, run again where it could not), never left waiting.
func TestWrapHostileAnswersNeverHang(t *testing.T) {
	for _, tc := range []struct {
		mode, id string
		runs     int // executions after the call and its retry
	}{
		{"idtype", `"1"`, 1},
		{"idtype", `7`, 1},
		{"batch", `7`, 1},
		{"dupid", `7`, 2},
	} {
		t.Run(tc.mode+"-"+tc.id, func(t *testing.T) {
			t.Parallel()
			count := newCounter(t)
			w := startRawWrap(t, hostileBins(t), nil, count.env(), "HOSTILE_MODE="+tc.mode)
			w.send(t, wrapInitialize)
			w.next(t)
			w.send(t, wrapInitialized)
			call := `{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"charge_card","arguments":{"card":"4242"}}}`
			w.send(t, fmt.Sprintf(call, tc.id))
			if first := w.next(t); !strings.Contains(first, "charge #1") {
				t.Fatalf("the server's answer was not relayed as it came: %s", first)
			}
			start := time.Now()
			w.send(t, fmt.Sprintf(call, `"retry"`))
			retry := w.next(t)
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("the retry was answered after %v", d)
			}
			if tc.runs == 1 && (!strings.Contains(retry, `"id":"retry"`) || !strings.Contains(retry, "charge #1") || !strings.Contains(retry, "idemcp.io/replayed")) {
				t.Errorf("retry got %s, want the replay of charge #1 with id \"retry\"", retry)
			}
			if n := count.get(t, "charge_card"); n != tc.runs {
				t.Errorf("charge_card ran %d times, want %d", n, tc.runs)
			}
		})
	}
}

// TestWrapIDsBeyondDoublesStayApart: two calls in flight whose ids differ
// only past 2^53 are two calls, each settled by its own response (the
// server answers them in reverse order) and each retry replays its own.
func TestWrapIDsBeyondDoublesStayApart(t *testing.T) {
	t.Parallel()
	count := newCounter(t)
	w := startRawWrap(t, hostileBins(t), nil, count.env(), "HOSTILE_MODE=pair")
	w.send(t, wrapInitialize)
	w.next(t)
	w.send(t, wrapInitialized)
	call := `{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"charge_card","arguments":{"card":%q}}}`
	w.send(t, fmt.Sprintf(call, "9007199254740992", "card-992"))
	w.send(t, fmt.Sprintf(call, "9007199254740993", "card-993"))
	got := map[string]string{}
	for len(got) < 2 {
		line := w.next(t)
		m, err := mcpmsg.Parse([]byte(line))
		if err != nil || m.Method != "" {
			continue
		}
		got[string(m.ID)] = line
	}
	for id, card := range map[string]string{"9007199254740992": "card-992", "9007199254740993": "card-993"} {
		if !strings.Contains(got[id], card) || strings.Contains(got[id], `"error"`) {
			t.Errorf("response to %s: %s, want the charge of %s", id, got[id], card)
		}
	}
	// Each retry replays its own call's result.
	for i, card := range []string{"card-992", "card-993"} {
		w.send(t, fmt.Sprintf(call, fmt.Sprint(100+i), card))
		if r := w.next(t); !strings.Contains(r, card) || !strings.Contains(r, "idemcp.io/replayed") {
			t.Errorf("retry of %s: %s, want its own replayed result", card, r)
		}
	}
	if n := count.get(t, "charge_card"); n != 2 {
		t.Errorf("charge_card ran %d times, want 2", n)
	}
}

// TestWrapRefusesAmbiguousMessages: what the server would read one way and
// Go's encoding/json another is refused, never forwarded; valid JSON that
// is not an object is an invalid request, not a parse error.
func TestWrapRefusesAmbiguousMessages(t *testing.T) {
	t.Parallel()
	count := newCounter(t)
	w := startRawWrap(t, buildWrapBins(t), nil, count.env())
	w.send(t, wrapInitialize)
	w.next(t)
	w.send(t, wrapInitialized)
	for _, tc := range []struct {
		line, id string
		code     int
	}{
		{`5`, "null", mcpmsg.CodeInvalidRequest},
		{`"tools/call"`, "null", mcpmsg.CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"charge_card","arguments":{"card":"1"},"argumentſ":{"card":"2"}}}`, "3", mcpmsg.CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"charge_card","Name":"refund"}}`, "4", mcpmsg.CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"ls\ud800"}}`, "5", mcpmsg.CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":6,"Method":"tools/list","method":"tools/call","params":{"name":"charge_card"}}`, "6", mcpmsg.CodeInvalidRequest},
		{`{"jsonrpc":"2.0","id":7,"id":8,"method":"tools/call","params":{"name":"charge_card"}}`, "null", mcpmsg.CodeInvalidRequest},
	} {
		w.send(t, tc.line)
		expectError(t, w.next(t), tc.id, tc.code)
	}
	if n := count.get(t, "charge_card") + count.get(t, "refund"); n != 0 {
		t.Errorf("%d ambiguous calls ran", n)
	}
}

// TestAutoLearnsToolsWithoutClientListing: a client that never calls
// tools/list still gets a readOnlyHint tool passed through under Auto
// (the sidecar lists the tools itself), and a side effect deduplicated.
func TestAutoLearnsToolsWithoutClientListing(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, "", nil)
		cs := h.connect(t, h.proxy.URL, clientOpts{})
		for range 3 {
			if res := mustCall(t, cs, "get_balance", card, nil); replayed(res) {
				t.Error("a readOnlyHint tool was replayed under Auto though the client never listed tools")
			}
			mustCall(t, cs, "charge_card", card, nil)
		}
		if g, c := h.srv.Counts.Get("get_balance"), h.srv.Counts.Get("charge_card"); g != 3 || c != 1 {
			t.Errorf("get_balance ran %d times (want 3), charge_card %d (want 1)", g, c)
		}
	})
}

func TestWrapAutoLearnsToolsWithoutClientListing(t *testing.T) {
	bins := buildWrapBins(t)
	forEachRevision(t, func(t *testing.T, rev revision) {
		count := newCounter(t)
		w := connectWrap(t, bins, rev, nil, count.env())
		args := map[string]any{"card": "4242", "amount": 1}
		for range 3 {
			if res := mustCall(t, w.cs, "get_balance", args, nil); replayed(res) {
				t.Error("a readOnlyHint tool was replayed under Auto though the client never listed tools")
			}
			mustCall(t, w.cs, "charge_card", args, nil)
		}
		if g, c := count.get(t, "get_balance"), count.get(t, "charge_card"); g != 3 || c != 1 {
			t.Errorf("get_balance ran %d times (want 3), charge_card %d (want 1)", g, c)
		}
	})
}
