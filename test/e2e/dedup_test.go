package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/sidecar/toollist"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/test/poll"
)

var card = map[string]any{"card": "4242", "amount": 12.5}

func TestSequentialRetriesRunOnce(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, "", nil)
		cs := h.connect(t, h.proxy.URL, clientOpts{})
		first := mustCall(t, cs, "charge_card", card, nil)
		if replayed(first) {
			t.Error("the first call is marked replayed")
		}
		for i := range 4 {
			res := mustCall(t, cs, "charge_card", card, nil)
			if !replayed(res) {
				t.Errorf("retry %d not marked replayed (result._meta = %v)", i+1, res.Meta)
			}
			if body(t, res) != body(t, first) {
				t.Errorf("retry %d = %s, want the first result %s", i+1, body(t, res), body(t, first))
			}
		}
		if n := h.srv.Counts.Get("charge_card"); n != 1 {
			t.Fatalf("charge_card ran %d times through the sidecar, want 1", n)
		}
		direct := h.connect(t, h.upstream.URL, clientOpts{})
		for range 5 {
			mustCall(t, direct, "charge_card", card, nil)
		}
		if n := h.srv.Counts.Get("charge_card"); n != 6 {
			t.Fatalf("charge_card ran %d times in all, want 1 through the sidecar + 5 direct", n)
		}
	})
}

func TestConcurrentRetriesRunOnce(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, "", nil)
		cs := h.connect(t, h.proxy.URL, clientOpts{})
		args := map[string]any{"card": "4242", "amount": 99, "delayMs": 300}
		results := make([]string, 50)
		var wg sync.WaitGroup
		for i := range 50 {
			wg.Go(func() { results[i] = body(t, mustCall(t, cs, "charge_card", args, nil)) })
		}
		wg.Wait()
		if n := h.srv.Counts.Get("charge_card"); n != 1 {
			t.Fatalf("50 concurrent identical calls ran charge_card %d times, want 1", n)
		}
		for i, r := range results {
			if r != results[0] {
				t.Fatalf("result %d = %s, want %s like the others", i, r, results[0])
			}
		}
	})
}

const principalPolicy = `apiVersion: idemcp.io/v1alpha1
kind: IdempotencyPolicy
metadata: {name: p}
spec:
  keyScope: Principal
`

func TestClientDisconnectsThenRetries(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, principalPolicy, nil)
		alice := http.Header{"Authorization": {"Bearer alice"}}
		tr := newKillableTransport()
		cs := h.connect(t, h.proxy.URL, clientOpts{headers: alice, transport: tr})
		args := map[string]any{"card": "4242", "amount": 5, "delayMs": 700}
		errc := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := call(ctx, cs, "charge_card", args, nil)
			errc <- err
		}()
		time.Sleep(200 * time.Millisecond)
		tr.kill() // the network drops mid-call
		if err := <-errc; err == nil {
			t.Fatal("the call whose connection dropped succeeded")
		}
		// The agent reconnects (a new session) and retries.
		again := h.connect(t, h.proxy.URL, clientOpts{headers: alice})
		res := mustCall(t, again, "charge_card", args, nil)
		if n := h.srv.Counts.Get("charge_card"); n != 1 {
			t.Fatalf("charge_card ran %d times, want 1", n)
		}
		if h.srv.Counts.Get(mcpserver.Cancelled) != 0 {
			t.Error("the dropped connection cancelled the tool upstream")
		}
		var out mcpserver.ChargeResult
		remarshal(t, res.StructuredContent, &out)
		if out.ChargeID != 1 {
			t.Errorf("retry got charge #%d, want the first call's #1", out.ChargeID)
		}
	})
}

