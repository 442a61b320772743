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
//     the next call runs fn again (the default) or, with
//     Options.AbandonedError, gets ErrOutcomeUnknown.
//   - Errors are not kept: when fn returns an error, the claim is released
//     and the next call runs fn again.
//   - A key reused with another fingerprint (other arguments) gets
//     ErrConflict and fn does not run.
//   - fn runs detached from the caller's context: a caller that cancels or
//     times out gets ctx's error, but fn goes on, and its result is kept
//     for the retry (Drain waits for such calls before the process exits).
//   - The claim's lease is renewed while fn runs; a renewal that fails is
//     retried at once with backoff, and one that hangs is given up after a
//     third of the lease, so a short store outage does not let another
//     process run fn beside it. Storing the result is retried for about
//     16 s of pauses before the claim is left to lapse; with a store whose
//     every attempt hangs until its 5 s timeout, about 56 s in all.
//   - A panic in fn is returned wrapping a *PanicError (get it with
//     errors.As; it matches ErrOutcomeUnknown): its outcome is unknown,
//     the claim lapses with its lease, then AbandonedError decides. The
//     calls of this process that waited for the panicking call get its
//     *PanicError too; AbandonedError applies to the calls made after it
//     returned.
//   - Records in a shared store are sealed when the store is opened with
//     seal keys (SealKeys, SealKeyring): whoever can write to Redis or
//     PostgreSQL cannot plant a result. Without keys results are stored
//     unsealed, and the store logs a warning saying so.
//
// "At most once" holds while the result is kept (TTL) and while the store
// keeps its records: the memory store only within one process, Redis and
// PostgreSQL across every process that shares them.
//
// These are the guarantees of the idemcp sidecar: Group runs the same claim
// protocol, and the same fault tests run against both.
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
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/internal/claim"
	"github.com/idemcp/idemcp/internal/store"
	pgstore "github.com/idemcp/idemcp/internal/store/postgres"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
	"github.com/idemcp/idemcp/internal/tracing"
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
//
// Give it seal keys (SealKeys or SealKeyring): unsealed, whoever can read
// the Redis reads every result, and whoever can write to it can plant a
// result for a guessable key that a call then returns without running fn.
// A store opened without seal keys stores results unsealed, knowingly, and
// logs a warning saying so (StoreLogger).
func NewRedisStore(o RedisOptions, opts ...StoreOption) (Store, error) {
	st, err := redisstore.New(o)
	if err != nil {
		return nil, err
	}
	return sealShared(st, "Redis", opts)
}

// NewPostgresStore returns a store in PostgreSQL, shared by every process
// that uses the same database and key prefix. It creates its tables on
// first use. It does not fail when the database is down: calls do, with
// ErrStoreUnavailable. Seal keys are given as to NewRedisStore, for the
// same reasons.
func NewPostgresStore(o PostgresOptions, opts ...StoreOption) (Store, error) {
	st, err := pgstore.New(o)
	if err != nil {
		return nil, err
	}
	return sealShared(st, "PostgreSQL", opts)
}

// StoreOption configures a shared store (NewRedisStore, NewPostgresStore).
type StoreOption func(*storeConfig)

type storeConfig struct {
	keys    [][]byte
	keyText []string
	log     *slog.Logger
	err     error
}

// SealKeys seals every result the store keeps with AES-256-GCM, bound to
// its key and to the store's key prefix (an empty Prefix is the store's
// DefaultPrefix, so "" and "idemcp:" share records): a record that fails to open (altered,
// planted, copied from another key, or sealed under a key not given here)
// counts as absent, and fn runs as for a new key, once. keys[0] seals and
// every key opens: after a rotation, keep the previous key until the
// records it sealed have expired (TTL). Each key is SealKeyBytes random
// bytes.
func SealKeys(keys ...[]byte) StoreOption {
	return func(c *storeConfig) {
		if len(keys) == 0 {
			c.err = errors.New("no key was given to SealKeys; a seal key is 32 random bytes")
		}
		c.keys = append(c.keys, keys...)
	}
}

// SealKeyring is SealKeys with the keys as text, in the format of the
// idemcp sidecar's seal Secret (IDEMCP_SEAL_KEYS): base64 keys separated
// by commas, spaces or newlines, the current key first; lines starting
// with # are comments. Generate a key with: head -c 32 /dev/urandom | base64
//
// Text with no key in it (an unset environment variable, say) is an
// error: the store fails to open with "no seal key given" rather than
// store results unsealed. To run unsealed on purpose, pass no SealKeyring.
func SealKeyring(text string) StoreOption {
	return func(c *storeConfig) { c.keyText = append(c.keyText, text) }
}

