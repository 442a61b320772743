package e2e_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// TestWrapSharesRedisAcrossProcesses: two wrapper processes (each with its
// own server process) on one Redis. A call with an explicit key runs once
// across both. A call without a key is scoped to its wrapper process (the
// stdio session), so each wrapper runs it once.
func TestWrapSharesRedisAcrossProcesses(t *testing.T) {
	t.Parallel()
	bins := buildWrapBins(t)
	srv := redistest.Start(t)
	count := newCounter(t)
	flags := []string{"--store", "redis", "--redis-addr", srv.Addr,
		"--redis-key-prefix", fmt.Sprintf("idemcp:e2e/shared-%d:", time.Now().UnixNano())}
	a := connectWrap(t, bins, revisions[0], flags, count.env())
	b := connectWrap(t, bins, revisions[1], flags, count.env())

	key := mcp.Meta{"idemcp.io/idempotency-key": "order-42"}
	args := map[string]any{"card": "4242", "amount": 42}
	first := mustCall(t, a.cs, "charge_card", args, key)
	second := mustCall(t, b.cs, "charge_card", args, key)
	if replayed(first) || !replayed(second) {
		t.Errorf("keyed call: first replayed=%v (want false), second through another wrapper replayed=%v (want true)", replayed(first), replayed(second))
	}
	if body(t, first) != body(t, second) {
		t.Errorf("the other wrapper's replay %s differs from the first result %s", body(t, second), body(t, first))
	}
	if n := count.get(t, "charge_card"); n != 1 {
		t.Fatalf("one keyed charge through two wrappers on one Redis ran %d times, want 1", n)
	}

	unkeyed := map[string]any{"card": "9999", "amount": 1}
	for _, w := range []*wrapped{a, b, a, b} {
		mustCall(t, w.cs, "charge_card", unkeyed, nil)
	}
	if n := count.get(t, "charge_card"); n != 3 {
		t.Errorf("charge_card ran %d times in all, want 3: the keyed one, and the unkeyed one once per wrapper (Session scope)", n)
	}
	for _, w := range []*wrapped{a, b} {
		if code := w.close(t); code != 0 {
			t.Errorf("idemcp wrap exited with %d, want 0", code)
		}
	}
}
