package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/idemcp/idemcp/idempotency"
	"github.com/idemcp/idemcp/internal/store"
)

// Options out of range are an error naming the option and what it
// accepts, from Validate and from every Do; nothing runs, and nothing
// panics (a Lease of a few nanoseconds used to end the process from a
// renewal goroutine).
func TestInvalidOptionsAreErrors(t *testing.T) {
	tests := []struct {
		name string
		o    idempotency.Options
		want string
	}{
		{"lease of nanoseconds", idempotency.Options{Lease: 2}, "Options.Lease is 2ns; use 0 for the default (30s) or a lease of at least 100ms"},
		{"negative lease", idempotency.Options{Lease: -time.Second}, "Options.Lease is -1s"},
		{"negative TTL", idempotency.Options{TTL: -time.Hour}, "Options.TTL is -1h0m0s; use 0 for the default (24h) or a TTL of at least 1ms"},
		{"TTL under a millisecond", idempotency.Options{TTL: time.Microsecond}, "Options.TTL is 1µs"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.o.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Validate() = %v, want an error saying %q", err, tt.want)
			}
			g := idempotency.NewGroup(idempotency.NewMemoryStore(), tt.o)
			ran := false
			_, _, err := g.Do(context.Background(), "k", "fp", func(context.Context) ([]byte, error) {
				ran = true
				return []byte("ok"), nil
			})
			if err == nil || !strings.Contains(err.Error(), tt.want) || ran {
				t.Errorf("Do = %v (fn ran: %v), want an error saying %q and no run", err, ran, tt.want)
			}
		})
	}
	if err := (idempotency.Options{Lease: idempotency.MinLease, TTL: idempotency.MinTTL, WaitTimeout: -1}).Validate(); err != nil {
		t.Errorf("the smallest accepted options: %v", err)
	}
	if _, _, err := idempotency.NewGroup(nil, idempotency.Options{}).Do(context.Background(), "k", "fp", nil); err == nil || !strings.Contains(err.Error(), "no Store") {
		t.Errorf("a Group with no store: Do = %v, want an error saying so", err)
	}
}

// A panic in fn is returned as a *PanicError (outcome unknown), the key is
// free again in this process, and once the claim's lease runs out the
// next call takes it over and runs fn (AbandonedError unset).
func TestPanicInFnIsOutcomeUnknown(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := store.NewMemory(0)
		defer func() { _ = st.Close() }()
		g := idempotency.NewGroup(st, idempotency.Options{Lease: time.Second, WaitTimeout: time.Minute})
		_, _, err := g.Do(context.Background(), "k", "fp", func(context.Context) ([]byte, error) { panic("a bug in fn") })
		var pe *idempotency.PanicError
		if !errors.As(err, &pe) || pe.Value != "a bug in fn" || !errors.Is(err, idempotency.ErrOutcomeUnknown) {
			t.Fatalf("Do with a panicking fn = %v, want a *PanicError matching ErrOutcomeUnknown", err)
		}
		start := time.Now()
		v, replayed, err := g.Do(context.Background(), "k", "fp", func(context.Context) ([]byte, error) { return []byte("ran"), nil })
		if err != nil || replayed || string(v) != "ran" {
			t.Fatalf("the next call = %q %v %v, want fn to run once the lease ran out", v, replayed, err)
		}
		if waited := time.Since(start); waited != time.Second {
			t.Errorf("the next call ran after %v, want after the rest of the lease (1s)", waited)
		}
	})
}

