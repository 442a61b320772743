package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemcp/idemcp/sidecar/mcpmsg"
	"github.com/idemcp/idemcp/sidecar/store"
)

func plan(t testing.TB, e *Engine, params string, c Caller) *Plan {
	t.Helper()
	tc, err := ParseToolCall(json.RawMessage(params))
	if err != nil {
		t.Fatal(err)
	}
	p, err := e.Plan(tc, c)
	if err != nil || p == nil {
		t.Fatalf("Plan(%s) = %v, %v; want a plan", params, p, err)
	}
	return p
}

func respond(resp string) Forward {
	return func(context.Context) (Upstream, error) { return Upstream{Response: []byte(resp), Status: 200}, nil }
}

// Whatever JSON value a server sends as result, the call is answered,
// stored and replayed; the marker goes into _meta only where there is an
// object to hold it.
func TestAnyResultIsStoredAndReplayed(t *testing.T) {
	tests := []struct{ result, replay string }{
		{`null`, `null`},
		{`[]`, `[]`},
		{`"x"`, `"x"`},
		{`5`, `5`},
		{`true`, `true`},
		{`{}`, `{"_meta":{"idemcp.io/replayed":true}}`},
		{`{"content":[]}`, `{"_meta":{"idemcp.io/replayed":true},"content":[]}`},
		{`{"_meta":null}`, `{"_meta":{"idemcp.io/replayed":true}}`},
		{`{"a":1, "_meta" : null }`, `{"a":1, "_meta" : {"idemcp.io/replayed":true} }`},
		{`{"_meta":{}}`, `{"_meta":{"idemcp.io/replayed":true}}`},
		{`{"_meta":{"k":"v"}}`, `{"_meta":{"idemcp.io/replayed":true,"k":"v"}}`},
		{`{"_meta":{"idemcp.io/replayed":false}}`, `{"_meta":{"idemcp.io/replayed":true}}`},
		{`{"_meta":5}`, `{"_meta":5}`},
		{`{"_meta":"x","content":[]}`, `{"_meta":"x","content":[]}`},
		{`{"_meta":[]}`, `{"_meta":[]}`},
		{`{"text":"<&>"}`, `{"_meta":{"idemcp.io/replayed":true},"text":"<&>"}`},
	}
	for _, tt := range tests {
		t.Run(tt.result, func(t *testing.T) {
			e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate}"), Store: store.NewMemory(0)})
			p := plan(t, e, `{"name":"t"}`, alice)
			ran := 0
			fwd := func(context.Context) (Upstream, error) {
				ran++
				return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":` + tt.result + `}`), Status: 200}, nil
			}
			if out, err := e.Execute(context.Background(), p, fwd); err != nil || out.Kind != Executed {
				t.Fatalf("first call: %v %v", out.Kind, err)
			}
			out, err := e.Execute(context.Background(), p, fwd)
			if err != nil || out.Kind != Replayed || ran != 1 {
				t.Fatalf("retry: %v %v, ran %d; want a replay and 1 run", out.Kind, err, ran)
			}
			got := string(mcpmsg.WithID(out.Response, json.RawMessage(`7`)))
			want := `{"id":7,"jsonrpc":"2.0","result":` + tt.replay + `}`
			if got != want {
				t.Errorf("replay = %s, want %s", got, want)
			}
			if !json.Valid([]byte(got)) {
				t.Errorf("replay %s is not JSON", got)
			}
		})
	}
}

// panicStore panics where a test says: a stand-in for a bug anywhere on
// the path that settles a call.
type panicStore struct {
	*store.Memory
	panicComplete bool
}

func (s *panicStore) Complete(ctx context.Context, key, owner string, resp []byte, ttl time.Duration) error {
	if s.panicComplete {
		panic("bug while storing")
	}
	return s.Memory.Complete(ctx, key, owner, resp, ttl)
}

