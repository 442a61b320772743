package e2e_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

const wrapRefundPassthrough = `apiVersion: idemcp.io/v1alpha1
kind: IdempotencyPolicy
metadata: {name: local}
spec:
  tools:
  - name: refund
    mode: Passthrough
`

// TestWrapDeduplicatesRetries drives `idemcp wrap -- stdioserver` with the
// Go SDK client over stdio: five identical charges run once and four are
// replayed; a Passthrough tool and a readOnlyHint tool (defaultMode Auto,
// learned from tools/list) run every time; concurrent identical calls run
// once. Executions are counted by the server process itself.
func TestWrapDeduplicatesRetries(t *testing.T) {
	bins := buildWrapBins(t)
	forEachRevision(t, func(t *testing.T, rev revision) {
		count := newCounter(t)
		w := connectWrap(t, bins, rev, []string{"--policy-file", writePolicy(t, wrapRefundPassthrough)}, count.env())
		t.Logf("negotiated %s over stdio", w.cs.InitializeResult().ProtocolVersion)

		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if _, err := w.cs.ListTools(ctx, nil); err != nil {
			t.Fatalf("tools/list: %v", err)
		}

		args := map[string]any{"card": "4242", "amount": 12.5}
		first := mustCall(t, w.cs, "charge_card", args, nil)
		if replayed(first) {
			t.Fatalf("the first charge is marked replayed: %+v", first)
		}
		for i := 2; i <= 5; i++ {
			res := mustCall(t, w.cs, "charge_card", args, nil)
			if !replayed(res) {
				t.Errorf("charge %d is not marked replayed (result._meta[\"idemcp.io/replayed\"])", i)
			}
			if got, want := body(t, res), body(t, first); got != want {
				t.Errorf("charge %d = %s, want the first result %s", i, got, want)
			}
		}
		if n := count.get(t, "charge_card"); n != 1 {
			t.Fatalf("5 identical charge_card calls ran %d times, want 1", n)
		}

		for i := 1; i <= 5; i++ {
			if res := mustCall(t, w.cs, "refund", args, nil); replayed(res) {
				t.Errorf("refund %d (Passthrough) is marked replayed", i)
			}
		}
		if n := count.get(t, "refund"); n != 5 {
			t.Errorf("5 refund calls (Passthrough) ran %d times, want 5", n)
		}
		for i := 1; i <= 2; i++ {
			if res := mustCall(t, w.cs, "get_balance", args, nil); replayed(res) {
				t.Errorf("get_balance %d (readOnlyHint, Auto) is marked replayed", i)
			}
		}
		if n := count.get(t, "get_balance"); n != 2 {
			t.Errorf("2 get_balance calls (readOnlyHint) ran %d times, want 2", n)
		}

		// Identical calls in flight at once: one runs, the others wait for it.
		slow := map[string]any{"card": "5555", "amount": 3, "delayMs": 300}
		results := make([]*mcp.CallToolResult, 5)
		var wg sync.WaitGroup
		for i := range results {
			wg.Go(func() { results[i] = mustCall(t, w.cs, "charge_card", slow, nil) })
		}
		wg.Wait()
		fresh := 0
		for _, r := range results {
			if !replayed(r) {
				fresh++
			}
			if body(t, r) != body(t, results[0]) {
				t.Errorf("concurrent results differ: %s vs %s", body(t, r), body(t, results[0]))
			}
		}
		if n := count.get(t, "charge_card"); n != 2 || fresh != 1 {
			t.Errorf("5 concurrent identical charges: charge_card ran %d times in all (want 2), %d results not replayed (want 1)", n, fresh)
		}

		if code := w.close(t); code != 0 {
			t.Errorf("idemcp wrap exited with %d after the client closed, want 0 like the server", code)
		}
	})
}

// TestWrapCancelledCallRunsOnceAndRetryGetsIt: an agent cancels a slow
// deduplicated call on its timeout and retries. The cancel must not reach
// the server (the charge completes), and the retry gets its result. As a
// control, a Passthrough call's cancel does reach the server.
func TestWrapCancelledCallRunsOnceAndRetryGetsIt(t *testing.T) {
	t.Parallel()
	bins := buildWrapBins(t)
	count := newCounter(t)
	w := connectWrap(t, bins, revisions[1], []string{"--policy-file", writePolicy(t, wrapRefundPassthrough)}, count.env())

	args := map[string]any{"card": "7777", "amount": 99, "delayMs": 1500}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err := call(ctx, w.cs, "charge_card", args, nil)
	cancel()
	if err == nil {
		t.Fatal("the call that timed out after 300ms succeeded; it takes 1.5s")
	}
	retry := mustCall(t, w.cs, "charge_card", args, nil)
	if !replayed(retry) {
		t.Errorf("the retry after a cancelled call is not replayed: %s", body(t, retry))
	}
	if n := count.get(t, "charge_card"); n != 1 {
		t.Errorf("charge_card ran %d times, want 1", n)
	}
	if n := count.get(t, "cancelled charge_card"); n != 0 {
		t.Errorf("the server saw the client's cancel of a deduplicated charge %d times; it must not", n)
	}

	ctx, cancel = context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err = call(ctx, w.cs, "refund", args, nil)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("refund that timed out: err = %v, want a deadline error", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for count.get(t, "cancelled refund") == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := count.get(t, "cancelled refund"); n != 1 {
		t.Errorf("the server saw the cancel of a Passthrough refund %d times, want 1", n)
	}
	if code := w.close(t); code != 0 {
		t.Errorf("idemcp wrap exited with %d, want 0", code)
	}
}