// A caller that goes away while fn runs gets ctx's error at once; fn goes
// on, its result is kept, Drain waits for it, and the retry gets it.
func TestCallerGoneWhileFnRuns(t *testing.T) {
	g := idempotency.NewGroup(idempotency.NewMemoryStore(), idempotency.Options{})
	ctx, cancel := context.WithCancel(context.Background())
	started, finish := make(chan struct{}), make(chan struct{})
	runs := 0
	go func() {
		<-started
		cancel()
	}()
	_, _, err := g.Do(ctx, "k", "fp", func(ctx context.Context) ([]byte, error) {
		runs++
		close(started)
		<-finish
		return []byte("charged"), ctx.Err()
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Do after its caller went away = %v, want context.Canceled", err)
	}
	short, stop := context.WithCancel(context.Background())
	stop()
	if err := g.Drain(short); !errors.Is(err, context.Canceled) {
		t.Fatalf("Drain while fn still runs = %v, want it to wait (here: until its ctx ends)", err)
	}
	close(finish)
	if err := g.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	v, replayed, err := g.Do(context.Background(), "k", "fp", func(context.Context) ([]byte, error) {
		runs++
		return []byte("charged again"), nil
	})
	if err != nil || !replayed || string(v) != "charged" || runs != 1 {
		t.Fatalf("the retry = %q %v %v, fn ran %d times; want the kept result and one run", v, replayed, err, runs)
	}
}

// A caller whose context has ended before fn starts runs nothing, and
// leaves the key free for the next call.
func TestCancelledCallerRunsNothing(t *testing.T) {
	g := idempotency.NewGroup(idempotency.NewMemoryStore(), idempotency.Options{WaitTimeout: -1})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	runs := 0
	fn := func(context.Context) ([]byte, error) {
		runs++
		return []byte("ok"), nil
	}
	if _, _, err := g.Do(ctx, "k", "fp", fn); !errors.Is(err, context.Canceled) || runs != 0 {
		t.Fatalf("Do with a cancelled context = %v, fn ran %d times; want context.Canceled and no run", err, runs)
	}
	if v, _, err := g.Do(context.Background(), "k", "fp", fn); err != nil || string(v) != "ok" || runs != 1 {
		t.Fatalf("the next call = %q %v, fn ran %d times; want the key free and fn run", v, err, runs)
	}
}

// down is a store that cannot be reached.
type down struct{ idempotency.Store }

func (down) Reserve(context.Context, store.Claim) (store.Reservation, error) {
	return store.Reservation{}, fmt.Errorf("dial tcp: connection refused: %w", store.ErrUnavailable)
}

// With the store down, FailOpen runs fn undeduplicated, and a panic in it
// is a *PanicError as in a claimed call; without FailOpen nothing runs.
func TestStoreDown(t *testing.T) {
	st := down{idempotency.NewMemoryStore()}
	runs := 0
	fn := func(context.Context) ([]byte, error) {
		runs++
		return []byte("ok"), nil
	}
	if _, _, err := idempotency.NewGroup(st, idempotency.Options{}).Do(context.Background(), "k", "fp", fn); !errors.Is(err, idempotency.ErrStoreUnavailable) || runs != 0 {
		t.Fatalf("store down: Do = %v, fn ran %d times; want ErrStoreUnavailable and no run", err, runs)
	}
	open := idempotency.NewGroup(st, idempotency.Options{FailOpen: true})
	if v, replayed, err := open.Do(context.Background(), "k", "fp", fn); err != nil || replayed || string(v) != "ok" || runs != 1 {
		t.Fatalf("store down, FailOpen: Do = %q %v %v, fn ran %d times; want fn run", v, replayed, err, runs)
	}
	var pe *idempotency.PanicError
	if _, _, err := open.Do(context.Background(), "k", "fp", func(context.Context) ([]byte, error) { panic("boom") }); !errors.As(err, &pe) {
		t.Fatalf("store down, FailOpen, fn panics: Do = %v, want a *PanicError", err)
	}
}

// panickyStore is a user's Store whose first Reserve panics once the test
// lets it.
type panickyStore struct {
	idempotency.Store
	calls            int
	entered, release chan struct{}
}

func (s *panickyStore) Reserve(ctx context.Context, c store.Claim) (store.Reservation, error) {
	s.calls++
	if s.calls == 1 {
		close(s.entered)
		<-s.release
		panic("a bug in the store")
	}
	return s.Store.Reserve(ctx, c)
}

// A Store that panics under the first call of a key: that call panics
// on (the panic is the caller's, from the caller's Store), the calls of
// this process waiting for it get a *PanicError, not a result nobody
// produced, and the next call runs fn.
func TestStorePanicFailsTheCallsWaitingInProcess(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := store.NewMemory(0)
		defer func() { _ = mem.Close() }()
		st := &panickyStore{Store: mem, entered: make(chan struct{}), release: make(chan struct{})}
		g := idempotency.NewGroup(st, idempotency.Options{})
		fn := func(context.Context) ([]byte, error) { return []byte("ran"), nil }
		leader := make(chan any)
		go func() {
			defer func() { leader <- recover() }()
			_, _, _ = g.Do(context.Background(), "k", "fp", fn)
		}()
		<-st.entered
		type result struct {
			v        []byte
			replayed bool
			err      error
		}
		waiter := make(chan result)
		go func() {
			v, replayed, err := g.Do(context.Background(), "k", "fp", fn)
			waiter <- result{v, replayed, err}
		}()
		synctest.Wait() // the waiter waits for the leader
		close(st.release)
		if p := <-leader; p != "a bug in the store" {
			t.Errorf("the first call recovered %v, want the store's panic to go on", p)
		}
		r := <-waiter
		var pe *idempotency.PanicError
		if !errors.As(r.err, &pe) || !errors.Is(r.err, idempotency.ErrOutcomeUnknown) || r.replayed || r.v != nil {
			t.Fatalf("the call waiting in process = %q %v %v, want a *PanicError matching ErrOutcomeUnknown", r.v, r.replayed, r.err)
		}
		if v, replayed, err := g.Do(context.Background(), "k", "fp", fn); err != nil || replayed || string(v) != "ran" {
			t.Fatalf("the next call = %q %v %v, want fn to run", v, replayed, err)
		}
	})
}

