package claim_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/idemcp/idemcp/internal/claim"
	"github.com/idemcp/idemcp/internal/store"
)

// settling is a store whose Completes fail as a test says, recording when
// each was attempted.
type settling struct {
	*store.Memory
	mu sync.Mutex
	at []time.Duration
	// outcome decides attempt n (from 0): apply it or not, and what to return.
	outcome func(n int) (apply bool, err error)
	start   time.Time
}

func (s *settling) Complete(ctx context.Context, key, owner string, resp []byte, ttl time.Duration) error {
	s.mu.Lock()
	n := len(s.at)
	s.at = append(s.at, time.Since(s.start))
	s.mu.Unlock()
	apply, err := s.outcome(n)
	if apply {
		if cerr := s.Memory.Complete(ctx, key, owner, resp, ttl); cerr != nil {
			return cerr
		}
	}
	return err
}

// A result is retried into a store that keeps failing on the whole
// schedule, about 16 s, before the protocol gives up; the caller is
// answered after the first attempt, not after the last.
func TestCompleteRetrySchedule(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := &settling{Memory: store.NewMemory(0), start: time.Now(), outcome: func(int) (bool, error) {
			return false, fmt.Errorf("read tcp: i/o timeout: %w", store.ErrUnavailable)
		}}
		defer func() { _ = st.Close() }()
		p := claim.New(claim.Options{Store: st})
		var answeredAt time.Duration = -1
		err := p.Complete(context.Background(), "k", "o", []byte("r"), time.Hour, func() { answeredAt = time.Since(st.start) })
		if !errors.Is(err, store.ErrUnavailable) {
			t.Fatalf("Complete into a failing store = %v, want its last error", err)
		}
		want := []time.Duration{0}
		for _, pause := range claim.SettleRetries {
			want = append(want, want[len(want)-1]+pause)
		}
		if !slices.Equal(st.at, want) {
			t.Errorf("attempts at %v, want %v", st.at, want)
		}
		if last := want[len(want)-1]; last < 15*time.Second {
			t.Errorf("the schedule gives up after %v, want it to outlast an outage of several seconds", last)
		}
		if answeredAt != 0 {
			t.Errorf("the caller was answered at %v, want right after the first attempt", answeredAt)
		}
	})
}

// A retried write that finds the claim gone most likely follows an attempt
// whose reply was lost after it applied.
func TestCompleteProbablyApplied(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := &settling{Memory: store.NewMemory(0), start: time.Now()}
		st.outcome = func(n int) (bool, error) {
			if n == 0 {
				return true, fmt.Errorf("read tcp: i/o timeout: %w", store.ErrUnavailable) // applied, reply lost
			}
			return true, nil // the store answers: not this owner's claim any more
		}
		defer func() { _ = st.Close() }()
		if _, err := st.Reserve(context.Background(), store.Claim{Key: "k", Fingerprint: "f", Owner: "o", Lease: time.Minute, Retention: time.Hour}); err != nil {
			t.Fatal(err)
		}
		p := claim.New(claim.Options{Store: st})
		if err := p.Complete(context.Background(), "k", "o", []byte("r"), time.Hour, func() {}); !errors.Is(err, claim.ErrProbablyApplied) {
			t.Fatalf("Complete = %v, want ErrProbablyApplied", err)
		}
		r, err := st.Reserve(context.Background(), store.Claim{Key: "k", Fingerprint: "f", Owner: "o2", Lease: time.Minute, Retention: time.Hour})
		if err != nil || r.State != store.Completed || string(r.Response) != "r" {
			t.Fatalf("after Complete: %v %v, want the result stored", r, err)
		}
	})
}

// hanging is a store whose first renewal never answers.
type hanging struct {
	*store.Memory
	mu    sync.Mutex
	start time.Time
	at    []time.Duration // when each renewal ended
	errs  []error
}