// A panic while a call is settled or relayed does not end the process. The
// call's outcome is unknown: its claim is neither stored nor released, so
// after its lease onAbandoned decides (here Error: -32012).
func TestPanicKeepsTheClaimAsOutcomeUnknown(t *testing.T) {
	for _, where := range []string{"settle", "forward"} {
		t.Run(where, func(t *testing.T) {
			ps := &panicStore{Memory: store.NewMemory(0), panicComplete: where == "settle"}
			e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, leaseDuration: 1s, inFlight: Reject, onAbandoned: Error}"), Store: ps})
			p := plan(t, e, `{"name":"t"}`, alice)
			ran := 0
			fwd := func(context.Context) (Upstream, error) {
				ran++
				if where == "forward" {
					panic("bug while relaying")
				}
				return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{}}`), Status: 200}, nil
			}
			out, err := e.Execute(context.Background(), p, fwd)
			var ee *Error
			switch where {
			case "settle":
				// The server's response was relayed before the store failed.
				if err != nil || out.Kind != Executed {
					t.Fatalf("first call: %v %v; want it answered as executed", out.Kind, err)
				}
			case "forward":
				if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeInternalError || !strings.Contains(ee.Message, "outcome is unknown") {
					t.Fatalf("first call: %v; want an internal error saying the outcome is unknown", err)
				}
			}
			// A result is settled just after its caller is answered: give
			// the detached settle its moment before counting.
			deadline := time.Now().Add(5 * time.Second)
			for counter(e.Metrics().Panics.WithLabelValues("run")) == 0 && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			if n := counter(e.Metrics().Panics.WithLabelValues("run")); n != 1 {
				t.Errorf("idemcp_panics_total{where=run} = %v, want 1", n)
			}
			_, err = e.Execute(context.Background(), p, fwd)
			if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeInFlight {
				t.Fatalf("retry within the lease: %v; want -32011 (the claim is kept, not released)", err)
			}
			time.Sleep(1200 * time.Millisecond)
			_, err = e.Execute(context.Background(), p, fwd)
			if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeOutcomeUnknown {
				t.Fatalf("retry after the lease: %v; want -32012 (onAbandoned: Error)", err)
			}
			if ran != 1 {
				t.Errorf("the tool ran %d times, want 1", ran)
			}
		})
	}
}

func TestGoRecovers(t *testing.T) {
	e := New(Options{Store: store.NewMemory(0)})
	done := make(chan struct{})
	e.Go("test", func() {
		defer close(done)
		m := map[string]int{}
		m["x"] = 1
		panic("the panic of issue 9") // once an assignment to entry in nil map
	})
	<-done
	time.Sleep(10 * time.Millisecond)
	if n := counter(e.Metrics().Panics.WithLabelValues("test")); n != 1 {
		t.Errorf("idemcp_panics_total{where=test} = %v, want 1", n)
	}
}

// renewStore fails the first few renewals and records when each came.
type renewStore struct {
	*store.Memory
	mu    sync.Mutex
	fails int
	at    []time.Time
}

func (s *renewStore) Renew(ctx context.Context, key, owner string, lease time.Duration) error {
	s.mu.Lock()
	s.at = append(s.at, time.Now())
	fail := len(s.at) <= s.fails
	s.mu.Unlock()
	if fail {
		return fmt.Errorf("read tcp: i/o timeout: %w", store.ErrUnavailable)
	}
	return s.Memory.Renew(ctx, key, owner, lease)
}

// A renewal that fails is retried at once, with backoff, not a whole
// lease/3 later: three failed renewals in a row must not let the lease run
// out under a call that still runs, or a retry would run it again.
func TestFailedRenewalIsRetriedPromptly(t *testing.T) {
	rs := &renewStore{Memory: store.NewMemory(0), fails: 3}
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, leaseDuration: 1s}"), Store: rs})
	p := plan(t, e, `{"name":"t"}`, alice)
	var mu sync.Mutex
	ran := 0
	fwd := func(context.Context) (Upstream, error) {
		mu.Lock()
		ran++
		mu.Unlock()
		time.Sleep(1600 * time.Millisecond)
		return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{}}`), Status: 200}, nil
	}
	start := time.Now()
	first := make(chan error, 1)
	go func() {
		_, err := e.Execute(context.Background(), p, fwd)
		first <- err
	}()
	time.Sleep(1150 * time.Millisecond) // past the lease, had it not been renewed
	out, err := e.Execute(context.Background(), p, fwd)
	if err != nil || out.Kind != Replayed {
		t.Fatalf("duplicate: %v %v; want the first call's result replayed", out.Kind, err)
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if ran != 1 {
		t.Fatalf("the tool ran %d times, want 1: the lease ran out while it ran", ran)
	}
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if len(rs.at) < 4 {
		t.Fatalf("%d renewals, want at least 4", len(rs.at))
	}
	if d := rs.at[3].Sub(start); d > 700*time.Millisecond {
		t.Errorf("the first successful renewal came %v after the call started, want well within the 1s lease", d)
	}
}

// An explicit key reused with other arguments is refused whatever became
// of the first call, even when it was abandoned and onAbandoned is Retry.
func TestKeyReusedWithOtherArgumentsAfterAbandon(t *testing.T) {
	m := store.NewMemory(0)
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate}"), Store: m})
	keyed := func(args string) *Plan {
		return plan(t, e, `{"name":"t","arguments":`+args+`,"_meta":{"idempotency-key":"order-1"}}`, alice)
	}
	first, other := keyed(`{"amount":5}`), keyed(`{"amount":500}`)
	if first.Key != other.Key || first.Fingerprint == other.Fingerprint {
		t.Fatal("the two calls should share a key and differ in fingerprint")
	}
	// The first call's sidecar died mid-call: its claim is abandoned.
	if _, err := m.Reserve(context.Background(), store.Claim{Key: first.Key, Fingerprint: first.Fingerprint, Owner: "dead", Lease: 200 * time.Millisecond, Retention: time.Minute}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	ran := 0
	_, err := e.Execute(context.Background(), other, func(context.Context) (Upstream, error) {
		ran++
		return Upstream{Response: []byte(`{"result":{}}`), Status: 200}, nil
	})
	var ee *Error
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeKeyConflict || ran != 0 {
		t.Fatalf("other arguments under an abandoned key: %v, ran %d; want -32010 and nothing run", err, ran)
	}
	out, err := e.Execute(context.Background(), first, respond(`{"result":{"ok":true}}`))
	if err != nil || out.Kind != Executed {
		t.Fatalf("the first call's retry: %v %v; want it to take over and run", out.Kind, err)
	}
}

