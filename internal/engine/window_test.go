package engine

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store"
)

// fakeClock is a time a test moves by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// settledStore tells when a record is settled, so that a test moves its
// clock only once the first call's result is stored.
type settledStore struct {
	*store.Memory
	settled chan time.Duration
}

func (s *settledStore) Complete(ctx context.Context, key, owner string, response []byte, ttl time.Duration) error {
	err := s.Memory.Complete(ctx, key, owner, response, ttl)
	s.settled <- ttl
	return err
}

// waitingStore tells when a duplicate starts to wait on a claim.
type waitingStore struct {
	*store.Memory
	waiting chan struct{}
}

func (s *waitingStore) Wait(ctx context.Context, key string) error {
	s.waiting <- struct{}{}
	return s.Memory.Wait(ctx, key)
}

// TestRetryWindow: a derived key is replayed for retryWindow, then the same
// call runs again and its new result is kept for the window; an explicit
// key is replayed for ttl.
func TestRetryWindow(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1_000_000, 0)}
	mem := store.NewMemory(0)
	mem.SetClock(clock.Now)
	st := &settledStore{Memory: mem, settled: make(chan time.Duration, 1)}
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, ttl: 1h, retryWindow: 2m, tools: [{name: charge, ttl: 3h, retryWindow: 5m}]}"), Store: st})

	var ran atomic.Int32
	run := func(params string) Kind {
		t.Helper()
		tc, err := ParseToolCall(json.RawMessage(params))
		if err != nil {
			t.Fatal(err)
		}
		p, err := e.Plan(tc, alice)
		if err != nil || p == nil {
			t.Fatalf("Plan(%s) = %v, %v", params, p, err)
		}
		out, err := e.Execute(context.Background(), p, func(context.Context) (Upstream, error) {
			n := ran.Add(1)
			return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"run":` + strconv.Itoa(int(n)) + `}}`), Status: 200}, nil
		})
		if err != nil {
			t.Fatalf("Execute(%s): %v", params, err)
		}
		if out.Kind == Executed {
			<-st.settled
		}
		return out.Kind
	}
	steps := []struct {
		name    string
		advance time.Duration
		params  string
		want    Kind
		ran     int32
	}{
		{"first call", 0, `{"name":"send","arguments":{"to":"bob"}}`, Executed, 1},
		{"retry inside the window", 119 * time.Second, `{"name":"send","arguments":{"to":"bob"}}`, Replayed, 1},
		{"deliberate repeat after the window", 2 * time.Second, `{"name":"send","arguments":{"to":"bob"}}`, Executed, 2},
		{"retry of the repeat, inside its own window", 119 * time.Second, `{"name":"send","arguments":{"to":"bob"}}`, Replayed, 2},
		{"explicit key", 0, `{"name":"send","arguments":{"to":"bob"},"_meta":{"idempotency-key":"k1"}}`, Executed, 3},
		{"explicit key after the window, inside ttl", 59 * time.Minute, `{"name":"send","arguments":{"to":"bob"},"_meta":{"idempotency-key":"k1"}}`, Replayed, 3},
		{"explicit key after ttl", 2 * time.Minute, `{"name":"send","arguments":{"to":"bob"},"_meta":{"idempotency-key":"k1"}}`, Executed, 4},
		{"a rule's own window", 0, `{"name":"charge","arguments":{}}`, Executed, 5},
		{"inside the rule's window, past the spec's", 4 * time.Minute, `{"name":"charge","arguments":{}}`, Replayed, 5},
		{"past the rule's window", 2 * time.Minute, `{"name":"charge","arguments":{}}`, Executed, 6},
	}
	for _, s := range steps {
		clock.Add(s.advance)
		if got := run(s.params); got != s.want || ran.Load() != s.ran {
			t.Fatalf("%s: kind %v, %d runs; want %v, %d runs", s.name, got, ran.Load(), s.want, s.ran)
		}
	}
}

// TestRetryWindowNeverCutsARunningCall: a call still running when its
// window has passed is not run a second time; the duplicate waits for it.
func TestRetryWindowNeverCutsARunningCall(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1_000_000, 0)}
	mem := store.NewMemory(0)
	mem.SetClock(clock.Now)
	st := &waitingStore{Memory: mem, waiting: make(chan struct{}, 1)}
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, retryWindow: 1s, leaseDuration: 1h}"), Store: st})
	tc, _ := ParseToolCall(json.RawMessage(`{"name":"slow","arguments":{}}`))
	p, _ := e.Plan(tc, alice)

	var ran atomic.Int32
	started, release := make(chan struct{}), make(chan struct{})
	fwd := func(context.Context) (Upstream, error) {
		ran.Add(1)
		close(started)
		<-release
		return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{}}`), Status: 200}, nil
	}
	first := make(chan error, 1)
	go func() { _, err := e.Execute(context.Background(), p, fwd); first <- err }()
	<-started
	clock.Add(10 * time.Minute) // far past the window, inside the lease

	dup := make(chan Outcome, 1)
	go func() {
		out, err := e.Execute(context.Background(), p, func(context.Context) (Upstream, error) {
			ran.Add(1)
			return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":2,"result":{}}`), Status: 200}, nil
		})
		if err != nil {
			t.Error(err)
		}
		dup <- out
	}()
	select {
	case <-st.waiting:
	case out := <-dup:
		t.Fatalf("the duplicate did not wait for the running call: %v, %d runs", out.Kind, ran.Load())
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if out := <-dup; out.Kind != Replayed || ran.Load() != 1 {
		t.Fatalf("duplicate of a running call past its window: %v, %d runs; want a replay and 1 run", out.Kind, ran.Load())
	}
}