func TestClientCancelsThenRetries(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, "", nil)
		args := map[string]any{"card": "4242", "amount": 7, "delayMs": 800}
		timeoutThenRetry := func(cs *mcp.ClientSession) *mcp.CallToolResult {
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			defer cancel()
			if _, err := call(ctx, cs, "charge_card", args, nil); err == nil {
				t.Fatal("the call that timed out succeeded")
			}
			return mustCall(t, cs, "charge_card", args, nil)
		}

		// Directly, the client's cancel stops the tool and the retry runs it
		// again: this is what the sidecar prevents.
		direct := h.connect(t, h.upstream.URL, clientOpts{})
		timeoutThenRetry(direct)
		poll.Within(t, 5*time.Second, "the direct cancel to reach the tool", poll.True(func() bool { return h.srv.Counts.Get(mcpserver.Cancelled) == 1 }))
		before := h.srv.Counts.Get("charge_card")

		cs := h.connect(t, h.proxy.URL, clientOpts{})
		res := timeoutThenRetry(cs)
		if n := h.srv.Counts.Get("charge_card") - before; n != 1 {
			t.Fatalf("through the sidecar charge_card ran %d times, want 1", n)
		}
		if n := h.srv.Counts.Get(mcpserver.Cancelled); n != 1 {
			t.Errorf("the tool was cancelled %d times in all, want only the direct one", n)
		}
		var out mcpserver.ChargeResult
		remarshal(t, res.StructuredContent, &out)
		if out.ChargeID != before+1 {
			t.Errorf("the retry got charge #%d, want #%d from the first call", out.ChargeID, before+1)
		}
	})
}

func TestInputRequiredIsNotStored(t *testing.T) {
	rev := revisions[0] // MRTR is 2026-07-28
	h := newHarness(t, rev, "", nil)
	cs := h.connect(t, h.proxy.URL, clientOpts{mcp: &mcp.ClientOptions{MultiRoundTrip: &mcp.MultiRoundTripOptions{Disabled: true}}})
	args := map[string]any{"amount": 100}
	for i := range 2 {
		res := mustCall(t, cs, "confirm_transfer", args, nil)
		if !res.NeedsInput() || replayed(res) {
			t.Fatalf("call %d: NeedsInput=%v replayed=%v, want an input request, not a replay", i+1, res.NeedsInput(), replayed(res))
		}
	}
	if n := h.srv.Counts.Get(mcpserver.AskedForInput); n != 2 {
		t.Fatalf("server asked for input %d times, want 2 (an InputRequiredResult is never stored)", n)
	}
	followUp := &mcp.CallToolParams{
		Name:           "confirm_transfer",
		Arguments:      args,
		InputResponses: mcp.InputResponseMap{"confirm": &mcp.ElicitResult{Action: "accept", Content: map[string]any{"ok": true}}},
		RequestState:   "transfer-1",
	}
	ctx := context.Background()
	first, err := cs.CallTool(ctx, followUp)
	if err != nil {
		t.Fatal(err)
	}
	retry, err := cs.CallTool(ctx, followUp)
	if err != nil {
		t.Fatal(err)
	}
	if n := h.srv.Counts.Get("confirm_transfer"); n != 1 {
		t.Fatalf("confirm_transfer ran %d times, want 1", n)
	}
	if replayed(first) || !replayed(retry) || body(t, first) != body(t, retry) {
		t.Errorf("follow-up replayed=%v, retry replayed=%v (%s vs %s)", replayed(first), replayed(retry), body(t, first), body(t, retry))
	}
}

func TestProgressAndElicitationPassThrough(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, "", nil)
		run := func(url string) (string, int, int) {
			var mu sync.Mutex
			progress, elicits := 0, 0
			cs := h.connect(t, url, clientOpts{mcp: &mcp.ClientOptions{
				ElicitationHandler: func(context.Context, *mcp.ElicitRequest) (*mcp.ElicitResult, error) {
					mu.Lock()
					elicits++
					mu.Unlock()
					return &mcp.ElicitResult{Action: "accept", Content: map[string]any{"ok": true}}, nil
				},
				ProgressNotificationHandler: func(context.Context, *mcp.ProgressNotificationClientRequest) {
					mu.Lock()
					progress++
					mu.Unlock()
				},
			}})
			params := &mcp.CallToolParams{Name: "confirm_transfer", Arguments: map[string]any{"amount": 3}}
			params.SetProgressToken("p1")
			res, err := cs.CallTool(context.Background(), params)
			if err != nil {
				t.Fatalf("calling confirm_transfer via %s: %v", url, err)
			}
			// Progress notifications may trail the response by a moment.
			poll.Within(t, 5*time.Second, "3 progress notifications", poll.True(func() bool { mu.Lock(); defer mu.Unlock(); return progress >= 3 }))
			mu.Lock()
			defer mu.Unlock()
			text := res.Content[0].(*mcp.TextContent).Text
			return text, progress, elicits
		}
		dText, dProgress, dElicits := run(h.upstream.URL)
		sText, sProgress, sElicits := run(h.proxy.URL)
		if dElicits != 1 || sElicits != dElicits || sProgress != dProgress {
			t.Errorf("through the sidecar: %d elicitations, %d progress; directly: %d, %d", sElicits, sProgress, dElicits, dProgress)
		}
		if dText != "transfer #1 done" || sText != "transfer #2 done" {
			t.Errorf("results %q (direct), %q (sidecar)", dText, sText)
		}
	})
}