// StoreLogger gets the store's warnings: that it is unsealed, and each
// stored result that failed to open (nil: slog.Default()).
func StoreLogger(l *slog.Logger) StoreOption {
	return func(c *storeConfig) { c.log = l }
}

// SealKeyBytes is the length of a seal key (AES-256).
const SealKeyBytes = store.SealKeyBytes

// prefixedStore is a shared store that says which key prefix it uses.
type prefixedStore interface {
	store.Store
	KeyPrefix() string
}

// sealShared wraps st so that its results are sealed, or warns that they
// are not. It closes st when the options are wrong.
//
// Records are bound to the prefix st actually uses (an empty
// Options.Prefix is DefaultPrefix), as the sidecar binds them: processes
// that share records must open each other's, however they spell it.
func sealShared(st prefixedStore, kind string, opts []StoreOption) (Store, error) {
	prefix := st.KeyPrefix()
	var c storeConfig
	for _, o := range opts {
		o(&c)
	}
	if c.log == nil {
		c.log = slog.Default()
	}
	ring, err := c.keyring()
	if err != nil {
		_ = st.Close()
		return nil, fmt.Errorf("idempotency: %s store: %w", kind, err)
	}
	return store.SealOrWarn(st, store.SealSetup{
		Keyring: ring, Context: prefix, Log: c.log,
		Unsealed:   "Results are stored unsealed: whoever can read the store reads them, and whoever can write to it can plant a result that a call returns without running fn; pass idempotency.SealKeys or idempotency.SealKeyring",
		OpenFailed: "A stored result failed to open and is treated as absent; fn runs as for a new key",
		Attrs:      []any{"store", kind, "prefix", prefix},
	}), nil
}

// keyring is the keys given, or nil for none.
func (c *storeConfig) keyring() (*store.Keyring, error) {
	switch {
	case c.err != nil:
		return nil, c.err
	case len(c.keys) > 0 && len(c.keyText) > 0:
		return nil, errors.New("both SealKeys and SealKeyring were given; give the keys one way")
	case len(c.keyText) > 0:
		return store.ParseKeyring(strings.Join(c.keyText, "\n"))
	case len(c.keys) > 0:
		return store.NewKeyring(c.keys...)
	}
	return nil, nil
}

var (
	// ErrConflict means the key was already used with another fingerprint; fn
	// did not run.
	ErrConflict = errors.New("idempotency key conflict: the key was already used with a different fingerprint")
	// ErrInFlight means a call with this key is still running after WaitTimeout
	// (or, with WaitTimeout < 0, at all); fn did not run. Retry later.
	ErrInFlight = errors.New("a call with this idempotency key is still running")
	// ErrOutcomeUnknown means the first call with this key stopped mid-call (its
	// process died, or fn panicked) and AbandonedError is set; fn did not run
	// again.
	ErrOutcomeUnknown = errors.New("outcome unknown: the first call with this key stopped mid-call")
	// ErrStoreUnavailable means the store cannot be reached and FailOpen is
	// false; fn did not run.
	ErrStoreUnavailable = store.ErrUnavailable
)

// Options tune a Group. Zero values take the defaults; a negative TTL or
// Lease is an error (see Validate), not the default.
type Options struct {
	// TTL is how long a result is kept and replayed (default 24h, at least
	// MinTTL).
	TTL time.Duration
	// Lease is how long a claim lives without renewal (default 30s, at
	// least MinLease); it is renewed every third of it while fn runs, and a
	// renewal that fails is retried at once, with backoff.
	Lease time.Duration
	// WaitTimeout bounds how long a duplicate waits for the first call
	// (default 30s; negative: do not wait, fail with ErrInFlight).
	WaitTimeout time.Duration
	// AbandonedError answers ErrOutcomeUnknown instead of running fn again
	// when the first call's process died mid-call (onAbandoned: Error).
	AbandonedError bool
	// FailOpen runs fn without deduplication when the store cannot be
	// reached, instead of failing with ErrStoreUnavailable. fn still runs
	// detached from the caller's cancel, but Do waits for it: with no
	// claim there is nothing to keep its result in for a retry.
	FailOpen bool
	// Logger gets the Group's warnings: renewals that fail, results that
	// could not be kept, claims taken over, panics in fn (nil:
	// slog.Default()).
	Logger *slog.Logger
	// TracerProvider gets a span for every Do, "idempotency.Do", with its
	// outcome (idemcp.outcome: executed, replayed, waited, conflict,
	// in-flight, outcome-unknown, store-unavailable), a short hash of the
	// key (never the key), child spans for the store's round trips, and a
	// link from a replay to the span of the call that ran fn (from a replay
	// in another process only under DoJSON: Do keeps its value's bytes
	// and nothing with them) (nil:
	// otel.GetTracerProvider(), which traces nothing until the program
	// sets one). fn runs under the span.
	TracerProvider trace.TracerProvider
}

