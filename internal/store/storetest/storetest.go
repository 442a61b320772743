// Package storetest is the contract every store.Store passes. A store's own
// tests call Run with a constructor; each subtest gets a fresh store.
package storetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/store"
)

// Lease is the lease the suite uses where one must run out; stores whose
// expiry is coarser than this cannot pass.
const Lease = 400 * time.Millisecond

// Run runs the contract against stores made by newStore.
func Run(t *testing.T, newStore func(t *testing.T) store.Store) {
	t.Helper()
	run(t, newStore, true)
}

// RunCore runs the contract without Claim.Discard, which is about the
// bytes a store holds: a sealed store's callers never see those, since
// the sealing layer sets Discard itself.
func RunCore(t *testing.T, newStore func(t *testing.T) store.Store) {
	t.Helper()
	run(t, newStore, false)
}

func run(t *testing.T, newStore func(t *testing.T) store.Store, discard bool) {
	t.Helper()
	tests := []struct {
		name string
		fn   func(t *testing.T, s store.Store)
	}{
		{"FirstReserveWins", testFirstReserveWins},
		{"CompleteThenReplay", testCompleteThenReplay},
		{"ReleaseLetsNextCallRun", testRelease},
		{"StaleOwnerCannotTouchNewClaim", testStaleOwner},
		{"AbandonedWithoutTakeOver", testAbandoned},
		{"OtherFingerprintIsNeverTakenOver", testOtherFingerprint},
		{"RenewKeepsClaimAlive", testRenew},
		{"WaitWakesOnComplete", testWaitComplete},
		{"WaitWakesOnRelease", testWaitRelease},
		{"WaitWakesWhenLeaseRunsOut", testWaitLease},
		{"WaitReturnsAtOnceWhenNotPending", testWaitNotPending},
		{"WaitHonoursContext", testWaitContext},
		{"CompletedRecordExpires", testExpiry},
		{"ConcurrentReservesOneWinner", testConcurrent},
		{"KeysAreIndependent", testIndependent},
		{"InspectorListsAndDrops", testInspector},
		{"Ping", func(t *testing.T, s store.Store) {
			if err := s.Ping(context.Background()); err != nil {
				t.Fatalf("Ping: %v", err)
			}
		}},
	}
	if discard {
		tests = append(tests, []struct {
			name string
			fn   func(t *testing.T, s store.Store)
		}{
			{"DiscardReplacesOnlyThatResult", testDiscard},
			{"ConcurrentDiscardsOneWinner", testConcurrentDiscard},
		}...)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t)
			t.Cleanup(func() { _ = s.Close() })
			tt.fn(t, s)
		})
	}
}

func token() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func claim(key string) store.Claim {
	return store.Claim{Key: key, Fingerprint: "fp-" + key, Owner: token(), Lease: 10 * time.Second, Retention: time.Minute, TakeOver: true}
}

func reserve(t *testing.T, s store.Store, c store.Claim) store.Reservation {
	t.Helper()
	r, err := s.Reserve(context.Background(), c)
	if err != nil {
		t.Fatalf("Reserve(%s): %v", c.Key, err)
	}
	return r
}

func want(t *testing.T, r store.Reservation, state store.State) {
	t.Helper()
	if r.State != state {
		t.Fatalf("state = %s, want %s", r.State, state)
	}
}

func testFirstReserveWins(t *testing.T, s store.Store) {
	key := token()
	c := claim(key)
	want(t, reserve(t, s, c), store.Won)
	other := claim(key)
	r := reserve(t, s, other)
	want(t, r, store.Pending)
	if r.Fingerprint != c.Fingerprint {
		t.Errorf("pending fingerprint = %q, want %q", r.Fingerprint, c.Fingerprint)
	}
}