// failFirst makes the server fail the first tools/call to charge_card at
// the transport level, before the tool runs.
func failFirst(how string) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		var once sync.Once
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			failed := false
			if r.Method == http.MethodPost {
				body := readBody(r)
				if isChargeCall(body) {
					once.Do(func() {
						failed = true
						switch how {
						case "500":
							http.Error(w, "upstream exploded", http.StatusInternalServerError)
						case "close":
							conn, _, err := http.NewResponseController(w).Hijack()
							if err == nil {
								_ = conn.Close()
							}
						}
					})
				}
			}
			if !failed {
				next.ServeHTTP(w, r)
			}
		})
	}
}

func TestTransportFailureIsRetried(t *testing.T) {
	for _, how := range []string{"500", "close"} {
		t.Run(how, func(t *testing.T) {
			forEachRevision(t, func(t *testing.T, rev revision) {
				h := newHarness(t, rev, "", failFirst(how))
				cs := h.connect(t, h.proxy.URL, clientOpts{})
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				if _, err := call(ctx, cs, "charge_card", card, nil); err == nil {
					t.Fatal("the failed call succeeded")
				}
				res := mustCall(t, cs, "charge_card", card, nil)
				if replayed(res) || res.IsError {
					t.Fatalf("retry replayed=%v isError=%v, want a fresh execution", replayed(res), res.IsError)
				}
				if n := h.srv.Counts.Get("charge_card"); n != 1 {
					t.Fatalf("charge_card ran %d times, want 1 (the retry)", n)
				}
				if again := mustCall(t, cs, "charge_card", card, nil); !replayed(again) {
					t.Error("the call after the successful retry was not replayed")
				}
			})
		})
	}
}

func TestToolErrorsAreNotCached(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, "", nil)
		cs := h.connect(t, h.proxy.URL, clientOpts{})
		if res := mustCall(t, cs, "flaky_charge", card, nil); !res.IsError {
			t.Fatal("flaky_charge did not fail the first time")
		}
		if res := mustCall(t, cs, "flaky_charge", card, nil); res.IsError || replayed(res) {
			t.Fatalf("retry after isError: isError=%v replayed=%v, want a fresh success", res.IsError, replayed(res))
		}
		if res := mustCall(t, cs, "flaky_charge", card, nil); !replayed(res) {
			t.Error("the success was not replayed")
		}
		if n := h.srv.Counts.Get("flaky_charge"); n != 2 {
			t.Errorf("flaky_charge ran %d times, want 2", n)
		}

		cached := newHarness(t, rev, "spec: {tools: [{name: flaky_charge, cacheToolErrors: true}]}", nil)
		cs = cached.connect(t, cached.proxy.URL, clientOpts{})
		mustCall(t, cs, "flaky_charge", card, nil)
		if res := mustCall(t, cs, "flaky_charge", card, nil); !res.IsError || !replayed(res) {
			t.Errorf("with cacheToolErrors the error was not replayed: isError=%v replayed=%v", res.IsError, replayed(res))
		}
	})
}

