package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/test/poll"
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
	// The panic is counted after the deferred close: wait for the count.
	poll.Within(t, 10*time.Second, "the panic to be counted", func() error {
		if n := counter(e.Metrics().Panics.WithLabelValues("test")); n != 1 {
			return fmt.Errorf("idemcp_panics_total{where=test} = %v, want 1", n)
		}
		return nil
	})
}

// renewStore is a memory store whose renewals fail while down is set; it
// records when each renewal was attempted and what it got.
type renewStore struct {
	*store.Memory
	mu   sync.Mutex
	down bool
	// failFirst fails that many renewals, then lets them through.
	failFirst int
	at        []time.Time
	errs      []error
}

func (s *renewStore) Renew(ctx context.Context, key, owner string, lease time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var err error
	if s.down || len(s.at) < s.failFirst {
		err = fmt.Errorf("read tcp: i/o timeout: %w", store.ErrUnavailable)
	} else {
		err = s.Memory.Renew(ctx, key, owner, lease)
	}
	s.at, s.errs = append(s.at, time.Now()), append(s.errs, err)
	return err
}

func (s *renewStore) setDown(down bool) {
	s.mu.Lock()
	s.down = down
	s.mu.Unlock()
}

// attempts returns when each renewal was attempted, relative to start, and
// what it got.
func (s *renewStore) attempts(start time.Time) ([]time.Duration, []error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	at := make([]time.Duration, len(s.at))
	for i, t := range s.at {
		at[i] = t.Sub(start)
	}
	return at, slices.Clone(s.errs)
}

// A renewal that fails is retried at once, with backoff, not a whole
// lease/3 later: three failed renewals in a row must not let the lease run
// out under a call that still runs, or a retry would run it again. The
// test runs in a synctest bubble: its clock is fake, so each renewal
// attempt is counted exactly, not timed.
func TestFailedRenewalIsRetriedPromptly(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const lease = 3 * time.Second
		every := lease / 3
		rs := &renewStore{Memory: store.NewMemory(0), failFirst: 3}
		defer func() { _ = rs.Close() }()
		e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, leaseDuration: 3s}"), Store: rs})
		p := plan(t, e, `{"name":"t"}`, alice)
		ran := 0
		fwd := func(context.Context) (Upstream, error) {
			ran++
			time.Sleep(2 * lease) // the call outlasts its lease twice over
			return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{}}`), Status: 200}, nil
		}
		start := time.Now()
		first := make(chan error, 1)
		go func() {
			_, err := e.Execute(context.Background(), p, fwd)
			first <- err
		}()
		time.Sleep(lease + every) // past the lease, had it not been renewed
		out, err := e.Execute(context.Background(), p, fwd)
		if err != nil || out.Kind != Replayed {
			t.Fatalf("duplicate: %v %v; want the first call's result replayed", out.Kind, err)
		}
		if err := <-first; err != nil {
			t.Fatal(err)
		}
		if ran != 1 {
			t.Fatalf("the tool ran %d times, want 1: the lease ran out while it ran", ran)
		}

		at, errs := rs.attempts(start)
		t.Logf("renewal attempts at %v", at)
		var prompt []time.Duration // attempts before the second lease/3 tick
		for _, a := range at {
			if a < 2*every {
				prompt = append(prompt, a)
			}
		}
		// The first tick fails, and so do the two retries after it; the
		// third retry succeeds, all before the next tick would have come.
		if len(prompt) != rs.failFirst+1 {
			t.Fatalf("%d renewal attempts before the second lease/3 tick (%v), want %d: the failed ones retried promptly, then one that succeeds", len(prompt), at, rs.failFirst+1)
		}
		if prompt[0] != every {
			t.Errorf("first renewal at %v, want at lease/3 (%v)", prompt[0], every)
		}
		for i := 1; i < len(prompt); i++ {
			// Backoff: each retry waits twice as long as the one before.
			if gap, want := prompt[i]-prompt[i-1], renewRetryMin<<(i-1); gap != want {
				t.Errorf("retry %d came %v after the attempt before it, want %v (backoff from %v, doubling)", i, gap, want, renewRetryMin)
			}
		}
		if errs[rs.failFirst] != nil {
			t.Errorf("renewal %d: %v, want it to succeed", rs.failFirst+1, errs[rs.failFirst])
		}
		// Once renewed, the regular pace is back: one attempt per lease/3.
		for i := rs.failFirst + 1; i < len(at); i++ {
			if gap := at[i] - at[i-1]; gap != every {
				t.Errorf("renewal %d came %v after the one before it, want lease/3 (%v) once a renewal succeeded", i+1, gap, every)
			}
		}
	})
}

// While the store keeps failing renewals, the owner retries them with
// backoff only until its lease has run out; from then on it tries at the
// lease/3 pace (a renewal still succeeds if nobody took the claim over),
// and it stops for good once the store says another caller took over.
func TestFailedRenewalsBackOffUntilTheLeaseEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const lease = 3 * time.Second
		every := lease / 3
		rs := &renewStore{Memory: store.NewMemory(0), down: true}
		defer func() { _ = rs.Close() }()
		e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, leaseDuration: 3s}"), Store: rs})
		p := plan(t, e, `{"name":"t"}`, alice)
		finish := make(chan struct{})
		end := sync.OnceFunc(func() { close(finish) })
		defer end() // a failed check must not leave the call blocked in the bubble
		runs := 0
		fwd := func(context.Context) (Upstream, error) {
			if runs++; runs == 1 {
				<-finish // the first call runs until the test ends it
			}
			return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"run":` + strconv.Itoa(runs) + `}}`), Status: 200}, nil
		}
		start := time.Now()
		first := make(chan error, 1)
		go func() {
			_, err := e.Execute(context.Background(), p, fwd)
			first <- err
		}()
		time.Sleep(lease + 2*every + every/2)
		synctest.Wait()
		at, _ := rs.attempts(start)
		t.Logf("renewal attempts while the store failed them: %v", at)
		var within, after []time.Duration
		for _, a := range at {
			if a < lease {
				within = append(within, a)
			} else {
				after = append(after, a)
			}
		}
		if len(within) < 3 {
			t.Fatalf("%d renewal attempts within the lease (%v), want the first one retried more than once", len(within), at)
		}
		for i := 2; i < len(within); i++ {
			if prev, gap := within[i-1]-within[i-2], within[i]-within[i-1]; gap > 2*prev || gap > every {
				t.Errorf("retry at %v came %v after the one before, which waited %v: want backoff, at most doubling and never a whole lease/3", within[i], gap, prev)
			}
		}
		// The retries close in on the lease's end rather than overshoot it.
		if last := within[len(within)-1]; lease-last > 2*renewRetryMin {
			t.Errorf("last retry within the lease at %v, want it within %v of the lease's end (%v)", last, 2*renewRetryMin, lease)
		}
		// The last backoff may land just past the lease's end (it waits at
		// least renewRetryMin); after it, one attempt per lease/3.
		if len(after) != 3 || after[0] > lease+renewRetryMin {
			t.Fatalf("renewal attempts in the %v after the lease ran out: %v; want the last retry at most %v past its end, then one per lease/3", 2*every+every/2, after, renewRetryMin)
		}
		for i := 1; i < len(after); i++ {
			if gap := after[i] - after[i-1]; gap != every {
				t.Errorf("after the lease, renewals %v apart, want lease/3 (%v): no more prompt retries", gap, every)
			}
		}

		// The claim has lapsed: a retry takes it over and runs the call
		// again (onAbandoned: Retry), and the store is back.
		rs.setDown(false)
		out, err := e.Execute(context.Background(), p, fwd)
		if err != nil || out.Kind != Executed || runs != 2 {
			t.Fatalf("retry after the lease: %v %v, runs %d; want it to take over and run", out.Kind, err, runs)
		}
		n := len(after) + len(within)
		time.Sleep(every)
		synctest.Wait()
		at, errs := rs.attempts(start)
		if len(at) != n+1 || !errors.Is(errs[n], store.ErrNotOwner) {
			t.Fatalf("after the take-over: attempts %v, errors %v; want one more renewal, refused as not the owner", at[n:], errs[n:])
		}
		time.Sleep(3 * every)
		synctest.Wait()
		if at, _ := rs.attempts(start); len(at) != n+1 {
			t.Errorf("renewals went on after the store said the claim was another's: %v", at[n+1:])
		}
		end()
		if err := <-first; err != nil {
			t.Fatalf("first call: %v", err)
		}
		// The first owner stored nothing over the new owner's result.
		out, err = e.Execute(context.Background(), p, fwd)
		if err != nil || out.Kind != Replayed || !strings.Contains(string(out.Response), `"run":2`) {
			t.Fatalf("a later retry: %v %s %v; want the take-over's result replayed", out.Kind, out.Response, err)
		}
	})
}

