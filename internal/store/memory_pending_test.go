package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/store"
)

// TestMemoryFullOfExpiredClaimsSweepsBeforeRefusing: a store full of
// pending claims that have all expired (abandoned, past their retention)
// sweeps before it refuses a new claim, even within a second of its last
// sweep (a sweep runs at most once a second otherwise), and wins it.
func TestMemoryFullOfExpiredClaimsSweepsBeforeRefusing(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	m := store.NewMemory(2)
	m.SetClock(func() time.Time { return now })
	defer func() { _ = m.Close() }()
	for _, k := range []string{"a", "b"} {
		if r, err := m.Reserve(ctx, store.Claim{Key: k, Fingerprint: k, Owner: "o", Lease: time.Second}); err != nil || r.State != store.Won {
			t.Fatalf("reserve %s: %v %v", k, r.State, err)
		}
	}
	now = now.Add(900 * time.Millisecond)
	if _, err := m.Reserve(ctx, store.Claim{Key: "c", Fingerprint: "c", Owner: "o", Lease: time.Second}); err == nil {
		t.Fatal("a full store of live claims took a third")
	} // swept at 900ms: nothing expired yet
	now = now.Add(300 * time.Millisecond) // a and b expired at 1000ms
	if r, err := m.Reserve(ctx, store.Claim{Key: "d", Fingerprint: "d", Owner: "o", Lease: time.Second}); err != nil || r.State != store.Won {
		t.Errorf("reserve with every other claim expired: %v, %v; want won", r.State, err)
	}
}
