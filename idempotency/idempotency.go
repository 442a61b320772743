// Package idempotency runs costly operations at most once per key, inside
// your own Go program: the library form of what the idemcp sidecar does in
// front of an MCP server.
//
// A Group runs fn for the first call with a key, keeps its result for the
// TTL, and hands that result to every later call with the same key and
// fingerprint, without running fn again:
//
//   - Concurrent calls with the same key in one process wait for the first
//     one through an in-process map, with no store round trip.
//   - Calls in other processes sharing the store (Redis or PostgreSQL) wait
//     on the store's claim, which is leased and renewed while fn runs. A
//     process that dies mid-call loses its claim when the lease runs out:
//     the next call runs fn again (Options.OnAbandoned Retry, the default)
//     or gets ErrOutcomeUnknown (Error).
//   - Errors are not kept: when fn returns an error, the claim is released
//     and the next call runs fn again.
//   - A key reused with another fingerprint (other arguments) gets
//     ErrConflict and fn does not run.
//
// "At most once" holds while the result is kept (TTL) and while the store
// keeps its records: the memory store only within one process, Redis and
// PostgreSQL across every process that shares them.
//
// For MCP servers written with the official Go SDK, the mcpmiddleware
// subpackage applies an IdempotencyPolicy to tools/call with this
// machinery.
package idempotency

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemcp/idemcp/sidecar/store"
	pgstore "github.com/idemcp/idemcp/sidecar/store/postgres"
	redisstore "github.com/idemcp/idemcp/sidecar/store/redis"
)

// Store keeps claims and results. Use NewMemoryStore, NewRedisStore or
// NewPostgresStore; every store passes the same contract tests.
type Store = store.Store

// RedisOptions say how to reach Redis (standalone, Sentinel or Cluster).
type RedisOptions = redisstore.Options

// PostgresOptions say how to reach PostgreSQL (directly or through
// PgBouncer in transaction mode).
type PostgresOptions = pgstore.Options

// NewMemoryStore returns a store inside this process, bounded to 100,000
// records: no infrastructure, nothing shared with other processes, nothing
// survives a restart.
func NewMemoryStore() Store { return store.NewMemory(0) }

// NewRedisStore returns a store in Redis, shared by every process that
// uses the same Redis and key prefix. It does not fail when Redis is down:
// calls do, with ErrStoreUnavailable.
func NewRedisStore(o RedisOptions) (Store, error) { return redisstore.New(o) }

// NewPostgresStore returns a store in PostgreSQL, shared by every process
// that uses the same database and key prefix. It creates its tables on
// first use. It does not fail when the database is down: calls do, with
// ErrStoreUnavailable.
func NewPostgresStore(o PostgresOptions) (Store, error) { return pgstore.New(o) }

var (
	// ErrConflict means the key was already used with another fingerprint; fn
	// did not run.
	ErrConflict = errors.New("idempotency key conflict: the key was already used with a different fingerprint")
	// ErrInFlight means a call with this key is still running after WaitTimeout
	// (or, with WaitTimeout < 0, at all); fn did not run. Retry later.
	ErrInFlight = errors.New("a call with this idempotency key is still running")
	// ErrOutcomeUnknown means the first call with this key stopped mid-call (its
	// process died) and OnAbandoned is Error; fn did not run again.
	ErrOutcomeUnknown = errors.New("outcome unknown: the first call with this key stopped mid-call")
	// ErrStoreUnavailable means the store cannot be reached and FailOpen is
	// false; fn did not run.
	ErrStoreUnavailable = store.ErrUnavailable
)

// Options tune a Group. Zero values take the defaults.
type Options struct {
	// TTL is how long a result is kept and replayed (default 24h).
	TTL time.Duration
	// Lease is how long a claim lives without renewal (default 30s); it is
	// renewed every third of it while fn runs.
	Lease time.Duration
	// WaitTimeout bounds how long a duplicate waits for the first call
	// (default 30s; negative: do not wait, fail with ErrInFlight).
	WaitTimeout time.Duration
	// AbandonedError answers ErrOutcomeUnknown instead of running fn again
	// when the first call's process died mid-call (onAbandoned: Error).
	AbandonedError bool
	// FailOpen runs fn without deduplication when the store cannot be
	// reached, instead of failing with ErrStoreUnavailable.
	FailOpen bool
}

