package claim_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/idempotency"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// The fault suite: the same faults, on every store, through both front
// ends of the claim protocol (the sidecar's engine and idempotency.Group).
// Each front end stands for one process; two of them on one store are two
// processes sharing it. Faults are injected by wrapping the store one
// process sees. Nothing here sleeps: a test waits for a signal, or for the
// store to report that a lease ran out.

// lease is long enough that a loaded machine renews well within it; the
// tests that wait for a lease to run out take about this long.
const lease = 1500 * time.Millisecond

// config is what a front end is opened with.
type config struct {
	abandonedError bool
}

// frontEnd is one process running calls through the claim protocol.
type frontEnd interface {
	// do runs fn at most once for key and returns its value, or the value
	// stored by the call that ran.
	do(ctx context.Context, key string, fn func(context.Context) (string, error)) (value string, replayed bool, err error)
}

// Outcomes both front ends answer, each in its own words.
func inFlight(err error) bool {
	var ee *engine.Error
	return errors.Is(err, idempotency.ErrInFlight) || errors.As(err, &ee) && ee.Code == mcpmsg.CodeInFlight
}

func outcomeUnknown(err error) bool {
	var ee *engine.Error
	return errors.Is(err, idempotency.ErrOutcomeUnknown) || errors.As(err, &ee) && ee.Code == mcpmsg.CodeOutcomeUnknown
}

var frontEnds = map[string]func(t *testing.T, st store.Store, c config) frontEnd{
	"Engine": openEngine,
	"Group":  openGroup,
}

type groupFrontEnd struct{ g *idempotency.Group }

func openGroup(_ *testing.T, st store.Store, c config) frontEnd {
	return groupFrontEnd{idempotency.NewGroup(st, idempotency.Options{Lease: lease, WaitTimeout: 4 * lease, AbandonedError: c.abandonedError})}
}

func (f groupFrontEnd) do(ctx context.Context, key string, fn func(context.Context) (string, error)) (string, bool, error) {
	v, replayed, err := f.g.Do(ctx, key, "fp", func(ctx context.Context) ([]byte, error) {
		v, err := fn(ctx)
		return []byte(v), err
	})
	return string(v), replayed, err
}

type engineFrontEnd struct{ e *engine.Engine }

func openEngine(t *testing.T, st store.Store, c config) frontEnd {
	abandoned := "Retry"
	if c.abandonedError {
		abandoned = "Error"
	}
	pol, err := policy.Parse(fmt.Appendf(nil, "spec: {defaultMode: Deduplicate, leaseDuration: %s, waitTimeout: %s, onAbandoned: %s}", lease, 4*lease, abandoned))
	if err != nil {
		t.Fatal(err)
	}
	return engineFrontEnd{engine.New(engine.Options{Policy: pol, Store: st})}
}