func testCompleteThenReplay(t *testing.T, s store.Store) {
	ctx := context.Background()
	key := token()
	c := claim(key)
	want(t, reserve(t, s, c), store.Won)
	resp := []byte(`{"jsonrpc":"2.0","result":{"content":[]}}`)
	if err := s.Complete(ctx, key, c.Owner, resp, time.Minute); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	for range 3 {
		r := reserve(t, s, claim(key))
		want(t, r, store.Completed)
		if string(r.Response) != string(resp) || r.Fingerprint != c.Fingerprint {
			t.Fatalf("replay = %q/%q, want %q/%q", r.Response, r.Fingerprint, resp, c.Fingerprint)
		}
	}
	if err := s.Complete(ctx, key, c.Owner, []byte("again"), time.Minute); !errors.Is(err, store.ErrNotOwner) {
		t.Errorf("second Complete = %v, want ErrNotOwner", err)
	}
	if err := s.Release(ctx, key, c.Owner); !errors.Is(err, store.ErrNotOwner) {
		t.Errorf("Release after Complete = %v, want ErrNotOwner (a stored result is never deleted by its owner)", err)
	}
}

func testRelease(t *testing.T, s store.Store) {
	ctx := context.Background()
	key := token()
	c := claim(key)
	want(t, reserve(t, s, c), store.Won)
	if err := s.Release(ctx, key, "someone-else"); !errors.Is(err, store.ErrNotOwner) {
		t.Errorf("Release by a stranger = %v, want ErrNotOwner", err)
	}
	want(t, reserve(t, s, claim(key)), store.Pending)
	if err := s.Release(ctx, key, c.Owner); err != nil {
		t.Fatalf("Release: %v", err)
	}
	want(t, reserve(t, s, claim(key)), store.Won)
}

func testStaleOwner(t *testing.T, s store.Store) {
	ctx := context.Background()
	key := token()
	old := claim(key)
	old.Lease = Lease
	want(t, reserve(t, s, old), store.Won)
	time.Sleep(Lease + 200*time.Millisecond)
	next := claim(key)
	r := reserve(t, s, next)
	want(t, r, store.Won)
	if !r.TookOver {
		t.Error("TookOver = false for a claim whose lease ran out")
	}
	if err := s.Complete(ctx, key, old.Owner, []byte("stale"), time.Minute); !errors.Is(err, store.ErrNotOwner) {
		t.Errorf("stale Complete = %v, want ErrNotOwner", err)
	}
	if err := s.Release(ctx, key, old.Owner); !errors.Is(err, store.ErrNotOwner) {
		t.Errorf("stale Release = %v, want ErrNotOwner", err)
	}
	if err := s.Renew(ctx, key, old.Owner, time.Minute); !errors.Is(err, store.ErrNotOwner) {
		t.Errorf("stale Renew = %v, want ErrNotOwner", err)
	}
	want(t, reserve(t, s, claim(key)), store.Pending)
	if err := s.Complete(ctx, key, next.Owner, []byte("fresh"), time.Minute); err != nil {
		t.Fatalf("new owner's Complete: %v", err)
	}
	r = reserve(t, s, claim(key))
	want(t, r, store.Completed)
	if string(r.Response) != "fresh" {
		t.Errorf("response = %q, want the new owner's", r.Response)
	}
}

func testAbandoned(t *testing.T, s store.Store) {
	key := token()
	c := claim(key)
	c.Lease = Lease
	want(t, reserve(t, s, c), store.Won)
	time.Sleep(Lease + 200*time.Millisecond)
	cautious := claim(key)
	cautious.TakeOver = false
	r := reserve(t, s, cautious)
	want(t, r, store.Abandoned)
	if r.Fingerprint != c.Fingerprint {
		t.Errorf("abandoned fingerprint = %q, want %q", r.Fingerprint, c.Fingerprint)
	}
	// Still abandoned for the next cautious caller: nobody took it.
	want(t, reserve(t, s, cautious), store.Abandoned)
}