// Bounds Options.Validate checks.
const (
	// MinLease is the shortest Lease: a lease shorter than a few store
	// round trips would lapse under a call that still runs.
	MinLease = 100 * time.Millisecond
	// MinTTL is the shortest TTL (stores keep time in milliseconds).
	MinTTL = time.Millisecond
)

// Validate reports the first option out of its range, naming it and the
// values it accepts. NewGroup calls it: a Group with invalid options runs
// nothing and answers every Do with this error.
func (o Options) Validate() error {
	switch {
	case o.TTL < 0 || o.TTL > 0 && o.TTL < MinTTL:
		return fmt.Errorf("idempotency: Options.TTL is %s; use 0 for the default (24h) or a TTL of at least %s", o.TTL, MinTTL)
	case o.Lease < 0 || o.Lease > 0 && o.Lease < MinLease:
		return fmt.Errorf("idempotency: Options.Lease is %s; use 0 for the default (30s) or a lease of at least %s", o.Lease, MinLease)
	}
	return nil
}

// Group deduplicates calls by key. It is safe for concurrent use.
type Group struct {
	claims *claim.Protocol
	opts   Options
	owner  string
	log    *slog.Logger
	// invalid is why the Group runs nothing (Options.Validate, or no store).
	invalid error

	mu      sync.Mutex
	flights map[string]*flight
}

// flight is a call in progress in this process.
type flight struct {
	fingerprint string
	done        chan struct{}
	value       []byte
	err         error
	// execution is the span of the call whose result value is.
	execution trace.SpanContext
}

