// Package claim is the claim protocol every front end runs on a store: the
// sidecar's engine and the public idempotency.Group. It reserves a key
// (waiting for another owner's claim, taking over a dead owner's, releasing
// a reservation whose reply was lost), runs the owner's call detached from
// its caller while renewing the lease (with backoff and a deadline on each
// attempt), and settles the claim, completed or released, with retries
// that outlast a short outage. A panic in the call keeps the claim: it
// lapses with its lease, and the front end's onAbandoned decides what a
// retry gets.
//
// Front ends decide what is stored and how each outcome is answered; the
// protocol decides when the store is asked what.
package claim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/internal/store"
)

// Options configure a Protocol.
type Options struct {
	Store store.Store
	// Log gets the protocol's warnings (nil: none), each with the tool
	// (Held.Tool, if any) and key of its call.
	Log *slog.Logger
	// StoreError, if set, is told of every store operation that failed:
	// reserve, wait, renew, and retry (a settling write tried again).
	StoreError func(op string)
	// Panicked, if set, is told of a panic recovered on one of the
	// protocol's goroutines: release, renew, or run (the owner's call).
	Panicked func(where string, v any)
	// PanicAnswer is what the caller of a call that panicked under Run is
	// answered (nil: an error naming the panic).
	PanicAnswer func(h Held, v any) error
}

// Protocol runs claims on one store. It is safe for concurrent use.
type Protocol struct {
	store      store.Store
	log        *slog.Logger
	storeError func(op string)
	panicked   func(where string, v any)
	answer     func(h Held, v any) error
	running    activity
}

// New returns a Protocol.
func New(o Options) *Protocol {
	p := &Protocol{store: o.Store, log: o.Log, storeError: o.StoreError, panicked: o.Panicked, answer: o.PanicAnswer}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	if p.storeError == nil {
		p.storeError = func(string) {}
	}
	if p.panicked == nil {
		p.panicked = func(string, any) {}
	}
	if p.answer == nil {
		p.answer = func(_ Held, v any) error { return fmt.Errorf("the call panicked: %v", v) }
	}
	return p
}

var (
	// ErrConflict means the key is held, completed or abandoned for another
	// fingerprint. Stores never take over such a claim.
	ErrConflict = errors.New("the key is held for another fingerprint")
	// ErrInFlight means another owner holds the key and Waits.Reject is set.
	ErrInFlight = errors.New("another owner holds the key")
	// ErrWaitTimeout means another owner still held the key when
	// Waits.Timeout ran out.
	ErrWaitTimeout = errors.New("another owner still holds the key after the wait")
	// ErrDetached is returned by Run when the caller's context ended while
	// the call it started goes on; its result is settled all the same.
	ErrDetached = errors.New("the caller went away; the call goes on and is settled")
	// ErrProbablyApplied means a retried settling write found the claim gone,
	// most likely because an attempt whose reply was lost had applied it.
	ErrProbablyApplied = errors.New("a retried store write found the claim already settled; an earlier attempt probably applied")
)

// UnavailableError is a store that failed while reserving or waiting.
type UnavailableError struct {
	// Op is reserve or wait.
	Op string
	// Held reports that another owner was seen holding the key: the call
	// must not run undeduplicated, whatever the front end's fail-open
	// setting says.
	Held bool
	Err  error
}

func (e *UnavailableError) Error() string { return e.Op + ": " + e.Err.Error() }
func (e *UnavailableError) Unwrap() error { return e.Err }

// Waits say what Reserve does while another owner holds the key.
type Waits struct {
	// Timeout bounds the wait for another owner's claim, from the first
	// time Reserve finds it pending (most calls never wait, and need no
	// timer).
	Timeout time.Duration
	// Reject answers ErrInFlight at once instead of waiting.
	Reject bool
	// Admit, if set, is asked before each wait; its error is returned as
	// is, and done is called when the wait ends.
	Admit func() (done func(), err error)
}