// A derived key needs a scope: an anonymous caller under Session scope (no
// session either) or Principal scope is forwarded without deduplication,
// and counted, and so is its explicit key; a session's explicit keys and
// Global scope still deduplicate.
func TestUnscopedCallsAreNotDeduplicated(t *testing.T) {
	e := New(Options{Policy: mustPolicy(t, `spec: {defaultMode: Deduplicate, tools: [{name: p_*, keyScope: Principal}, {name: g_*, keyScope: Global}]}`), Store: store.NewMemory(0)})
	anon := Caller{}
	sessionOnly := Caller{Session: "s1"}
	tests := []struct {
		tool   string
		caller Caller
		meta   string
		dedup  bool
	}{
		{"t", anon, `{}`, false},
		{"t", sessionOnly, `{}`, true},
		{"t", alice, `{}`, true},
		{"t", anon, `{"idempotency-key":"k1"}`, false},
		{"t", sessionOnly, `{"idempotency-key":"k1"}`, true},
		{"g_t", anon, `{"idempotency-key":"k1"}`, true},
		{"p_t", anon, `{}`, false},
		{"p_t", sessionOnly, `{}`, false},
		{"p_t", alice, `{}`, true},
		{"p_t", sessionOnly, `{"idempotency-key":"k1"}`, true},
		{"g_t", anon, `{}`, true},
	}
	unscoped := 0
	for _, tt := range tests {
		tc, _ := ParseToolCall(json.RawMessage(`{"name":"` + tt.tool + `","_meta":` + tt.meta + `}`))
		p, err := e.Plan(tc, tt.caller)
		if err != nil || (p != nil) != tt.dedup {
			t.Errorf("Plan(%s, %+v, %s) deduplicates = %v (%v), want %v", tt.tool, tt.caller, tt.meta, p != nil, err, tt.dedup)
		}
		if !tt.dedup {
			unscoped++
		}
	}
	if got := e.Unscoped(); got != uint64(unscoped) {
		t.Errorf("Unscoped() = %d, want %d", got, unscoped)
	}
	if n := counter(e.Metrics().Calls.WithLabelValues(OutcomeUnscoped)); n != float64(unscoped) {
		t.Errorf(`idemcp_tool_calls_total{outcome="unscoped"} = %v, want %d`, n, unscoped)
	}
	if n := counter(e.Metrics().Calls.WithLabelValues(OutcomePassthrough)); n != 0 {
		t.Errorf(`unscoped calls were also counted as passthrough: %v`, n)
	}
}

// A task-creating call's result is replayed only in the session that
// created the task; elsewhere the retry is refused, and nothing runs again.
func TestTaskIsReplayedOnlyInItsSession(t *testing.T) {
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate}"), Store: store.NewMemory(0)})
	s1 := Caller{Principal: "Bearer alice", Session: "s1"}
	s2 := Caller{Principal: "Bearer alice", Session: "s2"}
	params := `{"name":"t","task":{"ttl":60000},"_meta":{"idempotency-key":"job-1"}}`
	ran := 0
	fwd := func(context.Context) (Upstream, error) {
		ran++
		return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"task":{"taskId":"t-1","status":"working"}}}`), Status: 200}, nil
	}
	if _, err := e.Execute(context.Background(), plan(t, e, params, s1), fwd); err != nil {
		t.Fatal(err)
	}
	out, err := e.Execute(context.Background(), plan(t, e, params, s1), fwd)
	if err != nil || out.Kind != Replayed {
		t.Fatalf("retry in the task's session: %v %v; want a replay", out.Kind, err)
	}
	if got, want := string(mcpmsg.WithID(out.Response, json.RawMessage(`2`))), `{"id":2,"jsonrpc":"2.0","result":{"_meta":{"idemcp.io/replayed":true},"task":{"taskId":"t-1","status":"working"}}}`; got != want {
		t.Errorf("replay = %s, want %s", got, want)
	}
	_, err = e.Execute(context.Background(), plan(t, e, params, s2), fwd)
	var ee *Error
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeTaskElsewhere || !strings.Contains(ee.Message, "session") {
		t.Fatalf("retry in another session: %v; want -32016 naming the session", err)
	}
	if ran != 1 {
		t.Errorf("the tool ran %d times, want 1", ran)
	}
}

func counter(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}