// Group deduplicates calls by key. It is safe for concurrent use.
type Group struct {
	store Store
	opts  Options
	owner string

	mu      sync.Mutex
	flights map[string]*flight
}

// flight is a call in progress in this process.
type flight struct {
	fingerprint string
	done        chan struct{}
	value       []byte
	err         error
}

// NewGroup returns a Group keeping its records in s.
func NewGroup(s Store, o Options) *Group {
	if o.TTL <= 0 {
		o.TTL = 24 * time.Hour
	}
	if o.Lease <= 0 {
		o.Lease = 30 * time.Second
	}
	if o.WaitTimeout == 0 {
		o.WaitTimeout = 30 * time.Second
	}
	return &Group{store: s, opts: o, owner: rand.Text(), flights: make(map[string]*flight)}
}

// hash keeps raw keys and fingerprints out of the store.
func hash(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))
}

// Do runs fn once for key and returns its result; every later call with
// the same key and fingerprint, in this process or another sharing the
// store, gets that result with replayed true, for the TTL. The
// fingerprint identifies what fn does (a hash of its arguments): a key
// reused with another fingerprint gets ErrConflict.
//
// fn's error is returned as is and nothing is kept, so the next call runs
// fn again. Do's own errors wrap ErrConflict, ErrInFlight,
// ErrOutcomeUnknown or ErrStoreUnavailable, or are ctx's.
func (g *Group) Do(ctx context.Context, key, fingerprint string, fn func(ctx context.Context) ([]byte, error)) (value []byte, replayed bool, err error) {
	if key == "" {
		return nil, false, errors.New("idempotency: empty key")
	}
	skey, sfp := hash("key", key), hash("fingerprint", fingerprint)
	var waitUntil <-chan time.Time
	if g.opts.WaitTimeout > 0 {
		t := time.NewTimer(g.opts.WaitTimeout)
		defer t.Stop()
		waitUntil = t.C
	}
	for {
		g.mu.Lock()
		f, ok := g.flights[skey]
		if !ok {
			f = &flight{fingerprint: sfp, done: make(chan struct{})}
			g.flights[skey] = f
			g.mu.Unlock()
			f.value, replayed, f.err = g.claim(ctx, skey, sfp, fn)
			if errors.Is(f.err, ErrConflict) || errors.Is(f.err, ErrInFlight) || errors.Is(f.err, ErrOutcomeUnknown) {
				f.err = fmt.Errorf("key %q: %w", key, f.err)
			}
			g.mu.Lock()
			delete(g.flights, skey)
			g.mu.Unlock()
			close(f.done)
			return f.value, replayed, f.err
		}
		g.mu.Unlock()
		// A call with this key runs in this process: wait for it here.
		if f.fingerprint != sfp {
			return nil, false, fmt.Errorf("key %q: %w", key, ErrConflict)
		}
		if g.opts.WaitTimeout < 0 {
			return nil, false, fmt.Errorf("key %q: %w", key, ErrInFlight)
		}
		select {
		case <-f.done:
		case <-ctx.Done():
			return nil, false, ctx.Err()
		case <-waitUntil:
			return nil, false, fmt.Errorf("key %q: %w after waiting %s", key, ErrInFlight, g.opts.WaitTimeout)
		}
		if f.err == nil {
			return f.value, true, nil
		}
		if errors.Is(f.err, ErrConflict) || errors.Is(f.err, ErrOutcomeUnknown) {
			return nil, false, f.err
		}
		// The first call failed and kept nothing: try again.
	}
}