// NewGroup returns a Group keeping its records in s. If s is nil or o is
// invalid (see Options.Validate), every Do returns an error saying so.
func NewGroup(s Store, o Options) *Group {
	g := &Group{owner: rand.Text(), flights: make(map[string]*flight), log: o.Logger, invalid: o.Validate()}
	if s == nil && g.invalid == nil {
		g.invalid = errors.New("idempotency: NewGroup was given no Store; use NewMemoryStore, NewRedisStore or NewPostgresStore")
	}
	if o.TTL == 0 {
		o.TTL = 24 * time.Hour
	}
	if o.Lease == 0 {
		o.Lease = 30 * time.Second
	}
	if o.WaitTimeout == 0 {
		o.WaitTimeout = 30 * time.Second
	}
	if g.log == nil {
		g.log = slog.Default()
	}
	g.opts = o
	g.claims = claim.New(claim.Options{
		Store: s,
		Log:   g.log,
		Panicked: func(where string, v any) {
			g.log.Error("Recovered from a panic; the process goes on", "where", where, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		},
		PanicAnswer: func(h claim.Held, v any) error {
			g.log.Error("fn panicked, so its outcome is unknown: its claim is kept until its lease runs out, then AbandonedError decides", "key", h.Key)
			return &PanicError{Value: v, Stack: debug.Stack()}
		},
	})
	return g
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

// PanicError is what Do returns when fn panicked. Whatever fn did before,
// its outcome is unknown: the claim is neither kept as a result nor
// released, it lapses when its lease runs out, and then AbandonedError
// decides what the next call gets (fn runs again, or ErrOutcomeUnknown).
// It matches ErrOutcomeUnknown with errors.Is.
type PanicError struct {
	// Value is what fn panicked with: nil when fn panicked with nil
	// (GODEBUG=panicnil=1) or ended its goroutine (runtime.Goexit), and
	// for the calls that waited in process on a call whose Store
	// panicked (that panic goes on in the call that met it).
	Value any
	// Stack is the stack of the panicking goroutine.
	Stack []byte
}

func (e *PanicError) Error() string {
	return fmt.Sprintf("idempotency: fn panicked (%v), so its outcome is unknown", e.Value)
}

// Unwrap makes a PanicError match ErrOutcomeUnknown.
func (e *PanicError) Unwrap() error { return ErrOutcomeUnknown }

// Do runs fn once for key and returns its result; every later call with
// the same key and fingerprint, in this process or another sharing the
// store, gets that result with replayed true, for the TTL. The
// fingerprint identifies what fn does (a hash of its arguments): a key
// reused with another fingerprint gets ErrConflict.
//
// fn runs on a context that ctx's cancel does not reach: once fn may have
// had its effect, the caller going away must not make a retry run it
// again. If ctx ends while fn runs, Do returns ctx's error at once, and
// fn's result is still kept for the retry (Drain waits for such calls).
//
// fn's error is returned as is and nothing is kept, so the next call runs
// fn again. A panic in fn is returned wrapping a *PanicError (use
// errors.As), as are the calls of this process that waited for it. A panic
// in the Store's own methods goes on in the call that met it, and the
// calls waiting for that one get a *PanicError. Do's own errors
// wrap ErrConflict, ErrInFlight, ErrOutcomeUnknown or ErrStoreUnavailable,
// or are ctx's.
func (g *Group) Do(ctx context.Context, key, fingerprint string, fn func(ctx context.Context) ([]byte, error)) (value []byte, replayed bool, err error) {
	return g.do(ctx, key, fingerprint, false, fn)
}

// do is Do; isJSON says fn's values are JSON, so that the span of the call
// that ran fn can be kept with its record (see claim.Protocol.CompleteJSON).
func (g *Group) do(ctx context.Context, key, fingerprint string, isJSON bool, fn func(ctx context.Context) ([]byte, error)) (value []byte, replayed bool, err error) {
	if g.invalid != nil {
		return nil, false, g.invalid
	}
	if key == "" {
		return nil, false, errors.New("idempotency: empty key")
	}
	skey, sfp := hash("key", key), hash("fingerprint", fingerprint)
	tp := g.opts.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	ctx, span := tp.Tracer(tracing.ScopeName).Start(ctx, "idempotency.Do", trace.WithAttributes(tracing.KeyHashAttr.String(tracing.KeyHash(skey))))
	ds := &doSpan{span: span}
	ctx = tracing.WithCall(ctx, ds)
	defer func() { ds.end(err) }()
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
			return g.lead(ctx, f, key, skey, sfp, isJSON, fn)
		}
		g.mu.Unlock()
		// A call with this key runs in this process: wait for it here.
		if f.fingerprint != sfp {
			ds.outcome(tracing.OutcomeConflict)
			return nil, false, fmt.Errorf("key %q: %w", key, ErrConflict)
		}
		if g.opts.WaitTimeout < 0 {
			ds.outcome(tracing.OutcomeInFlight)
			return nil, false, fmt.Errorf("key %q: %w", key, ErrInFlight)
		}
		select {
		case <-f.done:
		case <-ctx.Done():
			return nil, false, ctx.Err()
		case <-waitUntil:
			ds.outcome(tracing.OutcomeInFlight)
			return nil, false, fmt.Errorf("key %q: %w after waiting %s", key, ErrInFlight, g.opts.WaitTimeout)
		}
		if f.err == nil {
			ds.outcome(tracing.OutcomeWaited)
			ds.link(f.execution)
			return f.value, true, nil
		}
		if errors.Is(f.err, ErrConflict) || errors.Is(f.err, ErrOutcomeUnknown) {
			return nil, false, f.err
		}
		// The first call failed and kept nothing (or its caller went away
		// while it runs on): try again, through the store.
	}
}

// lead runs the store's side of a call for this process, and hands its
// outcome to the calls of this process that wait for it.
//
// A panic on this goroutine (in the Store's own methods: fn's panics are
// recovered where fn runs) goes on to the caller, as any panic in its own
// code would; the calls waiting for this one get a *PanicError.
func (g *Group) lead(ctx context.Context, f *flight, key, skey, sfp string, isJSON bool, fn func(context.Context) ([]byte, error)) (value []byte, replayed bool, err error) {
	returned := false
	defer func() {
		// Whatever happened, the key is free in this process again.
		f.value, f.err = value, err
		f.execution = doSpanOf(ctx).executionOf()
		if !returned {
			// Panicking (or exiting the goroutine): the waiters must not
			// take the zero result for one.
			f.value, f.err = nil, &PanicError{Stack: debug.Stack()}
		}
		g.mu.Lock()
		delete(g.flights, skey)
		g.mu.Unlock()
		close(f.done)
	}()
	value, replayed, err = g.claim(ctx, skey, sfp, isJSON, fn)
	returned = true
	if errors.Is(err, ErrConflict) || errors.Is(err, ErrInFlight) || errors.Is(err, ErrOutcomeUnknown) {
		err = fmt.Errorf("key %q: %w", key, err)
	}
	return value, replayed, err
}