type ownerStore struct {
	*store.Memory
	mu    sync.Mutex
	owner string
}

func (s *ownerStore) Reserve(ctx context.Context, c store.Claim) (store.Reservation, error) {
	r, err := s.Memory.Reserve(ctx, c)
	if err == nil && r.State == store.Won {
		s.mu.Lock()
		if s.owner == "" {
			s.owner = c.Owner
		}
		s.mu.Unlock()
	}
	return r, err
}

// abandonedLongCall runs a derived-key call under onAbandoned: Error for 3h
// (renewed, its sidecar alive), lets its sidecar die, and retries once the
// lease is over; it returns how often the tool ran.
func abandonedLongCall(t *testing.T, window string) int32 {
	clock := &fakeClock{now: time.Unix(1_000_000, 0)}
	mem := store.NewMemory(0)
	mem.SetClock(clock.Now)
	st := &ownerStore{Memory: mem}
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, onAbandoned: Error, leaseDuration: 1h, retryWindow: "+window+"}"), Store: st})
	tc, _ := ParseToolCall(json.RawMessage(`{"name":"transfer","arguments":{"amount":100}}`))
	p, _ := e.Plan(tc, alice)
	var ran atomic.Int32
	started := make(chan struct{})
	never := make(chan struct{})
	go func() {
		_, _ = e.Execute(context.Background(), p, func(context.Context) (Upstream, error) {
			ran.Add(1)
			close(started)
			<-never
			return Upstream{}, context.Canceled
		})
	}()
	<-started
	st.mu.Lock()
	owner := st.owner
	st.mu.Unlock()
	// The call runs 3h, renewed every 20m (the sidecar alive).
	for i := 0; i < 9; i++ {
		clock.Add(20 * time.Minute)
		if err := mem.Renew(context.Background(), p.Key, owner, time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	// The sidecar dies now: no more renewals. An agent retries once the
	// lease has run out.
	clock.Add(time.Hour + time.Second)
	p2, _ := e.Plan(tc, alice)
	_, err := e.Execute(context.Background(), p2, func(context.Context) (Upstream, error) {
		ran.Add(1)
		return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":2,"result":{}}`), Status: 200}, nil
	})
	var ee *Error
	if ran.Load() == 1 && (!errors.As(err, &ee) || ee.Code != mcpmsg.CodeOutcomeUnknown) {
		t.Errorf("window %s: the retry got %v, want outcome unknown (%d)", window, err, mcpmsg.CodeOutcomeUnknown)
	}
	return ran.Load()
}

// TestAbandonedCallLongerThanItsWindowIsOutcomeUnknown: under onAbandoned:
// Error, a derived-key call that ran longer than its retryWindow and whose
// sidecar then died answers "outcome unknown" to the next retry; it does
// not run again. Its pending record was kept for the window from its start,
// so it lapsed with the lease and the retry won the key (ran twice before).
func TestAbandonedCallLongerThanItsWindowIsOutcomeUnknown(t *testing.T) {
	for _, window := range []string{"24h", "1m"} {
		if n := abandonedLongCall(t, window); n != 1 {
			t.Errorf("retryWindow %s, onAbandoned: Error: the call ran %d times", window, n)
		}
	}
}
