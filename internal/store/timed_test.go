package store_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/store/storetest"
)

// The timing layer keeps the store's contract.
func TestTimedContract(t *testing.T) {
	storetest.Run(t, func(*testing.T) store.Store {
		return store.Timed(store.NewMemory(0), func(string, time.Duration) {})
	})
}

func TestTimedReportsEachRoundTripButWait(t *testing.T) {
	var mu sync.Mutex
	var ops []string
	st := store.Timed(store.NewMemory(0), func(op string, d time.Duration) {
		if d < 0 {
			t.Errorf("%s took %s", op, d)
		}
		mu.Lock()
		ops = append(ops, op)
		mu.Unlock()
	})
	ctx := context.Background()
	c := store.Claim{Key: "k", Fingerprint: "f", Owner: "o", Lease: time.Minute, Retention: time.Minute}
	if _, err := st.Reserve(ctx, c); err != nil {
		t.Fatal(err)
	}
	if err := st.Renew(ctx, "k", "o", time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := st.Complete(ctx, "k", "o", []byte(`{}`), time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := st.Wait(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	// A failed round trip is timed too; whether this one fails is the
	// store's business.
	_ = st.Release(ctx, "k", "o")
	if err := st.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	want := []string{store.OpReserve, store.OpRenew, store.OpComplete, store.OpRelease, store.OpPing}
	mu.Lock()
	defer mu.Unlock()
	if len(ops) != len(want) {
		t.Fatalf("observed %v, want %v", ops, want)
	}
	for i := range want {
		if ops[i] != want[i] {
			t.Fatalf("observed %v, want %v", ops, want)
		}
	}
}