// An explicit key reused with other arguments finds the first call's
// fingerprint whatever became of it, so the engine refuses it: a taken-over
// claim would run the other arguments under the first call's key.
func testOtherFingerprint(t *testing.T, s store.Store) {
	ctx := context.Background()
	other := func(key string) store.Claim {
		c := claim(key)
		c.Fingerprint = "fp-other-arguments"
		return c
	}
	check := func(r store.Reservation, first store.Claim, state store.State) {
		t.Helper()
		want(t, r, state)
		if r.Fingerprint != first.Fingerprint {
			t.Errorf("%s record's fingerprint = %q, want the first call's %q", state, r.Fingerprint, first.Fingerprint)
		}
	}

	pending := claim(token())
	want(t, reserve(t, s, pending), store.Won)
	check(reserve(t, s, other(pending.Key)), pending, store.Pending)

	done := claim(token())
	want(t, reserve(t, s, done), store.Won)
	if err := s.Complete(ctx, done.Key, done.Owner, []byte("r"), time.Minute); err != nil {
		t.Fatal(err)
	}
	check(reserve(t, s, other(done.Key)), done, store.Completed)

	dead := claim(token())
	dead.Lease = Lease
	want(t, reserve(t, s, dead), store.Won)
	time.Sleep(Lease + 200*time.Millisecond)
	check(reserve(t, s, other(dead.Key)), dead, store.Abandoned)
	// The claim is still the first call's: a retry of it takes it over.
	r := reserve(t, s, claim(dead.Key))
	want(t, r, store.Won)
	if !r.TookOver {
		t.Error("a retry with the first call's arguments did not take its abandoned claim over")
	}
}

func testRenew(t *testing.T, s store.Store) {
	ctx := context.Background()
	key := token()
	c := claim(key)
	c.Lease = Lease
	want(t, reserve(t, s, c), store.Won)
	for range 3 {
		time.Sleep(Lease / 2)
		if err := s.Renew(ctx, key, c.Owner, Lease); err != nil {
			t.Fatalf("Renew: %v", err)
		}
	}
	want(t, reserve(t, s, claim(key)), store.Pending)
}

func waitAsync(s store.Store, key string) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- s.Wait(context.Background(), key) }()
	return ch
}

func expectWake(t *testing.T, ch <-chan error, within time.Duration) {
	t.Helper()
	select {
	case err := <-ch:
		if err != nil {
			t.Fatalf("Wait: %v", err)
		}
	case <-time.After(within):
		t.Fatalf("Wait did not return within %v", within)
	}
}

func expectBlocked(t *testing.T, ch <-chan error) {
	t.Helper()
	select {
	case err := <-ch:
		t.Fatalf("Wait returned early (%v) while the claim is pending", err)
	case <-time.After(150 * time.Millisecond):
	}
}

func testWaitComplete(t *testing.T, s store.Store) {
	key := token()
	c := claim(key)
	want(t, reserve(t, s, c), store.Won)
	ch := waitAsync(s, key)
	expectBlocked(t, ch)
	if err := s.Complete(context.Background(), key, c.Owner, []byte("r"), time.Minute); err != nil {
		t.Fatal(err)
	}
	expectWake(t, ch, 2*time.Second)
	want(t, reserve(t, s, claim(key)), store.Completed)
}

func testWaitRelease(t *testing.T, s store.Store) {
	key := token()
	c := claim(key)
	want(t, reserve(t, s, c), store.Won)
	ch := waitAsync(s, key)
	expectBlocked(t, ch)
	if err := s.Release(context.Background(), key, c.Owner); err != nil {
		t.Fatal(err)
	}
	expectWake(t, ch, 2*time.Second)
	want(t, reserve(t, s, claim(key)), store.Won)
}

func testWaitLease(t *testing.T, s store.Store) {
	key := token()
	c := claim(key)
	c.Lease = Lease
	want(t, reserve(t, s, c), store.Won)
	ch := waitAsync(s, key)
	expectWake(t, ch, Lease+2*time.Second)
}

func testWaitNotPending(t *testing.T, s store.Store) {
	expectWake(t, waitAsync(s, token()), time.Second)
	key := token()
	c := claim(key)
	want(t, reserve(t, s, c), store.Won)
	if err := s.Complete(context.Background(), key, c.Owner, []byte("r"), time.Minute); err != nil {
		t.Fatal(err)
	}
	expectWake(t, waitAsync(s, key), time.Second)
}