func (h *hanging) Renew(ctx context.Context, key, owner string, lease time.Duration) error {
	h.mu.Lock()
	first := len(h.at) == 0
	h.mu.Unlock()
	var err error
	if first {
		<-ctx.Done()
		err = ctx.Err()
	} else {
		err = h.Memory.Renew(ctx, key, owner, lease)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.at, h.errs = append(h.at, time.Since(h.start)), append(h.errs, err)
	return err
}

// A renewal that hangs is given up after lease/3, its share of the lease,
// and retried after RenewRetryMin: the claim never lapses under the call.
func TestHungRenewalIsCutAndRetried(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const lease = 3 * time.Second
		every := lease / 3
		st := &hanging{Memory: store.NewMemory(0), start: time.Now()}
		defer func() { _ = st.Close() }()
		c := store.Claim{Key: "k", Fingerprint: "f", Owner: "o", Lease: lease, Retention: time.Hour}
		p := claim.New(claim.Options{Store: st})
		if r, err := p.Reserve(context.Background(), c, claim.Waits{Timeout: time.Minute}); err != nil || r.State != store.Won {
			t.Fatalf("Reserve = %v, %v", r, err)
		}
		err := p.Run(context.Background(), claim.Held{Key: "k", Owner: "o", Lease: lease}, func(ctx context.Context, answer func(error)) {
			time.Sleep(2 * lease) // the call outlasts its lease twice over
			r, err := st.Reserve(ctx, store.Claim{Key: "k", Fingerprint: "f", Owner: "other", Lease: lease, Retention: time.Hour, TakeOver: true})
			if err != nil || r.State != store.Pending {
				t.Errorf("another caller, after twice the lease: %v %v; want the claim still pending, renewed", r.State, err)
			}
			answer(nil)
		})
		if err != nil {
			t.Fatal(err)
		}
		synctest.Wait() // the renewals have stopped
		st.mu.Lock()
		defer st.mu.Unlock()
		if len(st.at) < 3 {
			t.Fatalf("renewals ended at %v, want the hung one cut, then more", st.at)
		}
		if st.at[0] != 2*every || !errors.Is(st.errs[0], context.DeadlineExceeded) {
			t.Errorf("the hung renewal ended at %v with %v, want it cut at its deadline (%v, lease/3 after it started)", st.at[0], st.errs[0], 2*every)
		}
		if st.at[1] != 2*every+claim.RenewRetryMin || st.errs[1] != nil {
			t.Errorf("the retry ended at %v with %v, want it %v after the cut, and to succeed", st.at[1], st.errs[1], claim.RenewRetryMin)
		}
	})
}

// A call whose goroutine ends without returning (runtime.Goexit, as
// t.FailNow does) is answered like a panic, with no value: its caller is
// not left waiting forever, and the claim lapses with its lease.
func TestRunAnswersACallThatExitsItsGoroutine(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := store.NewMemory(0)
		defer func() { _ = st.Close() }()
		var answered []any
		p := claim.New(claim.Options{Store: st, PanicAnswer: func(_ claim.Held, v any) error {
			answered = append(answered, v)
			return errors.New("outcome unknown")
		}})
		c := store.Claim{Key: "k", Fingerprint: "f", Owner: "o", Lease: time.Second, Retention: time.Hour}
		if r, err := p.Reserve(context.Background(), c, claim.Waits{Timeout: time.Minute}); err != nil || r.State != store.Won {
			t.Fatalf("Reserve = %v, %v", r, err)
		}
		err := p.Run(context.Background(), claim.Held{Key: "k", Owner: "o", Lease: time.Second}, func(context.Context, func(error)) {
			runtime.Goexit()
		})
		if err == nil || err.Error() != "outcome unknown" || len(answered) != 1 || answered[0] != nil {
			t.Fatalf("Run of a call that exits its goroutine = %v (PanicAnswer got %v), want PanicAnswer's error for a nil value", err, answered)
		}
		if err := p.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
		r, err := st.Reserve(context.Background(), store.Claim{Key: "k", Fingerprint: "f", Owner: "next", Lease: time.Second, Retention: time.Hour})
		if err != nil || r.State != store.Pending {
			t.Errorf("the next call at once: %v %v, want the claim kept until its lease runs out", r.State, err)
		}
	})
}

// A lease that is not positive cannot be renewed (its renewal would spin):
// Run refuses it, and the call does not run.
func TestRunRefusesALeaseThatIsNotPositive(t *testing.T) {
	p := claim.New(claim.Options{Store: store.NewMemory(0)})
	for _, lease := range []time.Duration{0, -time.Second} {
		ran := false
		err := p.Run(context.Background(), claim.Held{Key: "k", Owner: "o", Lease: lease}, func(context.Context, func(error)) { ran = true })
		if err == nil || ran {
			t.Errorf("Run with a lease of %v = %v (body ran: %v), want an error and no run", lease, err, ran)
		}
	}
}