// An fn that ends its goroutine without returning (runtime.Goexit, as
// t.FailNow does) is answered as a panic: a *PanicError with no value,
// not a Do that never returns.
func TestFnThatExitsItsGoroutineIsOutcomeUnknown(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := store.NewMemory(0)
		defer func() { _ = st.Close() }()
		g := idempotency.NewGroup(st, idempotency.Options{})
		_, _, err := g.Do(context.Background(), "k", "fp", func(context.Context) ([]byte, error) {
			runtime.Goexit()
			return nil, nil
		})
		var pe *idempotency.PanicError
		if !errors.As(err, &pe) || pe.Value != nil || !errors.Is(err, idempotency.ErrOutcomeUnknown) {
			t.Fatalf("Do with an fn that exits its goroutine = %v, want a *PanicError with no value", err)
		}
		if err := g.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
}

// panic(nil) under GODEBUG=panicnil=1 recovers as nil: it is still a
// panic, claimed or not (FailOpen), never a success. The test runs itself
// again with that setting.
func TestPanicNilIsOutcomeUnknown(t *testing.T) {
	if os.Getenv("IDEMCP_TEST_PANICNIL") == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestPanicNilIsOutcomeUnknown$", "-test.v", "-test.timeout=60s")
		cmd.Env = append(os.Environ(), "IDEMCP_TEST_PANICNIL=1", "GODEBUG=panicnil=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("under GODEBUG=panicnil=1: %v\n%s", err, out)
		}
		return
	}
	synctest.Test(t, func(t *testing.T) {
		st := store.NewMemory(0)
		defer func() { _ = st.Close() }()
		for name, g := range map[string]*idempotency.Group{
			"claimed":  idempotency.NewGroup(st, idempotency.Options{}),
			"FailOpen": idempotency.NewGroup(down{st}, idempotency.Options{FailOpen: true}),
		} {
			v, _, err := g.Do(context.Background(), "k-"+name, "fp", func(context.Context) ([]byte, error) { panic(nil) })
			var pe *idempotency.PanicError
			if !errors.As(err, &pe) || pe.Value != nil || v != nil {
				t.Errorf("%s: Do with fn panicking with nil = %q %v, want a *PanicError with no value", name, v, err)
			}
		}
	})
}

// failingRelease is a store whose Reserve wins as its caller goes away,
// and whose Releases fail the first two times.
type failingRelease struct {
	idempotency.Store
	cancel   func()
	releases int
}

func (s *failingRelease) Reserve(ctx context.Context, c store.Claim) (store.Reservation, error) {
	r, err := s.Store.Reserve(context.WithoutCancel(ctx), c)
	s.cancel()
	return r, err
}

func (s *failingRelease) Release(ctx context.Context, key, owner string) error {
	if s.releases++; s.releases <= 2 {
		return fmt.Errorf("dial tcp: connection refused: %w", store.ErrUnavailable)
	}
	return s.Store.Release(ctx, key, owner)
}

// A caller that goes away as its claim is won gets ctx's error once the
// first attempt to release the claim is made, not after the retries a
// failing store needs: those go on in the background, Drain waits for
// them, and then the key is free.
func TestCallerGoneBeforeFnStartsIsAnsweredAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := store.NewMemory(0)
		defer func() { _ = mem.Close() }()
		ctx, cancel := context.WithCancel(context.Background())
		st := &failingRelease{Store: mem, cancel: cancel}
		g := idempotency.NewGroup(st, idempotency.Options{})
		runs := 0
		fn := func(context.Context) ([]byte, error) {
			runs++
			return []byte("ran"), nil
		}
		start := time.Now()
		if _, _, err := g.Do(ctx, "k", "fp", fn); !errors.Is(err, context.Canceled) || runs != 0 {
			t.Fatalf("Do whose caller went away before fn = %v (%d runs), want context.Canceled and no run", err, runs)
		}
		if d := time.Since(start); d != 0 {
			t.Errorf("the caller that went away was answered after %v, want at once", d)
		}
		if err := g.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
		if d, want := time.Since(start), 250*time.Millisecond; d != want {
			t.Errorf("Drain returned after %v, want once the release got through, after two retries (%v)", d, want)
		}
		if v, _, err := g.Do(context.Background(), "k", "fp", fn); err != nil || string(v) != "ran" || runs != 1 {
			t.Fatalf("the next call = %q %v (%d runs), want the key free and fn run", v, err, runs)
		}
	})
}