func testWaitContext(t *testing.T, s store.Store) {
	key := token()
	want(t, reserve(t, s, claim(key)), store.Won)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := s.Wait(ctx, key)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait = %v, want context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Wait ignored its context for %v", d)
	}
}

func testExpiry(t *testing.T, s store.Store) {
	key := token()
	c := claim(key)
	want(t, reserve(t, s, c), store.Won)
	if err := s.Complete(context.Background(), key, c.Owner, []byte("r"), Lease); err != nil {
		t.Fatal(err)
	}
	want(t, reserve(t, s, claim(key)), store.Completed)
	time.Sleep(Lease + 200*time.Millisecond)
	want(t, reserve(t, s, claim(key)), store.Won)
}

func testConcurrent(t *testing.T, s store.Store) {
	key := token()
	var wins atomic.Int32
	var wg sync.WaitGroup
	errs := make(chan error, 50)
	for range 50 {
		wg.Go(func() {
			r, err := s.Reserve(context.Background(), claim(key))
			if err != nil {
				errs <- err
				return
			}
			if r.State == store.Won {
				wins.Add(1)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("Reserve: %v", err)
	}
	if n := wins.Load(); n != 1 {
		t.Fatalf("%d of 50 concurrent reserves won, want exactly 1", n)
	}
}

func testIndependent(t *testing.T, s store.Store) {
	a, b := claim(token()), claim(token())
	want(t, reserve(t, s, a), store.Won)
	want(t, reserve(t, s, b), store.Won)
}

// A result the sealing layer could not open is replaced by exactly one
// claim, and only while it is still that very result.
func testDiscard(t *testing.T, s store.Store) {
	ctx := context.Background()
	key := token()
	first := claim(key)
	want(t, reserve(t, s, first), store.Won)
	if err := s.Complete(ctx, key, first.Owner, []byte("unopenable"), time.Minute); err != nil {
		t.Fatal(err)
	}
	other := claim(key)
	other.Discard = []byte("another result")
	r := reserve(t, s, other)
	want(t, r, store.Completed)
	if string(r.Response) != "unopenable" {
		t.Fatalf("a Discard of other bytes changed the result to %q", r.Response)
	}

	c := claim(key)
	c.Discard = []byte("unopenable")
	r = reserve(t, s, c)
	want(t, r, store.Won)
	if r.TookOver {
		t.Error("TookOver = true for a discarded result; it reports abandoned claims only")
	}
	// The discarded result is gone for everyone: the new claim holds the key.
	again := claim(key)
	again.Discard = []byte("unopenable")
	want(t, reserve(t, s, again), store.Pending)
	if err := s.Complete(ctx, key, c.Owner, []byte("fresh"), time.Minute); err != nil {
		t.Fatalf("Complete by the claim that replaced the result: %v", err)
	}
	r = reserve(t, s, claim(key))
	want(t, r, store.Completed)
	if string(r.Response) != "fresh" {
		t.Errorf("response = %q, want the new claim's", r.Response)
	}

	// A pending claim is never discarded, whatever the bytes.
	p := claim(token())
	want(t, reserve(t, s, p), store.Won)
	d := claim(p.Key)
	d.Discard = []byte{}
	want(t, reserve(t, s, d), store.Pending)
}

func testConcurrentDiscard(t *testing.T, s store.Store) {
	ctx := context.Background()
	key := token()
	first := claim(key)
	want(t, reserve(t, s, first), store.Won)
	if err := s.Complete(ctx, key, first.Owner, []byte("unopenable"), time.Minute); err != nil {
		t.Fatal(err)
	}
	var wins atomic.Int32
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for range 20 {
		wg.Go(func() {
			c := claim(key)
			c.Discard = []byte("unopenable")
			r, err := s.Reserve(ctx, c)
			switch {
			case err != nil:
				errs <- err
			case r.State == store.Won:
				wins.Add(1)
			case r.State != store.Pending && r.State != store.Completed:
				errs <- errors.New("state " + r.State.String())
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("Reserve with Discard: %v", err)
	}
	if n := wins.Load(); n != 1 {
		t.Fatalf("%d of 20 concurrent reserves discarding one result won, want exactly 1", n)
	}
}

// testInspector: a store an operator may inspect (kubectl idemcp keys)
// lists each record with its tool, pod and state, and drops only what is
// asked: a claim whose lease ran out (release), a stored result (forget),
// never a live claim. Stores that are not inspectable skip it.
func testInspector(t *testing.T, s store.Store) {
	in, ok := store.InspectorOf(s)
	if !ok {
		t.Skip("this store does not list its records")
	}
	ctx := context.Background()
	live, done, lapsed := claim(token()), claim(token()), claim(token())
	for i, c := range []*store.Claim{&live, &done, &lapsed} {
		c.Tool, c.Pod = fmt.Sprintf("tool-%d", i), "mcp-0"
	}
	lapsed.Lease = Lease
	for _, c := range []store.Claim{live, done, lapsed} {
		want(t, reserve(t, s, c), store.Won)
	}
	if err := s.Complete(ctx, done.Key, done.Owner, []byte("result"), time.Minute); err != nil {
		t.Fatal(err)
	}
	time.Sleep(Lease + 200*time.Millisecond)

	recs, err := in.Records(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	got := map[string]store.Record{}
	for _, r := range recs {
		got[r.Key] = r
	}
	for _, tc := range []struct {
		c     store.Claim
		state store.RecordState
	}{{live, store.StatePending}, {done, store.StateCompleted}, {lapsed, store.StateOutcomeUnknown}} {
		r, ok := got[tc.c.Key]
		switch {
		case !ok:
			t.Fatalf("Records lists %+v, without %s", recs, tc.c.Key)
		case r.State(now) != tc.state || r.Tool != tc.c.Tool || r.Pod != "mcp-0":
			t.Errorf("record %s is %s of %q by %q, want %s of %q by mcp-0", tc.c.Key, r.State(now), r.Tool, r.Pod, tc.state, tc.c.Tool)
		case r.Claimed.IsZero() || now.Sub(r.Claimed) > time.Minute || !r.Expires.After(now):
			t.Errorf("record %s was claimed at %v and expires at %v, want within the last minute and later than now", tc.c.Key, r.Claimed, r.Expires)
		}
	}
	if r, resp, err := in.Lookup(ctx, done.Key); err != nil || !r.Completed || string(resp) != "result" {
		t.Errorf("Lookup of the result: %+v %q %v", r, resp, err)
	}

	for _, tc := range []struct {
		key  string
		d    store.Drop
		want error
	}{
		{live.Key, store.DropClaim, store.ErrLeaseLive},
		{done.Key, store.DropClaim, store.ErrWrongState},
		{lapsed.Key, store.DropResult, store.ErrWrongState},
		{token(), store.DropClaim, store.ErrNoRecord},
	} {
		if _, err := in.Drop(ctx, tc.key, tc.d); !errors.Is(err, tc.want) {
			t.Errorf("Drop(%s, %v) = %v, want %v", tc.key, tc.d, err, tc.want)
		}
	}
	// Refused drops leave the records as they were.
	want(t, reserve(t, s, claim(done.Key)), store.Completed)
	cautious := lapsed
	cautious.Owner, cautious.TakeOver = token(), false
	want(t, reserve(t, s, cautious), store.Abandoned)

	if r, err := in.Drop(ctx, lapsed.Key, store.DropClaim); err != nil || r.Tool != lapsed.Tool {
		t.Fatalf("releasing the lapsed claim: %+v %v", r, err)
	}
	want(t, reserve(t, s, cautious), store.Won)
	if _, err := in.Drop(ctx, done.Key, store.DropResult); err != nil {
		t.Fatalf("forgetting the result: %v", err)
	}
	again := claim(done.Key)
	want(t, reserve(t, s, again), store.Won)
}
