package store_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemcp/idemcp/sidecar/store"
	"github.com/idemcp/idemcp/sidecar/store/storetest"
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