func TestExplicitKeys(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, "", nil)
		cs := h.connect(t, h.proxy.URL, clientOpts{})
		for _, spelling := range []string{"idemcp.io/idempotency-key", "idempotency-key", "idempotencyKey"} {
			key := mcp.Meta{spelling: "order-" + spelling}
			mustCall(t, cs, "charge_card", map[string]any{"card": "1", "amount": 1}, key)
			_, err := call(context.Background(), cs, "charge_card", map[string]any{"card": "1", "amount": 2}, key)
			if rpcCode(err) != mcpmsg.CodeKeyConflict {
				t.Errorf("%s reused with other arguments: err %v, want code %d", spelling, err, mcpmsg.CodeKeyConflict)
			}
		}
		if n := h.srv.Counts.Get("charge_card"); n != 3 {
			t.Fatalf("charge_card ran %d times, want 3 (once per key, never for a conflict)", n)
		}

		// The header takes precedence and is scoped like the _meta keys.
		hdr := h.connect(t, h.proxy.URL, clientOpts{headers: http.Header{"Idempotency-Key": {"hdr-1"}}})
		mustCall(t, hdr, "charge_card", card, mcp.Meta{"idempotency-key": "ignored"})
		if res := mustCall(t, hdr, "charge_card", card, mcp.Meta{"idempotency-key": "other"}); !replayed(res) {
			t.Error("same Idempotency-Key header, other _meta key: not replayed")
		}

		for _, bad := range []any{"", string(make([]byte, 256)), "tab\tkey", "caf\u00e9", 42} {
			_, err := call(context.Background(), cs, "charge_card", card, mcp.Meta{"idempotency-key": bad})
			if rpcCode(err) != mcpmsg.CodeInvalidParams {
				t.Errorf("key %q: err %v, want invalid params", bad, err)
			}
		}
		if n := h.srv.Counts.Get("charge_card"); n != 4 {
			t.Fatalf("charge_card ran %d times, want 4 (bad keys are never forwarded)", n)
		}
	})
}

func TestCanonicalArgumentsAndPassthrough(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, `spec:
  tools:
  - {name: refund, mode: Passthrough}
  - {name: charge_card, ignoreArguments: [/requestedAt]}
`, nil)
		cs := h.connect(t, h.proxy.URL, clientOpts{})
		for _, raw := range []string{
			`{"card":"4242","amount":1,"requestedAt":"10:00"}`,
			`{"amount":1.0,"card":"4242","requestedAt":"10:01"}`,
			`{ "amount" : 1e0 , "card" : "4242" }`,
		} {
			mustCall(t, cs, "charge_card", json.RawMessage(raw), nil)
		}
		if n := h.srv.Counts.Get("charge_card"); n != 1 {
			t.Errorf("reordered keys, 1 vs 1.0 and an ignored timestamp: charge_card ran %d times, want 1", n)
		}
		if _, err := cs.ListTools(context.Background(), nil); err != nil { // teaches Auto the readOnlyHint
			t.Fatal(err)
		}
		for range 3 {
			if res := mustCall(t, cs, "refund", card, nil); replayed(res) {
				t.Error("a Passthrough tool was replayed")
			}
			if res := mustCall(t, cs, "get_balance", card, nil); replayed(res) {
				t.Error("a read-only tool was replayed under Auto")
			}
		}
		if r, g := h.srv.Counts.Get("refund"), h.srv.Counts.Get("get_balance"); r != 3 || g != 3 {
			t.Errorf("refund ran %d and get_balance %d times, want 3 each", r, g)
		}
	})
}

func TestOversizedResultIsForwardedNotStored(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, "spec: {maxResultBytes: 2Ki}", nil)
		cs := h.connect(t, h.proxy.URL, clientOpts{})
		args := map[string]any{"card": "4242", "amount": 1, "size": 10_000}
		res := mustCall(t, cs, "charge_card", args, nil)
		var out mcpserver.ChargeResult
		remarshal(t, res.StructuredContent, &out)
		if len(out.Padding) != 10_000 {
			t.Fatalf("the first call got %d bytes of padding, want the whole 10000", len(out.Padding))
		}
		_, err := call(context.Background(), cs, "charge_card", args, nil)
		if rpcCode(err) != mcpmsg.CodeResultNotStored {
			t.Fatalf("retry of an oversized result: err %v, want code %d", err, mcpmsg.CodeResultNotStored)
		}
		if n := h.srv.Counts.Get("charge_card"); n != 1 {
			t.Fatalf("charge_card ran %d times, want 1", n)
		}
	})
}