// Reserve claims c.Key for c.Owner. It returns a Reservation that is Won
// (the owner must Run the call, then settle it), Completed (a response
// stored for the same fingerprint) or Abandoned (a dead owner's claim, and
// c.TakeOver is not set), or an error: ErrConflict, ErrInFlight,
// ErrWaitTimeout, Waits.Admit's, an *UnavailableError, or ctx's.
//
// A reservation that fails, even because ctx ended, may have applied in
// the store before its reply was lost: it is released in the background,
// so that a call that never ran does not hold its key for a whole lease
// (and, under onAbandoned: Error, answer "outcome unknown" for the TTL).
//
// A Completed reservation's Response is the response as Complete was
// given it, and Execution the span that stored it, if it was traced.
func (p *Protocol) Reserve(ctx context.Context, c store.Claim, w Waits) (Reservation, error) {
	var waitCtx context.Context
	sawPending, waited := false, false
	for {
		var sr store.Reservation
		err := storeOp(ctx, "reserve", func(ctx context.Context) (err error) {
			sr, err = p.store.Reserve(ctx, c)
			return err
		})
		r := Reservation{Reservation: sr, Waited: waited}
		if err != nil {
			p.Go("release", func() { p.releaseQuietly(c.Key, c.Owner) })
			if ctx.Err() != nil {
				return Reservation{}, ctx.Err()
			}
			p.storeError("reserve")
			return Reservation{}, &UnavailableError{Op: "reserve", Held: sawPending, Err: err}
		}
		if r.State != store.Won && r.Fingerprint != c.Fingerprint {
			return r, ErrConflict
		}
		if r.State == store.Completed {
			r.Response, r.Execution = splitTrace(r.Response)
		}
		if r.State != store.Pending {
			return r, nil
		}
		if !sawPending {
			var cancel context.CancelFunc
			waitCtx, cancel = context.WithTimeout(ctx, w.Timeout)
			defer cancel()
		}
		sawPending = true
		if w.Reject {
			return r, ErrInFlight
		}
		done := func() {}
		if w.Admit != nil {
			if done, err = w.Admit(); err != nil {
				return r, err
			}
		}
		err = storeOp(waitCtx, "wait", func(ctx context.Context) error { return p.store.Wait(ctx, c.Key) })
		done()
		waited = true
		if err != nil {
			if ctx.Err() != nil {
				return Reservation{}, ctx.Err()
			}
			if waitCtx.Err() != nil {
				return r, ErrWaitTimeout
			}
			p.storeError("wait")
			return r, &UnavailableError{Op: "wait", Held: true, Err: err}
		}
	}
}

// releaseQuietly drops a claim this owner may hold, best effort.
func (p *Protocol) releaseQuietly(key, owner string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = p.store.Release(ctx, key, owner)
}

// Held is a claim an owner won.
type Held struct {
	Key, Owner string
	Lease      time.Duration
	// Tool names the call in logs ("": not logged).
	Tool string
}

// attrs are what the protocol's logs say about h, and more.
func (h Held) attrs(more ...any) []any {
	a := make([]any, 0, 4+len(more))
	if h.Tool != "" {
		a = append(a, "tool", h.Tool)
	}
	return append(append(a, "key", h.Key), more...)
}

// Run runs body under the claim h, detached from ctx: body gets a context
// that ctx's cancel does not reach, and the lease is renewed until body
// returns (settling included). body answers its caller with answer (the
// first answer counts; a body that returns without answering answers
// nil). Run returns that answer, or ErrDetached if ctx ended first; the
// call goes on either way until body returns.
//
// A panic in body is recovered: the claim is neither completed nor
// released, so it lapses with its lease, and the caller is answered
// Options.PanicAnswer's error. A body that ends its goroutine without
// returning (runtime.Goexit, or panic(nil) under GODEBUG=panicnil=1) is
// answered the same way, with a nil panic value. h.Lease must be
// positive, or Run returns an error and body does not run.
func (p *Protocol) Run(ctx context.Context, h Held, body func(ctx context.Context, answer func(error))) error {
	if h.Lease <= 0 {
		return fmt.Errorf("claim: the lease of %q is %v; a lease must be positive to be renewed", h.Key, h.Lease)
	}
	done := make(chan error, 1)
	p.running.add()
	go func() {
		defer p.running.done()
		answered := false
		answer := func(err error) {
			if !answered {
				answered = true
				done <- err
			}
		}
		returned := false
		defer func() {
			// A body that did not return panicked, perhaps with nil
			// (GODEBUG=panicnil=1), or exited its goroutine
			// (runtime.Goexit, as t.FailNow does): either way its outcome
			// is unknown, and its caller must still be answered.
			if v := recover(); v != nil || !returned {
				// The deferred stopRenew below has already stopped
				// renewing: the lease runs out.
				p.panicked("run", v)
				answer(p.answer(h, v))
			}
		}()
		runCtx := context.WithoutCancel(ctx)
		stopRenew := p.renew(runCtx, h)
		defer stopRenew() // the lease lives until the claim is settled
		body(runCtx, answer)
		returned = true
		answer(nil)
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ErrDetached
	}
}

