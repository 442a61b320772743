package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/test/poll"
)

// blockingUpstream is an upstream whose calls run until released, counting
// how many ran.
type blockingUpstream struct {
	ran     atomic.Int32
	release chan struct{}
}

func (u *blockingUpstream) forward(context.Context) (Upstream, error) {
	u.ran.Add(1)
	<-u.release
	return Upstream{Status: 200, Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[]}}`)}, nil
}

func planFor(t *testing.T, e *Engine, args string, c Caller) *Plan {
	t.Helper()
	tc, err := ParseToolCall(json.RawMessage(`{"name":"charge","arguments":` + args + `}`))
	if err != nil {
		t.Fatal(err)
	}
	p, err := e.Plan(tc, c)
	if err != nil || p == nil {
		t.Fatalf("Plan: %v, %v", p, err)
	}
	return p
}

// Duplicates waiting on one call in flight are bounded per key and per
// principal: over a bound a call is refused with -32017 and nothing runs;
// another principal still waits and gets the result.
func TestWaitersAreBounded(t *testing.T) {
	e := New(Options{
		Policy:                 mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Global, waitTimeout: 20s}"),
		Store:                  store.NewMemory(0),
		MaxWaitersPerKey:       2,
		MaxWaitersPerPrincipal: 2,
	})
	up := &blockingUpstream{release: make(chan struct{})}
	mallory := Caller{Principal: "Bearer mallory"}
	alice := Caller{Principal: "Bearer alice"}

	var wg sync.WaitGroup
	results := make(chan error, 16)
	run := func(args string, c Caller) {
		p := planFor(t, e, args, c)
		wg.Go(func() {
			out, err := e.Execute(context.Background(), p, up.forward)
			if err == nil && out.Kind != Executed && out.Kind != Replayed {
				err = fmt.Errorf("kind %v", out.Kind)
			}
			results <- err
		})
	}
	// Owners of two keys (owners are not waiters).
	run(`{"n":1}`, mallory)
	run(`{"n":2}`, mallory)
	poll.Within(t, 10*time.Second, "both first calls to run", poll.True(func() bool { return up.ran.Load() == 2 }))
	// Mallory's two duplicates wait; her third is over her bound.
	run(`{"n":1}`, mallory)
	run(`{"n":2}`, mallory)
	poll.Within(t, 10*time.Second, "two waiters", poll.True(func() bool { return e.Waiting() == 2 }))
	_, err := e.Execute(context.Background(), planFor(t, e, `{"n":2}`, mallory), up.forward)
	var ee *Error
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeOverloaded || up.ran.Load() != 2 {
		t.Fatalf("mallory's third waiter: %v (ran %d); want -32017 and nothing run", err, up.ran.Load())
	}
	// Alice is not starved by Mallory: she waits on key 1 (its second
	// waiter), and a third waiter on key 1 is over the key's bound.
	run(`{"n":1}`, alice)
	poll.Within(t, 10*time.Second, "alice waiting", poll.True(func() bool { return e.Waiting() == 3 }))
	_, err = e.Execute(context.Background(), planFor(t, e, `{"n":1}`, Caller{Principal: "Bearer carol"}), up.forward)
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeOverloaded {
		t.Fatalf("a third waiter on one key: %v; want -32017", err)
	}
	close(up.release)
	wg.Wait()
	close(results)
	for err := range results {
		if err != nil {
			t.Errorf("a call within the bounds: %v", err)
		}
	}
	if n := up.ran.Load(); n != 2 {
		t.Errorf("the tool ran %d times, want 2", n)
	}
	if n := e.Waiting(); n != 0 {
		t.Errorf("%d waiters left after every call ended", n)
	}
	if n := counter(e.Metrics().OverLimit.WithLabelValues(LimitWaitersPerPrincipal)); n != 1 {
		t.Errorf(`idemcp_over_limit_total{limit="waiters_per_principal"} = %v, want 1`, n)
	}
	if n := counter(e.Metrics().OverLimit.WithLabelValues(LimitWaitersPerKey)); n != 1 {
		t.Errorf(`idemcp_over_limit_total{limit="waiters_per_key"} = %v, want 1`, n)
	}
}

// One principal filling the memory store with cheap distinct calls evicts
// its own results, never another principal's: every retry of Alice's calls
// is still a replay after Mallory's flood, in records and in bytes.
func TestMemoryStoreFairness(t *testing.T) {
	for _, tt := range []struct {
		name       string
		maxEntries int
		maxBytes   int64
		aliceBody  int
	}{
		{"records", 64, 0, 10},
		{"bytes", 0, 64 << 10, 2 << 10},
	} {
		t.Run(tt.name, func(t *testing.T) {
			mem := store.NewMemorySized(tt.maxEntries, tt.maxBytes)
			t.Cleanup(func() { _ = mem.Close() })
			e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Principal}"), Store: mem})
			var ran atomic.Int32
			respond := func(body int) Forward {
				return func(context.Context) (Upstream, error) {
					ran.Add(1)
					resp := fmt.Sprintf(`{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"%s"}]}}`, pad(body))
					return Upstream{Status: 200, Response: []byte(resp)}, nil
				}
			}
			alice := Caller{Principal: "Bearer alice"}
			mallory := Caller{Principal: "Bearer mallory"}
			for i := range 8 {
				if _, err := e.Execute(context.Background(), planFor(t, e, fmt.Sprintf(`{"order":%d}`, i), alice), respond(tt.aliceBody)); err != nil {
					t.Fatal(err)
				}
			}
			for i := range 2000 {
				if _, err := e.Execute(context.Background(), planFor(t, e, fmt.Sprintf(`{"spam":%d}`, i), mallory), respond(10)); err != nil {
					t.Fatal(err)
				}
			}
			before := ran.Load()
			for i := range 8 {
				out, err := e.Execute(context.Background(), planFor(t, e, fmt.Sprintf(`{"order":%d}`, i), alice), respond(tt.aliceBody))
				if err != nil || out.Kind != Replayed {
					t.Errorf("alice's retry %d after mallory's flood: %v, %v; want a replay", i, out.Kind, err)
				}
			}
			if n := ran.Load() - before; n != 0 {
				t.Errorf("alice's retries ran %d calls again", n)
			}
			// Mallory's oldest results made the room.
			out, err := e.Execute(context.Background(), planFor(t, e, `{"spam":0}`, mallory), respond(10))
			if err != nil || out.Kind != Executed {
				t.Errorf("mallory's first call after her flood: %v, %v; want it evicted and run again", out.Kind, err)
			}
			if tt.maxEntries > 0 && mem.Len() > tt.maxEntries {
				t.Errorf("store holds %d records, over its bound %d", mem.Len(), tt.maxEntries)
			}
			if tt.maxBytes > 0 && mem.Bytes() > tt.maxBytes {
				t.Errorf("store holds %d bytes, over its bound %d", mem.Bytes(), tt.maxBytes)
			}
		})
	}
}

func pad(n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = 'x'
	}
	return string(b)
}

// Calls running upstream are bounded per principal and in all, those
// whose client hung up included: a caller that starts calls and leaves
// at once cannot make the sidecar hold more of them than its bound. Over
// a bound the call is answered -32017 and nothing runs; its claim is
// released, so the same call runs once the caller is under its bound,
// and another principal is served meanwhile.
func TestRunningCallsAreBounded(t *testing.T) {
	e := New(Options{
		Policy:                 mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Principal, onAbandoned: Error}"),
		Store:                  store.NewMemory(0),
		MaxRunningPerPrincipal: 3,
		MaxRunning:             4,
	})
	up := &blockingUpstream{release: make(chan struct{})}
	mallory := Caller{Principal: "Bearer mallory"}
	alice := Caller{Principal: "Bearer alice"}
	bob := Caller{Principal: "Bearer bob"}

	// Mallory starts three calls and hangs up on each: they go on.
	for i := range 3 {
		ctx, cancel := context.WithCancel(context.Background())
		p := planFor(t, e, fmt.Sprintf(`{"n":%d}`, i), mallory)
		go func() { _, _ = e.Execute(ctx, p, up.forward) }()
		poll.Within(t, 10*time.Second, "mallory's call to run", poll.True(func() bool { return up.ran.Load() == int32(i+1) }))
		cancel()
	}
	var ee *Error
	_, err := e.Execute(context.Background(), planFor(t, e, `{"n":3}`, mallory), up.forward)
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeOverloaded || up.ran.Load() != 3 {
		t.Fatalf("mallory's fourth call: %v (ran %d); want -32017 and nothing run", err, up.ran.Load())
	}
	// Alice is not starved: she runs the sidecar's fourth call.
	aliceDone := make(chan error, 1)
	go func() {
		_, err := e.Execute(context.Background(), planFor(t, e, `{"n":0}`, alice), up.forward)
		aliceDone <- err
	}()
	poll.Within(t, 10*time.Second, "alice's call to run", poll.True(func() bool { return up.ran.Load() == 4 }))
	// Bob is over the sidecar's total.
	_, err = e.Execute(context.Background(), planFor(t, e, `{"n":0}`, bob), up.forward)
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeOverloaded || up.ran.Load() != 4 {
		t.Fatalf("bob's call over the total: %v (ran %d); want -32017 and nothing run", err, up.ran.Load())
	}
	if n := e.Running(); n != 4 {
		t.Errorf("%d calls running, want 4", n)
	}
	close(up.release)
	if err := <-aliceDone; err != nil {
		t.Fatalf("alice's call: %v", err)
	}
	poll.Within(t, 10*time.Second, "the calls to end", poll.True(func() bool { return e.Running() == 0 }))
	// Mallory's refused call was released, not left "outcome unknown":
	// it runs now.
	out, err := e.Execute(context.Background(), planFor(t, e, `{"n":3}`, mallory), up.forward)
	if err != nil || out.Kind != Executed {
		t.Fatalf("mallory's refused call, retried under her bound: %v, %v; want it run", out.Kind, err)
	}
	if n := up.ran.Load(); n != 5 {
		t.Errorf("the tool ran %d times, want 5", n)
	}
	if n := counter(e.Metrics().OverLimit.WithLabelValues(LimitRunningPerPrincipal)); n != 1 {
		t.Errorf(`idemcp_over_limit_total{limit="running_per_principal"} = %v, want 1`, n)
	}
	if n := counter(e.Metrics().OverLimit.WithLabelValues(LimitRunningTotal)); n != 1 {
		t.Errorf(`idemcp_over_limit_total{limit="running_total"} = %v, want 1`, n)
	}
	// A call's slot is given back once it is settled, which may come just
	// after its caller has the answer.
	poll.Within(t, 10*time.Second, "idemcp_calls_running to be 0 after every call ended", func() error {
		if n := gauge(e.Metrics().Running); n != 0 {
			return fmt.Errorf("idemcp_calls_running = %v", n)
		}
		return nil
	})
}
