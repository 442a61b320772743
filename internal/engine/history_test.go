package engine

import (
	"context"
	"encoding/json"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/idemcp/idemcp/internal/store"
)

// caller runs calls through e as one caller, counting what ran upstream.
type caller struct {
	t   *testing.T
	e   *Engine
	c   Caller
	ran *atomic.Int32
}

func (c caller) call(params string) Kind {
	c.t.Helper()
	tc, err := ParseToolCall(json.RawMessage(params))
	if err != nil {
		c.t.Fatal(err)
	}
	p, err := c.e.Plan(tc, c.c)
	if err != nil || p == nil {
		c.t.Fatalf("Plan(%s) = %v, %v", params, p, err)
	}
	out, err := c.e.Execute(context.Background(), p, func(context.Context) (Upstream, error) {
		n := c.ran.Add(1)
		return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"run":` + strconv.Itoa(int(n)) + `}}`), Status: 200}, nil
	})
	if err != nil {
		c.t.Fatalf("Execute(%s): %v", params, err)
	}
	return out.Kind
}

// TestPolicyChangeRunsNothingAgain: after a change of keyScope, then of a
// tool's ignoreArguments, retries of calls stored before either change
// are replayed; a new call still runs, and its retry is replayed.
func TestPolicyChangeRunsNothingAgain(t *testing.T) {
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Session}"), Store: store.NewMemory(0), KeySpace: "Deployment/api"})
	var ran atomic.Int32
	a := caller{t, e, Caller{Principal: "Bearer alice", Session: "s1"}, &ran}
	const derived = `{"name":"charge","arguments":{"amount":5,"requestedAt":"10:00"}}`
	const explicit = `{"name":"charge","arguments":{"amount":7,"requestedAt":"10:00"},"_meta":{"idempotency-key":"k1"}}`
	if a.call(derived) != Executed || a.call(explicit) != Executed || ran.Load() != 2 {
		t.Fatalf("first calls: %d ran, want 2", ran.Load())
	}

	e.SetPolicy(mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Principal}"))
	if k := a.call(derived); k != Replayed {
		t.Fatalf("retry after keyScope Session -> Principal: %v, want replayed (ran %d)", k, ran.Load())
	}
	e.SetPolicy(mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Principal, tools: [{name: charge, ignoreArguments: [/requestedAt]}]}"))
	for _, params := range []string{derived, explicit} {
		if k := a.call(params); k != Replayed {
			t.Fatalf("retry %s after ignoreArguments changed: %v, want replayed (ran %d)", params, k, ran.Load())
		}
	}
	if ran.Load() != 2 {
		t.Fatalf("%d calls ran, want the 2 first ones only", ran.Load())
	}
	if got := counter(e.Metrics().EarlierReplays); got != 3 {
		t.Fatalf("idemcp_replays_under_earlier_policy_total = %v, want 3", got)
	}
	// What the policy says now still holds: a new call runs, its retry,
	// under the new key only, is replayed, with another requestedAt too.
	if a.call(`{"name":"charge","arguments":{"amount":9,"requestedAt":"11:00"}}`) != Executed ||
		a.call(`{"name":"charge","arguments":{"amount":9,"requestedAt":"11:05"}}`) != Replayed || ran.Load() != 3 {
		t.Fatalf("a new call after the changes: %d ran, want 3", ran.Load())
	}
}

// TestKeySpacePerWorkload: two workloads under one policy and one store,
// same principal, tool and arguments: each runs once and replays its own
// result; two that share a key space share results.
func TestKeySpacePerWorkload(t *testing.T) {
	mem := store.NewMemory(0)
	spec := mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Principal}")
	var ranA, ranB, ranBlue, ranGreen atomic.Int32
	who := Caller{Principal: "Bearer alice"}
	a := caller{t, New(Options{Policy: spec, Store: mem, KeySpace: "Deployment/orders"}), who, &ranA}
	b := caller{t, New(Options{Policy: spec, Store: mem, KeySpace: "Deployment/billing"}), who, &ranB}
	const call = `{"name":"charge","arguments":{"amount":5}}`
	if a.call(call) != Executed || b.call(call) != Executed || a.call(call) != Replayed || b.call(call) != Replayed {
		t.Fatal("two workloads: want each to run once and replay its own")
	}
	if ranA.Load() != 1 || ranB.Load() != 1 {
		t.Fatalf("orders ran %d, billing ran %d; want 1 each", ranA.Load(), ranB.Load())
	}
	blue := caller{t, New(Options{Policy: spec, Store: mem, KeySpace: "shop"}), who, &ranBlue}
	green := caller{t, New(Options{Policy: spec, Store: mem, KeySpace: "shop"}), who, &ranGreen}
	if blue.call(call) != Executed || green.call(call) != Replayed || ranGreen.Load() != 0 {
		t.Fatal("blue/green sharing a key space: want green to replay blue's result")
	}
}