// An explicit key reused with other arguments is refused whatever became
// of the first call, even when it was abandoned and onAbandoned is Retry.
func TestKeyReusedWithOtherArgumentsAfterAbandon(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := store.NewMemory(0)
		defer func() { _ = m.Close() }()
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
		time.Sleep(300 * time.Millisecond) // the bubble's clock: the lease lapses, no waiting
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
	})
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

func gauge(g prometheus.Gauge) float64 {
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		panic(err)
	}
	return m.GetGauge().GetValue()
}

// TestUnscopedWarningNamesWhatIsMissing: under keyScope: Principal a call
// that has a session but no principal is warned of as lacking a
// principal, not as having "no session and no principal".
func TestUnscopedWarningNamesWhatIsMissing(t *testing.T) {
	for _, tc := range []struct {
		scope, want, not string
		caller           Caller
	}{
		{"Principal", "A call with no principal (keyScope: Principal", "no session and no principal", Caller{Session: "s1"}},
		{"Session", "A call with no session and no principal", "keyScope: Principal;", Caller{}},
	} {
		var buf bytes.Buffer
		e := New(Options{Policy: mustPolicy(t, `spec: {defaultMode: Deduplicate, keyScope: `+tc.scope+`}`), Store: store.NewMemory(0),
			Logger: slog.New(slog.NewTextHandler(&buf, nil))})
		call, _ := ParseToolCall(json.RawMessage(`{"name":"t"}`))
		if p, err := e.Plan(call, tc.caller); p != nil || err != nil {
			t.Fatalf("keyScope %s: Plan = %v, %v; want forwarded without deduplication", tc.scope, p, err)
		}
		if out := buf.String(); !strings.Contains(out, tc.want) || strings.Contains(out, tc.not) {
			t.Errorf("keyScope %s: warning %q, want it to say %q and not %q", tc.scope, out, tc.want, tc.not)
		}
	}
}
