package store_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/store/storetest"
)

func TestMemoryContract(t *testing.T) {
	storetest.Run(t, func(*testing.T) store.Store { return store.NewMemory(0) })
}

func TestMemoryBounded(t *testing.T) {
	ctx := context.Background()
	m := store.NewMemory(3)
	defer func() { _ = m.Close() }()
	claim := func(k string) store.Claim {
		return store.Claim{Key: k, Fingerprint: k, Owner: "o-" + k, Lease: time.Minute, Retention: time.Hour}
	}
	for i := range 3 {
		k := fmt.Sprint(i)
		if _, err := m.Reserve(ctx, claim(k)); err != nil {
			t.Fatal(err)
		}
		if err := m.Complete(ctx, k, "o-"+k, []byte(k), time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	if r, _ := m.Reserve(ctx, claim("new")); r.State != store.Won {
		t.Fatalf("reserve in a full store = %s, want won", r.State)
	}
	if m.Len() != 3 {
		t.Errorf("Len = %d, want the bound 3", m.Len())
	}
	if r, _ := m.Reserve(ctx, claim("0")); r.State != store.Won {
		t.Errorf("oldest completed record survived eviction: %s", r.State)
	}
	if r, _ := m.Reserve(ctx, claim("other")); r.State != store.Won {
		t.Fatalf("reserve = %s, want won", r.State)
	}
	// Now all three entries are pending: a fourth claim is refused, not
	// made room for by dropping someone's claim.
	_, err := m.Reserve(ctx, claim("full"))
	if err == nil {
		t.Fatal("a store full of pending claims accepted another")
	}
	if !errors.Is(err, store.ErrUnavailable) {
		t.Errorf("full-store error %v does not wrap ErrUnavailable", err)
	}
}

// TestMemoryFullSweepsExpiredFirst: a full store whose last sweep is over
// a second old makes room with its expired records before it evicts a
// live one: a retry of a live record still finds it.
func TestMemoryFullSweepsExpiredFirst(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	m := store.NewMemory(3)
	m.SetClock(func() time.Time { return now })
	defer func() { _ = m.Close() }()
	put := func(k string, ttl time.Duration) {
		t.Helper()
		c := store.Claim{Key: k, Fingerprint: k, Owner: "o-" + k, Lease: time.Minute, Retention: ttl}
		if r, err := m.Reserve(ctx, c); err != nil || r.State != store.Won {
			t.Fatalf("reserve %s = %v, %v", k, r.State, err)
		}
		if err := m.Complete(ctx, k, "o-"+k, []byte(k), ttl); err != nil {
			t.Fatal(err)
		}
	}
	replayed := func(k string) bool {
		r, err := m.Reserve(ctx, store.Claim{Key: k, Fingerprint: k, Owner: "retry", Lease: time.Minute, Retention: time.Hour})
		return err == nil && r.State == store.Completed
	}
	put("old-live", time.Hour)
	put("live", time.Hour)
	put("short", 2*time.Minute)
	put("full-now", time.Hour) // full: evicts the oldest, old-live
	now = now.Add(5 * time.Minute)
	put("later", time.Hour) // short has expired: it goes, not live
	if !replayed("live") || !replayed("full-now") || !replayed("later") {
		t.Errorf("a live record was evicted while an expired one was there (live %v, full-now %v, later %v)", replayed("live"), replayed("full-now"), replayed("later"))
	}
}

// 300 distinct 1 MB results in a store bounded to 64 MiB: the oldest
// completed results make room, the memory held stays under the bound, and a
// pending claim is never evicted to make room.
func TestMemoryBoundedInBytes(t *testing.T) {
	ctx := context.Background()
	const bound = 64 << 20
	m := store.NewMemorySized(0, bound)
	defer func() { _ = m.Close() }()
	pending := store.Claim{Key: "pending", Fingerprint: "fp", Owner: "o-pending", Lease: time.Minute, Retention: time.Hour}
	if r, err := m.Reserve(ctx, pending); err != nil || r.State != store.Won {
		t.Fatalf("Reserve(pending) = %v, %v", r.State, err)
	}
	result := make([]byte, 1<<20)
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range 300 {
		k := fmt.Sprint("k", i)
		c := store.Claim{Key: k, Fingerprint: k, Owner: "o-" + k, Lease: time.Minute, Retention: time.Hour}
		if r, err := m.Reserve(ctx, c); err != nil || r.State != store.Won {
			t.Fatalf("Reserve(%s) = %v, %v", k, r.State, err)
		}
		if err := m.Complete(ctx, k, c.Owner, bytes.Clone(result), time.Hour); err != nil {
			t.Fatal(err)
		}
		if b := m.Bytes(); b > bound {
			t.Fatalf("after %d results the store holds %d bytes, over its %d bound", i+1, b, bound)
		}
	}
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grown := int64(after.HeapAlloc) - int64(before.HeapAlloc); grown > bound+8<<20 {
		t.Errorf("the heap grew by %d MiB for a store bounded to %d MiB", grown>>20, bound>>20)
	}
	if n := m.Len(); n < 60 || n > 64 {
		t.Errorf("the store keeps %d records of 1 MiB under a 64 MiB bound, want about 63", n)
	}
	if r, _ := m.Reserve(ctx, store.Claim{Key: "k299", Fingerprint: "k299", Owner: "x", Lease: time.Minute}); r.State != store.Completed {
		t.Errorf("the newest result was evicted: %s", r.State)
	}
	if r, _ := m.Reserve(ctx, store.Claim{Key: "k0", Fingerprint: "k0", Owner: "x", Lease: time.Minute}); r.State != store.Won {
		t.Errorf("the oldest result survived: %s", r.State)
	}
	if r, _ := m.Reserve(ctx, store.Claim{Key: "pending", Fingerprint: "fp", Owner: "x", Lease: time.Minute}); r.State != store.Pending {
		t.Errorf("the pending claim was evicted to make room: %s", r.State)
	}
	// A result larger than the whole bound is still kept: dropping it
	// would let its retry run the call again.
	small := store.NewMemorySized(0, 1<<20)
	defer func() { _ = small.Close() }()
	c := store.Claim{Key: "big", Fingerprint: "big", Owner: "o", Lease: time.Minute}
	_, _ = small.Reserve(ctx, c)
	if err := small.Complete(ctx, "big", "o", make([]byte, 2<<20), time.Hour); err != nil {
		t.Fatal(err)
	}
	if r, _ := small.Reserve(ctx, store.Claim{Key: "big", Fingerprint: "big", Owner: "x", Lease: time.Minute}); r.State != store.Completed {
		t.Errorf("a result over the whole bound was dropped: %s", r.State)
	}
}
