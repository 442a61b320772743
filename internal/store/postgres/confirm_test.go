package pgstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/store"
	pgstore "github.com/idemcp/idemcp/internal/store/postgres"
	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
	"github.com/idemcp/idemcp/test/poll"
)

// syncPair is a primary with one synchronous standby, FIRST 1 (standby).
func syncPair(t *testing.T) (primary, standby *pgtest.Server) {
	t.Helper()
	primary = pgtest.Start(t)
	standby = pgtest.StartStandby(t, primary, "standby")
	pgtest.Exec(t, primary.URL, `ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 (standby)'`)
	pgtest.Exec(t, primary.URL, `SELECT pg_reload_conf()`)
	poll.Within(t, 30*time.Second, "the standby to become synchronous", poll.True(func() bool {
		return queryInt(t, primary.URL, `SELECT count(*) FROM pg_stat_replication WHERE application_name = 'standby' AND sync_state = 'sync' AND state = 'streaming'`) == 1
	}))
	return primary, standby
}

// TestReplayWaitsForTheStandby: under synchronous replication, a stored
// result whose commit stopped waiting for the standby (the backend's wait
// cancelled: the row is visible, but the standby may not have it) is not
// replayed until a commit to its row has waited for the standby: while the
// standby is away a retry is told the call is still running, and once it
// is back the retry gets the result. A result committed normally is
// replayed at once. Before, the cancelled commit's result was replayed
// while the standby did not have it, and a failover could lose it.
func TestReplayWaitsForTheStandby(t *testing.T) {
	primary, standby := syncPair(t)
	p := prefix(t)
	owner := newStore(t, pgstore.Options{URL: primary.URL, Prefix: p})
	retry := newStore(t, pgstore.Options{URL: primary.URL, Prefix: p})
	ctx := context.Background()
	claim := func(key, who string) store.Claim {
		return store.Claim{Key: key, Fingerprint: "fp", Owner: who, Lease: 10 * time.Second, Retention: time.Hour}
	}

	// Committed normally: marked, and replayed at once.
	if r, err := owner.Reserve(ctx, claim("ok", "a")); err != nil || r.State != store.Won {
		t.Fatalf("Reserve: %v %v", r.State, err)
	}
	if err := owner.Complete(ctx, "ok", "a", []byte("ran"), time.Hour); err != nil {
		t.Fatal(err)
	}
	if r, err := retry.Reserve(ctx, claim("ok", "b")); err != nil || r.State != store.Completed || string(r.Response) != "ran" {
		t.Fatalf("a retry of a result the standby has: %v %q %v; want it replayed", r.State, r.Response, err)
	}

	// The standby goes away: a commit waits for it, until its wait is
	// cancelled, and the row is visible without the standby having it.
	if r, err := owner.Reserve(ctx, claim("cut", "a")); err != nil || r.State != store.Won {
		t.Fatalf("Reserve: %v %v", r.State, err)
	}
	standby.Stop()
	done := make(chan error, 1)
	go func() { done <- owner.Complete(context.Background(), "cut", "a", []byte("ran once"), time.Hour) }()
	poll.Within(t, 10*time.Second, "the Complete to wait for the standby (SyncRep)", poll.True(func() bool {
		return queryInt(t, primary.URL, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`) != 0
	}))
	pgtest.Exec(t, primary.URL, `SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`)
	if err := <-done; err != nil {
		t.Fatalf("the cancelled Complete: %v (PostgreSQL reports it committed)", err)
	}
	rctx, cancel := context.WithTimeout(ctx, time.Second)
	r, err := retry.Reserve(rctx, claim("cut", "b"))
	cancel()
	if err != nil || r.State != store.Pending {
		t.Fatalf("a retry while the standby may not have the result: %v %q %v; want it pending, not replayed", r.State, r.Response, err)
	}

	// The standby is back: the retry gets the result, once.
	standby.Start()
	poll.Within(t, 30*time.Second, "a retry once the standby is back to be replayed", func() error {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		r, err = retry.Reserve(rctx, claim("cut", "b"))
		switch {
		case err == nil && r.State == store.Completed:
			return nil
		case err == nil && r.State != store.Pending:
			t.Fatalf("a retry once the standby is back: %v; want pending until confirmed, then completed", r.State)
		}
		return fmt.Errorf("%v: %w", r.State, err)
	})
	if string(r.Response) != "ran once" {
		t.Fatalf("replayed %q, want the stored result", r.Response)
	}
}