// claim runs the store's side: reserve, wait for another process's claim,
// or run fn and keep its result.
func (g *Group) claim(ctx context.Context, key, fp string, isJSON bool, fn func(context.Context) ([]byte, error)) ([]byte, bool, error) {
	owner := g.owner + "-" + rand.Text()
	c := store.Claim{Key: key, Fingerprint: fp, Owner: owner, Lease: g.opts.Lease,
		Retention: max(g.opts.TTL, g.opts.Lease), TakeOver: !g.opts.AbandonedError}
	r, err := g.claims.Reserve(ctx, c, claim.Waits{Timeout: g.opts.WaitTimeout, Reject: g.opts.WaitTimeout < 0})
	ds := doSpanOf(ctx)
	switch {
	case err == nil:
	case errors.Is(err, claim.ErrConflict):
		ds.outcome(tracing.OutcomeConflict)
		return nil, false, ErrConflict
	case errors.Is(err, claim.ErrInFlight):
		ds.outcome(tracing.OutcomeInFlight)
		return nil, false, ErrInFlight
	case errors.Is(err, claim.ErrWaitTimeout):
		ds.outcome(tracing.OutcomeInFlight)
		return nil, false, fmt.Errorf("%w after waiting %s", ErrInFlight, g.opts.WaitTimeout)
	default:
		unavailable := (*claim.UnavailableError)(nil)
		if !errors.As(err, &unavailable) {
			return nil, false, err // ctx's
		}
		if unavailable.Held {
			// Another process holds the key: never run fn beside it.
			ds.outcome(tracing.OutcomeInFlight)
			return nil, false, fmt.Errorf("%w: the store became unreachable while waiting: %w", ErrInFlight, unavailable.Err)
		}
		ds.outcome(tracing.OutcomeStoreUnavailable)
		if g.opts.FailOpen {
			v, err := callUnclaimed(ctx, fn)
			return v, false, err
		}
		return nil, false, fmt.Errorf("idempotency: %w", unavailable.Err)
	}
	switch r.State {
	case store.Won:
		if ctx.Err() != nil {
			// The caller gave up before fn started: nothing ran, so the
			// next call must find the key free.
			// The caller is answered once the first attempt to release is
			// made (so that with a healthy store the key is free when Do
			// returns); the retries a failing store needs go on in the
			// background, and Drain waits for them.
			tried := make(chan struct{})
			done := g.claims.Track()
			g.claims.Go("release", func() {
				defer done()
				if err := g.claims.Release(context.WithoutCancel(ctx), key, owner, func() { close(tried) }); err != nil {
					g.writeFailed("release", key, err)
				}
			})
			<-tried
			return nil, false, ctx.Err()
		}
		if r.TookOver {
			g.log.Warn("Took over an abandoned claim: its process stopped mid-call, and fn runs again", "key", key)
			ds.span.SetAttributes(tracing.TookOver.Bool(true))
		}
		ds.outcome(tracing.OutcomeExecuted)
		return g.run(ctx, key, owner, isJSON, fn)
	case store.Completed:
		if r.Waited {
			ds.outcome(tracing.OutcomeWaited)
		} else {
			ds.outcome(tracing.OutcomeReplayed)
		}
		ds.link(r.Execution)
		return r.Response, true, nil
	default: // store.Abandoned
		ds.outcome(tracing.OutcomeOutcomeUnknown)
		return nil, false, ErrOutcomeUnknown
	}
}

// run calls fn under a claim this owner holds, detached from ctx's cancel,
// and keeps the result or releases the claim.
func (g *Group) run(ctx context.Context, key, owner string, isJSON bool, fn func(context.Context) ([]byte, error)) ([]byte, bool, error) {
	held := claim.Held{Key: key, Owner: owner, Lease: g.opts.Lease}
	var value []byte
	err := g.claims.Run(ctx, held, func(ctx context.Context, answer func(error)) {
		v, err := fn(ctx)
		if err != nil {
			if rerr := g.claims.Release(ctx, key, owner, func() { answer(err) }); rerr != nil {
				g.writeFailed("release", key, rerr)
			}
			return
		}
		if v == nil {
			v = []byte{}
		}
		value = v
		// fn ran: its result goes to the caller once the first attempt to
		// keep it is made, and it is retried while the lease is renewed.
		complete := g.claims.Complete
		if isJSON {
			complete = g.claims.CompleteJSON
		}
		if cerr := complete(ctx, key, owner, v, g.opts.TTL, func() { answer(nil) }); cerr != nil {
			g.writeFailed("complete", key, cerr)
		}
	})
	switch {
	case errors.Is(err, claim.ErrDetached):
		return nil, false, ctx.Err()
	case err != nil:
		return nil, false, err
	}
	return value, false, nil
}