// claim runs the store's side: reserve, wait for another process's claim,
// or run fn and keep its result.
func (g *Group) claim(ctx context.Context, key, fp string, fn func(context.Context) ([]byte, error)) ([]byte, bool, error) {
	owner := g.owner + "-" + rand.Text()
	c := store.Claim{Key: key, Fingerprint: fp, Owner: owner, Lease: g.opts.Lease,
		Retention: max(g.opts.TTL, g.opts.Lease), TakeOver: !g.opts.AbandonedError}
	waitCtx := ctx
	if g.opts.WaitTimeout > 0 {
		var cancel context.CancelFunc
		waitCtx, cancel = context.WithTimeout(ctx, g.opts.WaitTimeout)
		defer cancel()
	}
	for {
		r, err := g.store.Reserve(ctx, c)
		if err != nil {
			if ctx.Err() != nil {
				return nil, false, ctx.Err()
			}
			go g.releaseQuietly(key, owner) // it may have applied
			if g.opts.FailOpen {
				v, err := fn(ctx)
				return v, false, err
			}
			return nil, false, fmt.Errorf("idempotency: %w", err)
		}
		if r.State != store.Won && r.Fingerprint != fp {
			return nil, false, ErrConflict
		}
		switch r.State {
		case store.Won:
			return g.run(ctx, key, owner, fn)
		case store.Completed:
			return r.Response, true, nil
		case store.Abandoned:
			return nil, false, ErrOutcomeUnknown
		case store.Pending:
			if g.opts.WaitTimeout < 0 {
				return nil, false, ErrInFlight
			}
			if err := g.store.Wait(waitCtx, key); err != nil {
				if ctx.Err() != nil {
					return nil, false, ctx.Err()
				}
				if waitCtx.Err() != nil {
					return nil, false, fmt.Errorf("%w after waiting %s", ErrInFlight, g.opts.WaitTimeout)
				}
				return nil, false, fmt.Errorf("%w: the store became unreachable while waiting: %w", ErrInFlight, err)
			}
		}
	}
}

// run calls fn under a claim this owner holds, renewing its lease, and
// keeps the result or releases the claim.
func (g *Group) run(ctx context.Context, key, owner string, fn func(context.Context) ([]byte, error)) ([]byte, bool, error) {
	renewCtx, stopRenew := context.WithCancel(context.WithoutCancel(ctx))
	go func() {
		t := time.NewTicker(g.opts.Lease / 3)
		defer t.Stop()
		for {
			select {
			case <-renewCtx.Done():
				return
			case <-t.C:
				if errors.Is(g.store.Renew(renewCtx, key, owner, g.opts.Lease), store.ErrNotOwner) {
					return
				}
			}
		}
	}()
	defer stopRenew()
	v, err := fn(ctx)
	settleCtx := context.WithoutCancel(ctx)
	if err != nil {
		g.retry(settleCtx, func(ctx context.Context) error { return g.store.Release(ctx, key, owner) })
		return nil, false, err
	}
	if v == nil {
		v = []byte{}
	}
	// fn ran: its result goes to the caller whether or not it could be
	// kept (if not, the claim's lease runs out and a retry may run fn).
	g.retry(settleCtx, func(ctx context.Context) error { return g.store.Complete(ctx, key, owner, v, g.opts.TTL) })
	return v, false, nil
}

// retry gives a store write a few chances: a lost Complete would let a
// retry run fn again once the lease runs out.
func (g *Group) retry(ctx context.Context, op func(context.Context) error) {
	for _, pause := range []time.Duration{0, 100 * time.Millisecond, 500 * time.Millisecond, 2 * time.Second} {
		time.Sleep(pause)
		opCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := op(opCtx)
		cancel()
		if err == nil || errors.Is(err, store.ErrNotOwner) {
			return
		}
	}
}

func (g *Group) releaseQuietly(key, owner string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = g.store.Release(ctx, key, owner)
}

// DoJSON is Do for values kept as JSON: v is fn's value, or the kept one
// decoded into a fresh T.
func DoJSON[T any](ctx context.Context, g *Group, key, fingerprint string, fn func(ctx context.Context) (T, error)) (v T, replayed bool, err error) {
	raw, replayed, err := g.Do(ctx, key, fingerprint, func(ctx context.Context) ([]byte, error) {
		v, err := fn(ctx)
		if err != nil {
			return nil, err
		}
		return json.Marshal(v)
	})
	if err != nil {
		return v, false, err
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		return v, replayed, fmt.Errorf("idempotency: decoding the kept result: %w", err)
	}
	return v, replayed, nil
}