func (f engineFrontEnd) do(ctx context.Context, key string, fn func(context.Context) (string, error)) (string, bool, error) {
	tc := &engine.ToolCall{Name: "charge", Meta: map[string]json.RawMessage{"idempotency-key": json.RawMessage(strconv.Quote(key))}}
	p, err := f.e.Plan(tc, engine.Caller{Principal: "Bearer alice"})
	if err != nil || p == nil {
		return "", false, fmt.Errorf("plan: %v, %w", p, err)
	}
	var ran string
	out, err := f.e.Execute(ctx, p, func(ctx context.Context) (engine.Upstream, error) {
		v, err := fn(ctx)
		if err != nil {
			return engine.Upstream{}, err
		}
		ran = v
		return engine.Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"v":` + strconv.Quote(v) + `}}`), Status: 200}, nil
	})
	switch {
	case errors.Is(err, engine.ErrDetached):
		return "", false, ctx.Err()
	case err != nil:
		return "", false, err
	case out.Kind == engine.Replayed:
		var msg struct {
			Result struct{ V string } `json:"result"`
		}
		if err := json.Unmarshal(out.Response, &msg); err != nil {
			return "", false, err
		}
		return msg.Result.V, true, nil
	}
	return ran, false, nil
}

var stores = map[string]func(t *testing.T) store.Store{
	"Memory":         func(*testing.T) store.Store { return store.NewMemory(0) },
	"Redis":          func(t *testing.T) store.Store { return openRedis(t) },
	"RedisSealed":    func(t *testing.T) store.Store { return openRedis(t, idempotency.SealKeys(sealKey())) },
	"Postgres":       func(t *testing.T) store.Store { return openPostgres(t) },
	"PostgresSealed": func(t *testing.T) store.Store { return openPostgres(t, idempotency.SealKeys(sealKey())) },
}

func openRedis(t *testing.T, opts ...idempotency.StoreOption) store.Store {
	srv := redistest.Start(t)
	st, err := idempotency.NewRedisStore(idempotency.RedisOptions{Addrs: []string{srv.Addr}, Prefix: "fault:"}, quiet(opts)...)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func openPostgres(t *testing.T, opts ...idempotency.StoreOption) store.Store {
	srv := pgtest.Start(t)
	st, err := idempotency.NewPostgresStore(idempotency.PostgresOptions{URL: srv.URL, Prefix: "fault:"}, quiet(opts)...)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// quiet drops the store's warnings (that it is unsealed).
func quiet(opts []idempotency.StoreOption) []idempotency.StoreOption {
	return append(opts, idempotency.StoreLogger(slog.New(slog.DiscardHandler)))
}

// sealKey is a fresh seal key: every process of a test shares the store
// it is opened with, so they share its key too.
func sealKey() []byte {
	k := make([]byte, idempotency.SealKeyBytes)
	_, _ = rand.Read(k)
	return k
}

// fault is one test of the suite: open front ends on st, run the calls.
type fault func(t *testing.T, st store.Store, open func(store.Store, config) frontEnd)

var faults = map[string]fault{
	"OutageDuringTheCall":      outageDuringTheCall,
	"HungRenewal":              hungRenewal,
	"OutageAtCompletion":       outageAtCompletion,
	"PanicInTheCall":           panicInTheCall,
	"CallerCancelsAfterEffect": callerCancelsAfterEffect,
	"CancelledReserve":         cancelledReserve,
	"TakeOverOfADeadOwner":     takeOverOfADeadOwner,
}

func TestFaults(t *testing.T) {
	for storeName, openStore := range stores {
		t.Run(storeName, func(t *testing.T) {
			t.Parallel()
			st := openStore(t)
			t.Cleanup(func() { _ = st.Close() })
			for feName, openFE := range frontEnds {
				for faultName, run := range faults {
					t.Run(feName+"/"+faultName, func(t *testing.T) {
						t.Parallel()
						run(t, st, func(s store.Store, c config) frontEnd { return openFE(t, s, c) })
					})
				}
			}
		})
	}
}

func key() string { return rand.Text() }

// renewals counts a process's renewals and can fail or hang them.
type renewals struct {
	store.Store
	// fault, if set, decides the n-th renewal (from 1): an error to
	// return, or nil to pass it to the store.
	fault func(ctx context.Context, n int) error

	mu        sync.Mutex
	n         int
	failed    int
	succeeded int           // renewals that succeeded after one failed
	want      int           // how many of those close healed
	healed    chan struct{} // closed at the want-th
}

func (r *renewals) Renew(ctx context.Context, key, owner string, l time.Duration) error {
	r.mu.Lock()
	r.n++
	n := r.n
	r.mu.Unlock()
	err := r.fault(ctx, n)
	if err == nil {
		err = r.Store.Renew(ctx, key, owner, l)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case err != nil:
		r.failed++
	case r.failed > 0:
		if r.succeeded++; r.succeeded == r.want {
			close(r.healed)
		}
	}
	return err
}

// outlivesItsLease runs a call through a that lasts until the owner's
// renewals have healed (renewed the claim past where its lease would have
// ended) while a second process waits for the key: fn must run once, and
// the waiter get its result.
func outlivesItsLease(t *testing.T, a, b frontEnd, healed <-chan struct{}) {
	k := key()
	var runs atomic.Int32
	aRuns, bRuns := make(chan struct{}), make(chan struct{})
	first := make(chan error, 1)
	go func() {
		_, _, err := a.do(context.Background(), k, func(context.Context) (string, error) {
			runs.Add(1)
			close(aRuns)
			select {
			case <-healed:
			case <-bRuns: // the claim lapsed: fn runs twice, the test fails
			}
			return "first", nil
		})
		first <- err
	}()
	<-aRuns
	v, _, err := b.do(context.Background(), k, func(context.Context) (string, error) {
		runs.Add(1)
		close(bRuns)
		return "second", nil
	})
	if err := <-first; err != nil {
		t.Errorf("the first call: %v", err)
	}
	if err != nil || v != "first" || runs.Load() != 1 {
		t.Fatalf("the waiting process got %q, %v, and fn ran %d times; want the first call's result and one run: the claim lapsed while its call ran", v, err, runs.Load())
	}
}

// A short store outage while the call runs: the owner's renewals fail a
// few times. They are retried promptly, so the claim never lapses and the
// process waiting for it never runs fn.
func outageDuringTheCall(t *testing.T, st store.Store, open func(store.Store, config) frontEnd) {
	r := &renewals{Store: st, want: 3, healed: make(chan struct{}), fault: func(_ context.Context, n int) error {
		if n <= 3 {
			return fmt.Errorf("dial tcp: connection refused: %w", store.ErrUnavailable)
		}
		return nil
	}}
	outlivesItsLease(t, open(r, config{}), open(st, config{}), r.healed)
}

// A renewal that hangs is given up after its share of the lease and tried
// again, so the claim never lapses.
func hungRenewal(t *testing.T, st store.Store, open func(store.Store, config) frontEnd) {
	r := &renewals{Store: st, want: 2, healed: make(chan struct{}), fault: func(ctx context.Context, n int) error {
		if n == 1 {
			<-ctx.Done() // a store that never answers
			return ctx.Err()
		}
		return nil
	}}
	outlivesItsLease(t, open(r, config{}), open(st, config{}), r.healed)
}

// completions fails a process's first Completes.
type completions struct {
	store.Store
	fail atomic.Int32
}

func (c *completions) Complete(ctx context.Context, key, owner string, resp []byte, ttl time.Duration) error {
	if c.fail.Add(-1) >= 0 {
		return fmt.Errorf("read tcp: i/o timeout: %w", store.ErrUnavailable)
	}
	return c.Store.Complete(ctx, key, owner, resp, ttl)
}

// An outage of a few seconds when the result is stored: the store is
// retried (the lease renewed meanwhile) until it takes the result, and a
// retry gets it instead of running fn again.
func outageAtCompletion(t *testing.T, st store.Store, open func(store.Store, config) frontEnd) {
	c := &completions{Store: st}
	c.fail.Store(4) // about 2 s of failures
	a, b := open(c, config{}), open(st, config{})
	k := key()
	var runs atomic.Int32
	fn := func(v string) func(context.Context) (string, error) {
		return func(context.Context) (string, error) {
			runs.Add(1)
			return v, nil
		}
	}
	if v, _, err := a.do(context.Background(), k, fn("first")); err != nil || v != "first" {
		t.Fatalf("the first call = %q, %v", v, err)
	}
	v, replayed, err := b.do(context.Background(), k, fn("second"))
	if err != nil || v != "first" || !replayed || runs.Load() != 1 {
		t.Fatalf("the retry got %q (replayed %v), %v, and fn ran %d times; want the first call's result replayed and one run", v, replayed, err, runs.Load())
	}
}

// A panic in fn: its outcome is unknown, so its claim is kept until its
// lease runs out and onAbandoned (here Error) decides. Nothing is wedged:
// a later call in the same process gets "outcome unknown" once the lease
// is over, not a wait for a call that no longer runs.
func panicInTheCall(t *testing.T, st store.Store, open func(store.Store, config) frontEnd) {
	a := open(st, config{abandonedError: true})
	k := key()
	var runs atomic.Int32
	func() {
		defer func() { _ = recover() }() // a front end may pass the panic on
		_, _, err := a.do(context.Background(), k, func(context.Context) (string, error) {
			runs.Add(1)
			panic("a bug in fn")
		})
		if err == nil {
			t.Errorf("a call whose fn panicked answered no error")
		}
	}()
	_, _, err := a.do(context.Background(), k, func(context.Context) (string, error) {
		runs.Add(1)
		return "again", nil
	})
	if !outcomeUnknown(err) || runs.Load() != 1 {
		t.Fatalf("a later call = %v, and fn ran %d times; want outcome unknown once the lease is over, and one run", err, runs.Load())
	}
}

// The caller's context is cancelled after the side effect: the call runs
// detached from it, so its result is kept and the retry gets it.
func callerCancelsAfterEffect(t *testing.T, st store.Store, open func(store.Store, config) frontEnd) {
	a := open(st, config{})
	k := key()
	var runs atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	v, _, err := a.do(ctx, k, func(ctx context.Context) (string, error) {
		runs.Add(1) // the card is charged
		cancel()    // and the agent gives up waiting
		if err := ctx.Err(); err != nil {
			return "", err // what a client library does with a cancelled context
		}
		return "charged", nil
	})
	if err != nil && !errors.Is(err, context.Canceled) || err == nil && v != "charged" {
		t.Fatalf("the cancelled call = %q, %v; want its result or context.Canceled", v, err)
	}
	v, replayed, err := a.do(context.Background(), k, func(context.Context) (string, error) {
		runs.Add(1)
		return "charged again", nil
	})
	if err != nil || v != "charged" || !replayed || runs.Load() != 1 {
		t.Fatalf("the retry got %q (replayed %v), %v, and fn ran %d times; want the first result replayed and one run", v, replayed, err, runs.Load())
	}
}

// lostReply is a store whose first Reserve applies but whose reply is lost
// when the caller gives up on it.
type lostReply struct {
	store.Store
	once    sync.Once
	applied chan struct{}
}

func (l *lostReply) Reserve(ctx context.Context, c store.Claim) (store.Reservation, error) {
	first := false
	l.once.Do(func() { first = true })
	if !first {
		return l.Store.Reserve(ctx, c)
	}
	if _, err := l.Store.Reserve(context.WithoutCancel(ctx), c); err != nil {
		return store.Reservation{}, err
	}
	close(l.applied)
	<-ctx.Done()
	return store.Reservation{}, ctx.Err()
}

// A Reserve cancelled by its caller after the store applied it is
// released: fn never ran, so under onAbandoned: Error the next call must
// run it rather than answer "outcome unknown".
func cancelledReserve(t *testing.T, st store.Store, open func(store.Store, config) frontEnd) {
	l := &lostReply{Store: st, applied: make(chan struct{})}
	a, b := open(l, config{abandonedError: true}), open(st, config{abandonedError: true})
	k := key()
	var runs atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, _, err := a.do(ctx, k, func(context.Context) (string, error) {
			runs.Add(1)
			return "first", nil
		})
		done <- err
	}()
	<-l.applied
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) || runs.Load() != 0 {
		t.Fatalf("the cancelled call = %v, fn ran %d times; want context.Canceled and no run", err, runs.Load())
	}
	v, replayed, err := b.do(context.Background(), k, func(context.Context) (string, error) {
		runs.Add(1)
		return "second", nil
	})
	if err != nil || v != "second" || replayed || runs.Load() != 1 {
		t.Fatalf("the next call got %q (replayed %v), %v, fn ran %d times; want fn to run: the cancelled call never did", v, replayed, err, runs.Load())
	}
}

// frozen is the store as a process that stopped sees it: its lease is
// never renewed.
type frozen struct{ store.Store }

func (frozen) Renew(context.Context, string, string, time.Duration) error { return nil }

// A dead owner's claim lapses with its lease: onAbandoned: Error answers
// "outcome unknown", Retry takes it over and runs fn once more, and the
// dead owner, if it comes back, stores nothing over the new result.
func takeOverOfADeadOwner(t *testing.T, st store.Store, open func(store.Store, config) frontEnd) {
	dead := open(frozen{st}, config{})
	k := key()
	var runs atomic.Int32
	started, finish := make(chan struct{}), make(chan struct{})
	deadDone := make(chan error, 1)
	go func() {
		_, _, err := dead.do(context.Background(), k, func(context.Context) (string, error) {
			runs.Add(1)
			close(started)
			<-finish
			return "dead", nil
		})
		deadDone <- err
	}()
	<-started
	fn := func(context.Context) (string, error) {
		runs.Add(1)
		return "taken over", nil
	}
	if _, _, err := open(st, config{abandonedError: true}).do(context.Background(), k, fn); !outcomeUnknown(err) || runs.Load() != 1 {
		t.Fatalf("onAbandoned Error after the owner died = %v, fn ran %d times; want outcome unknown and no second run", err, runs.Load())
	}
	retry := open(st, config{})
	v, replayed, err := retry.do(context.Background(), k, fn)
	if err != nil || v != "taken over" || replayed || runs.Load() != 2 {
		t.Fatalf("onAbandoned Retry after the owner died = %q (replayed %v), %v, fn ran %d times; want fn run once more", v, replayed, err, runs.Load())
	}
	close(finish)
	if err := <-deadDone; err != nil && !inFlight(err) {
		t.Logf("the dead owner's call, back: %v", err)
	}
	v, replayed, err = retry.do(context.Background(), k, fn)
	if err != nil || v != "taken over" || !replayed || runs.Load() != 2 {
		t.Fatalf("a later call = %q (replayed %v), %v, fn ran %d times; want the take-over's result replayed", v, replayed, err, runs.Load())
	}
}
