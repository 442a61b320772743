package engine

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// legacyStore is one real redis-server, shared by the old and new pods of
// one policy, as a managed Redis is.
func legacyStore(t *testing.T) store.Store {
	t.Helper()
	srv := redistest.Start(t)
	st, err := redisstore.New(redisstore.Options{Addrs: []string{srv.Addr}, Prefix: "idemcp:{shop/payments}:"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return st
}

// TestUpgradeToKeySpacesRunsNothingAgain: calls stored by a pod of an
// idemcp without key spaces (an engine with none) are replayed by a new
// pod (an engine with its key space) told that such records may be kept
// until a deadline; after the deadline they are not looked for.
func TestUpgradeToKeySpacesRunsNothingAgain(t *testing.T) {
	st := legacyStore(t)
	spec := mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Principal}")
	who := Caller{Principal: "Bearer alice"}
	var ranOld, ranNew atomic.Int32
	old := caller{t, New(Options{Policy: spec, Store: st}), who, &ranOld}
	ne := New(Options{Policy: spec, Store: st, KeySpace: "Deployment/api"})
	ne.SetLegacyKeys(LegacyKeys{Until: time.Now().Add(time.Hour)})
	upgraded := caller{t, ne, who, &ranNew}

	const derived = `{"name":"charge","arguments":{"amount":5}}`
	const explicit = `{"name":"charge","arguments":{"amount":7},"_meta":{"idempotency-key":"k1"}}`
	if old.call(derived) != Executed || old.call(explicit) != Executed {
		t.Fatal("the old pod's first calls did not run")
	}
	for _, params := range []string{derived, explicit} {
		if k := upgraded.call(params); k != Replayed {
			t.Fatalf("retry of %s on the upgraded pod: %v, want replayed", params, k)
		}
	}
	if n := ranNew.Load(); n != 0 {
		t.Fatalf("%d retries ran again on the upgraded pod", n)
	}
	if got := counter(ne.Metrics().LegacyReplays); got != 2 {
		t.Errorf("idemcp_replays_under_legacy_keys_total = %v, want 2", got)
	}

	// The explicit key reused with other arguments, stored under the
	// legacy key only: the conflict error, as between two old pods.
	tc, err := ParseToolCall(json.RawMessage(`{"name":"charge","arguments":{"amount":8},"_meta":{"idempotency-key":"k1"}}`))
	if err != nil {
		t.Fatal(err)
	}
	p, err := ne.Plan(tc, who)
	if err != nil {
		t.Fatal(err)
	}
	_, err = ne.Execute(context.Background(), p, func(context.Context) (Upstream, error) {
		ranNew.Add(1)
		return Upstream{}, errors.New("must not run")
	})
	var ie *Error
	if !errors.As(err, &ie) || ie.Code != mcpmsg.CodeKeyConflict || ranNew.Load() != 0 {
		t.Fatalf("explicit key reused with other arguments: %v (ran %d), want the key conflict error", err, ranNew.Load())
	}

	// A call of the upgraded pod is stored under its key space: its retry
	// there is replayed from its own key.
	const fresh = `{"name":"charge","arguments":{"amount":6}}`
	if upgraded.call(fresh) != Executed || upgraded.call(fresh) != Replayed || counter(ne.Metrics().LegacyReplays) != 2 {
		t.Fatal("a new call on the upgraded pod: want it run once, then replayed from its own key")
	}

	// Past the deadline the legacy key is not looked for: the plan holds
	// no other key, and the old pod's record is not found.
	ne.SetLegacyKeys(LegacyKeys{Until: time.Now().Add(-time.Second)})
	tc, _ = ParseToolCall(json.RawMessage(derived))
	if p, _ := ne.Plan(tc, who); p == nil || len(p.earlier) != 0 {
		t.Fatalf("past the deadline: the plan looks under %d other keys, want none", len(p.earlier))
	}
	if upgraded.call(derived) != Executed || ranNew.Load() != 2 {
		t.Fatalf("past the deadline: %d ran on the upgraded pod, want the fresh call and this one", ranNew.Load())
	}
}

// TestLegacyWritersKeepTheOldKeys: while pods without key spaces run, a
// new pod derives its keys as they do, so a retry moved from the new pod
// to an old one (and back) is replayed; a fresh engine (no legacy keys
// ever) looks under no other key.
func TestLegacyWritersKeepTheOldKeys(t *testing.T) {
	st := legacyStore(t)
	spec := mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Principal}")
	who := Caller{Principal: "Bearer alice"}
	var ranOld, ranNew atomic.Int32
	old := caller{t, New(Options{Policy: spec, Store: st}), who, &ranOld}
	ne := New(Options{Policy: spec, Store: st, KeySpace: "Deployment/api"})
	tc, _ := ParseToolCall(json.RawMessage(`{"name":"charge","arguments":{"amount":1}}`))
	if p, _ := ne.Plan(tc, who); p == nil || len(p.earlier) != 0 {
		t.Fatal("an engine never told of legacy keys looks under another key")
	}
	ne.SetLegacyKeys(LegacyKeys{Writers: true})
	upgraded := caller{t, ne, who, &ranNew}

	const derived = `{"name":"charge","arguments":{"amount":5}}`
	const explicit = `{"name":"refund","arguments":{"amount":7},"_meta":{"idempotency-key":"k2"}}`
	for _, params := range []string{derived, explicit} {
		if upgraded.call(params) != Executed {
			t.Fatalf("%s did not run on the new pod", params)
		}
		if k := old.call(params); k != Replayed {
			t.Fatalf("retry of %s moved to the old pod: %v, want replayed", params, k)
		}
	}
	if ranOld.Load() != 0 || ranNew.Load() != 2 {
		t.Fatalf("ran %d on the old pod and %d on the new one, want 0 and 2", ranOld.Load(), ranNew.Load())
	}

	// The last old pod gone, the new pod switches to its key space: what
	// it stored before is still replayed, from the legacy key.
	ne.SetLegacyKeys(LegacyKeys{Until: time.Now().Add(time.Hour)})
	if upgraded.call(derived) != Replayed || ranNew.Load() != 2 {
		t.Fatal("after the switch to key spaces: a call stored before it ran again")
	}
	// A sidecar not told of the switch yet (still with Writers) finds
	// what a switched one stored under its key space.
	const later = `{"name":"charge","arguments":{"amount":9}}`
	if upgraded.call(later) != Executed {
		t.Fatal("a new call on the switched pod did not run")
	}
	var ranLate atomic.Int32
	late := New(Options{Policy: spec, Store: st, KeySpace: "Deployment/api"})
	late.SetLegacyKeys(LegacyKeys{Writers: true})
	if (caller{t, late, who, &ranLate}).call(later) != Replayed || ranLate.Load() != 0 {
		t.Fatal("a retry moved to a pod not yet told of the switch ran again")
	}
}