// Renewal retries: a renewal that fails is tried again soon, backing off
// up to RenewRetryMax, rather than a whole lease/3 later, since the lease
// may run out meanwhile and a retry take the claim over.
const (
	RenewRetryMin = 25 * time.Millisecond
	RenewRetryMax = time.Second
)

// renew keeps the claim's lease alive while its call runs: every lease/3,
// each attempt bounded by lease/3 so that a hung one cannot outlive it.
// Nothing runs until the first renewal is due (a timer, no goroutine):
// most calls end before it.
func (p *Protocol) renew(ctx context.Context, h Held) (stop func()) {
	r := &renewal{p: p, h: h, parent: ctx, every: h.Lease / 3, leaseEnd: time.Now().Add(h.Lease)}
	r.mu.Lock()
	r.t = time.AfterFunc(r.every, r.fire)
	r.mu.Unlock()
	return r.stop
}

// renewal is one claim's renewals; its timer fires each one.
type renewal struct {
	p      *Protocol
	h      Held
	parent context.Context
	every  time.Duration

	mu      sync.Mutex
	t       *time.Timer
	stopped bool
	cancel  context.CancelFunc // ends a renewal in flight; made at the first
	ctx     context.Context

	// Only fire touches these, one firing at a time: each rearms the
	// timer as it ends.
	leaseEnd time.Time
	backoff  time.Duration
}