// callUnclaimed runs fn with no claim (FailOpen), on a context ctx's
// cancel does not reach as a claimed call's, and returns a panic as a
// *PanicError as a claimed call does (panic(nil) under
// GODEBUG=panicnil=1 too). Do waits for fn here: there is no claim to
// keep its result for a retry.
func callUnclaimed(ctx context.Context, fn func(context.Context) ([]byte, error)) (v []byte, err error) {
	returned := false
	defer func() {
		if p := recover(); p != nil || !returned {
			v, err = nil, &PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	v, err = fn(context.WithoutCancel(ctx))
	returned = true
	return v, err
}

func (g *Group) writeFailed(op, key string, err error) {
	switch {
	case errors.Is(err, claim.ErrProbablyApplied):
		g.log.Warn("Store write retried after an error; the earlier attempt most likely applied", "op", op, "key", key)
	case errors.Is(err, store.ErrNotOwner):
		g.log.Error("The claim was taken over before fn finished; its result is not kept", "op", op, "key", key)
	default:
		g.log.Error("Store write failed after fn ran; once the claim's lease runs out, AbandonedError decides what a retry gets", "op", op, "key", key, "err", err)
	}
}

// Drain waits until every call whose fn still runs after its caller went
// away has finished and its result is kept (or released), or ctx ends.
// Call it before the process exits.
func (g *Group) Drain(ctx context.Context) error { return g.claims.Drain(ctx) }

// DoJSON is Do for values kept as JSON: v is fn's value, or the kept one
// decoded into a fresh T.
func DoJSON[T any](ctx context.Context, g *Group, key, fingerprint string, fn func(ctx context.Context) (T, error)) (v T, replayed bool, err error) {
	raw, replayed, err := g.do(ctx, key, fingerprint, true, func(ctx context.Context) ([]byte, error) {
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

// doSpan is the span of one Do.
type doSpan struct {
	span    trace.Span
	decided string
	// linked is the execution a replay was linked to.
	linked trace.SpanContext
}

// StoreSpans reports that a Do's store round trips get child spans, as
// they always have (tracing.Call): a Do inside a sidecar's or the
// middleware's call makes them whatever that call's policy says.
func (d *doSpan) StoreSpans() bool { return true }

// doSpanOf is the span of the Do whose context ctx is (nil if none).
func doSpanOf(ctx context.Context) *doSpan {
	ds, _ := tracing.CallOf(ctx).(*doSpan)
	return ds
}

func (d *doSpan) outcome(o string) {
	if d != nil && d.decided == "" {
		d.decided = o
		d.span.SetAttributes(tracing.Outcome.String(o))
	}
}

func (d *doSpan) link(sc trace.SpanContext) {
	if d != nil && sc.IsValid() {
		d.linked = sc
		d.span.AddLink(trace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{attribute.String("idemcp.link", "execution")}})
	}
}

// executionOf is the span of the call whose result this Do returns: its
// own if it ran fn, the linked one if it replayed.
func (d *doSpan) executionOf() trace.SpanContext {
	if d == nil {
		return trace.SpanContext{}
	}
	if d.linked.IsValid() {
		return d.linked
	}
	return d.span.SpanContext()
}

func (d *doSpan) end(err error) {
	if err != nil {
		d.span.SetStatus(codes.Error, "")
		d.span.SetAttributes(tracing.ErrorType.String(doErrorType(err)))
	}
	d.span.End()
}

// doErrorType names Do's error for a span, without its message (which
// names the key).
func doErrorType(err error) string {
	switch {
	case errors.Is(err, ErrConflict):
		return "conflict"
	case errors.Is(err, ErrInFlight):
		return "in_flight"
	case errors.Is(err, ErrOutcomeUnknown):
		return "decidedunknown"
	case errors.Is(err, ErrStoreUnavailable):
		return "store_unavailable"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "canceled"
	}
	return "fn_error"
}