func TestInFlightReject(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, "spec: {inFlight: Reject}", nil)
		cs := h.connect(t, h.proxy.URL, clientOpts{})
		args := map[string]any{"card": "4242", "amount": 1, "delayMs": 600}
		done := make(chan struct{})
		go func() { defer close(done); mustCall(t, cs, "charge_card", args, nil) }()
		time.Sleep(150 * time.Millisecond)
		_, err := call(context.Background(), cs, "charge_card", args, nil)
		if rpcCode(err) != mcpmsg.CodeInFlight {
			t.Errorf("duplicate while in flight: err %v, want code %d", err, mcpmsg.CodeInFlight)
		}
		<-done
		// The result is stored just after its client is answered; until
		// then a duplicate is still rejected.
		if err := h.sidecar.Engine().Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
		if res := mustCall(t, cs, "charge_card", args, nil); !replayed(res) {
			t.Error("after completion the retry was not replayed")
		}
	})
}

func remarshal(t *testing.T, in, out any) {
	t.Helper()
	b, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, out); err != nil {
		t.Fatal(err)
	}
}

// TestResponseOverRelayBufferIsNotRunAgain: a response larger than the
// sidecar keeps (--max-response-bytes) still reaches its client whole, and
// the call, which ran, is not run again by a retry.
func TestResponseOverRelayBufferIsNotRunAgain(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		h := newHarness(t, rev, "", nil)
		sc, err := sidecar.New(sidecar.Options{Upstream: h.upstream.URL, LogLevel: "error", MaxResponseBytes: 2048})
		if err != nil {
			t.Fatal(err)
		}
		proxy := httptest.NewServer(sc.Handler())
		t.Cleanup(proxy.Close) // after the client's session closes
		cs := h.connect(t, proxy.URL, clientOpts{})
		args := map[string]any{"card": "4242", "amount": 1, "size": 4096}
		res := mustCall(t, cs, "charge_card", args, nil)
		var out mcpserver.ChargeResult
		remarshal(t, res.StructuredContent, &out)
		if len(out.Padding) != 4096 {
			t.Fatalf("the first call got %d bytes of padding, want all 4096", len(out.Padding))
		}
		_, err = call(context.Background(), cs, "charge_card", args, nil)
		if rpcCode(err) != mcpmsg.CodeResultNotStored {
			t.Fatalf("retry: %v, want code %d", err, mcpmsg.CodeResultNotStored)
		}
		if n := h.srv.Counts.Get("charge_card"); n != 1 {
			t.Fatalf("charge_card ran %d times, want 1", n)
		}
	})
}

// TestOversizedNotificationDoesNotHideAFailure: an event too large to keep
// that is not the call's response (a big log notification) is relayed, and
// the response after it still decides: an error releases the key.
func TestOversizedNotificationDoesNotHideAFailure(t *testing.T) {
	var hits atomic.Int32
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("User-Agent") != toollist.UserAgent {
			hits.Add(1) // the sidecar's own tools/list is not the client's traffic
		}
		w.Header().Set("Content-Type", "text/event-stream")
		big := strings.Repeat("x", 8000)
		_, _ = fmt.Fprintf(w, "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{\"data\":%q}}\n\n", big)
		_, _ = fmt.Fprint(w, "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"error\":{\"code\":-32000,\"message\":\"db down, nothing done\"}}\n\n")
	}))
	defer upstream.Close()
	sc, err := sidecar.New(sidecar.Options{Upstream: upstream.URL, LogLevel: "error", MaxResponseBytes: 4096})
	if err != nil {
		t.Fatal(err)
	}
	proxy := httptest.NewServer(sc.Handler())
	defer proxy.Close()
	body := `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge_card","arguments":{"amount":1}}}`
	for i := range 2 {
		resp, err := http.Post(proxy.URL, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if !strings.Contains(string(data), "db down") || strings.Count(string(data), "x") < 8000 {
			t.Fatalf("call %d: the client did not get both events (%d bytes)", i+1, len(data))
		}
		if err := sc.Engine().Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if n := hits.Load(); n != 2 {
		t.Fatalf("the server was called %d times, want 2: a failed call must be retried", n)
	}
}