func (r *renewal) stop() {
	r.mu.Lock()
	r.stopped = true
	r.t.Stop()
	cancel := r.cancel
	r.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

func (r *renewal) fire() {
	defer r.p.recoverAs("renew")
	r.mu.Lock()
	if r.stopped {
		r.mu.Unlock()
		return
	}
	if r.ctx == nil {
		r.ctx, r.cancel = context.WithCancel(r.parent)
	}
	ctx := r.ctx
	r.mu.Unlock()

	p, h, lease, every := r.p, r.h, r.h.Lease, r.every
	start := time.Now()
	opCtx, opCancel := context.WithTimeout(ctx, every)
	err := storeOp(opCtx, "renew", func(ctx context.Context) error { return p.store.Renew(ctx, h.Key, h.Owner, lease) })
	opCancel()
	var next time.Duration
	switch {
	case err == nil:
		r.leaseEnd, r.backoff = start.Add(lease), 0
		next = every
	case errors.Is(err, store.ErrNotOwner):
		p.log.Error("Lost the claim while the call runs: another caller took it over", h.attrs()...)
		return
	case ctx.Err() != nil:
		return
	default:
		p.storeError("renew")
		if r.backoff == 0 {
			// Once per run of failures: the retries follow quickly.
			p.log.Warn("Renewing the claim failed; retrying until the lease runs out",
				h.attrs("leaseLeft", time.Until(r.leaseEnd).Round(time.Millisecond).String(), "err", err)...)
		}
		r.backoff = min(max(2*r.backoff, RenewRetryMin), RenewRetryMax)
		next = r.backoff
		if left := time.Until(r.leaseEnd); left <= 0 {
			// The lease has run out: another caller may take the claim
			// over now; keep trying at the usual pace, since a renewal
			// still succeeds if nobody has.
			next = every
		} else if next > left {
			next = max(left/2, RenewRetryMin)
		}
	}
	r.mu.Lock()
	if !r.stopped {
		r.t.Reset(next)
	}
	r.mu.Unlock()
}

// SettleRetries bound how long a settling write is retried into a store
// that fails: a lost Complete would let the lease run out and a retry run
// the call again, so a blip (or a Sentinel failover) is waited out while
// the lease is renewed. Each attempt has SettleAttemptTimeout: the pauses
// add up to about 16 s, and with a store whose every attempt hangs until
// its timeout the retries last about 56 s in all.
var SettleRetries = []time.Duration{50 * time.Millisecond, 200 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second}

// SettleAttemptTimeout bounds one attempt of a settling write.
const SettleAttemptTimeout = 5 * time.Second

// Complete stores response for ttl under the claim, retrying through
// SettleRetries. firstTried is called once the first attempt is made
// (whatever it got), so that the caller can be answered then. It returns
// nil, store.ErrNotOwner (another owner took the claim over),
// ErrProbablyApplied, or the store's last error.
//
// response may be any bytes: Reserve hands the replays exactly these
// (with no Execution; CompleteJSON keeps it for JSON responses).
func (p *Protocol) Complete(ctx context.Context, key, owner string, response []byte, ttl time.Duration, firstTried func()) error {
	return p.complete(ctx, key, owner, withTrace(response, trace.SpanContext{}, false), ttl, firstTried)
}

// CompleteJSON is Complete for a response that is JSON. If ctx holds a
// sampled span (the call's), its span context is kept with the record
// (as JSON whitespace after it), and Reserve hands it to the replays as
// their Execution.
func (p *Protocol) CompleteJSON(ctx context.Context, key, owner string, response []byte, ttl time.Duration, firstTried func()) error {
	return p.complete(ctx, key, owner, withTrace(response, trace.SpanContextFromContext(ctx), true), ttl, firstTried)
}

func (p *Protocol) complete(ctx context.Context, key, owner string, response []byte, ttl time.Duration, firstTried func()) error {
	return p.retry(ctx, firstTried, func(ctx context.Context) error {
		return storeOp(ctx, "complete", func(ctx context.Context) error { return p.store.Complete(ctx, key, owner, response, ttl) })
	})
}

// Release drops the claim so that the next call runs, retrying as
// Complete does.
func (p *Protocol) Release(ctx context.Context, key, owner string, firstTried func()) error {
	return p.retry(ctx, firstTried, func(ctx context.Context) error {
		return storeOp(ctx, "release", func(ctx context.Context) error { return p.store.Release(ctx, key, owner) })
	})
}

func (p *Protocol) retry(ctx context.Context, firstTried func(), op func(context.Context) error) error {
	firstTried = sync.OnceFunc(firstTried)
	defer firstTried()
	var err error
	for i := 0; ; i++ {
		opCtx, cancel := context.WithTimeout(ctx, SettleAttemptTimeout)
		err = op(opCtx)
		cancel()
		firstTried()
		if i > 0 && errors.Is(err, store.ErrNotOwner) {
			// An earlier attempt whose reply was lost may have applied.
			return ErrProbablyApplied
		}
		if err == nil || errors.Is(err, store.ErrNotOwner) || i == len(SettleRetries) {
			return err
		}
		p.storeError("retry")
		time.Sleep(SettleRetries[i])
	}
}

// Go runs fn on a new goroutine that recovers from a panic (reported to
// Options.Panicked).
func (p *Protocol) Go(where string, fn func()) {
	go func() {
		defer p.recoverAs(where)
		fn()
	}()
}

// recoverAs stops a panic from ending the process when deferred at the top
// of a goroutine; it reports the panic to Options.Panicked.
func (p *Protocol) recoverAs(where string) {
	if v := recover(); v != nil {
		p.panicked(where, v)
	}
}

// Track counts work a front end runs on its own goroutine for a call until
// done is called, so that Drain waits for it too.
func (p *Protocol) Track() (done func()) {
	p.running.add()
	return sync.OnceFunc(p.running.done)
}

// Drain waits until every call Run started has been settled (and all
// tracked work is done), or ctx ends.
func (p *Protocol) Drain(ctx context.Context) error {
	select {
	case <-p.running.idle():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// activity counts work in progress. Unlike a WaitGroup, new work may start
// while someone waits for it to drop to zero.
type activity struct {
	mu   sync.Mutex
	n    int
	zero chan struct{} // closed while n == 0
}

func (a *activity) add() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.n == 0 {
		a.zero = make(chan struct{})
	}
	a.n++
}

func (a *activity) done() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.n--
	if a.n == 0 {
		close(a.zero)
	}
}

// idle returns a channel closed when no work is in progress.
func (a *activity) idle() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.n == 0 {
		c := make(chan struct{})
		close(c)
		return c
	}
	return a.zero
}
