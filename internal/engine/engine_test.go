package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
)

func mustPolicy(t testing.TB, yaml string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestExplicitKeyOrder(t *testing.T) {
	meta := map[string]json.RawMessage{
		"idemcp.io/idempotency-key": json.RawMessage(`"a"`),
		"idempotency-key":           json.RawMessage(`"b"`),
		"idempotencyKey":            json.RawMessage(`"c"`),
	}
	tests := []struct {
		name   string
		caller Caller
		meta   map[string]json.RawMessage
		want   string
	}{
		{"header first", Caller{HeaderKey: "h", HasHeaderKey: true}, meta, "h"},
		{"idemcp spelling next", Caller{}, meta, "a"},
		{"idempotency-key", Caller{}, map[string]json.RawMessage{"idempotency-key": meta["idempotency-key"], "idempotencyKey": meta["idempotencyKey"]}, "b"},
		{"idempotencyKey last", Caller{}, map[string]json.RawMessage{"idempotencyKey": meta["idempotencyKey"]}, "c"},
		{"none", Caller{}, nil, ""},
	}
	for _, tt := range tests {
		got, err := ExplicitKey(tt.caller, tt.meta)
		if err != nil || got != tt.want {
			t.Errorf("%s: ExplicitKey = %q, %v; want %q", tt.name, got, err, tt.want)
		}
	}
}

func TestExplicitKeyInvalid(t *testing.T) {
	long := make([]byte, 256)
	for i := range long {
		long[i] = 'k'
	}
	tests := []struct {
		caller Caller
		meta   string
		want   string
	}{
		{Caller{HasHeaderKey: true}, `{}`, "the Idempotency-Key header is 0 characters long"},
		{Caller{HeaderKey: string(long), HasHeaderKey: true}, `{}`, "256 characters long"},
		{Caller{}, `{"idempotency-key": 7}`, `params._meta["idempotency-key"] must be a string`},
		{Caller{}, `{"idempotencyKey": "a\u0001"}`, "byte 0x01 at position 1"},
		{Caller{}, `{"idemcp.io/idempotency-key": "caf\u00e9"}`, "printable ASCII"},
	}
	for _, tt := range tests {
		var meta map[string]json.RawMessage
		_ = json.Unmarshal([]byte(tt.meta), &meta)
		_, err := ExplicitKey(tt.caller, meta)
		var ee *Error
		if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeInvalidParams || !strings.Contains(ee.Message, tt.want) {
			t.Errorf("ExplicitKey(%+v, %s) = %v, want invalid params containing %q", tt.caller, tt.meta, err, tt.want)
		}
	}
}

func TestKeyScopes(t *testing.T) {
	e := New(Options{Policy: mustPolicy(t, `spec: {defaultMode: Deduplicate, tools: [{name: p_*, keyScope: Principal}, {name: g_*, keyScope: Global}]}`), Store: store.NewMemory(0)})
	key := func(tool, args string, c Caller) string {
		tc, err := ParseToolCall(json.RawMessage(fmt.Sprintf(`{"name":%q,"arguments":%s}`, tool, args)))
		if err != nil {
			t.Fatal(err)
		}
		p, err := e.Plan(tc, c)
		if err != nil || p == nil {
			t.Fatalf("Plan(%s): %v %v", tool, p, err)
		}
		return p.Key
	}
	alice1 := Caller{Principal: "Bearer alice", Session: "s1"}
	alice2 := Caller{Principal: "Bearer alice", Session: "s2"}
	bob1 := Caller{Principal: "Bearer bob", Session: "s1"}
	args := `{"a":1,"b":[1,2]}`
	same := `{"b":[1.0,2],"a":1}`
	tests := []struct {
		name  string
		a, b  string
		equal bool
	}{
		{"session: same session, reordered args", key("t", args, alice1), key("t", same, alice1), true},
		{"session: other session", key("t", args, alice1), key("t", args, alice2), false},
		{"session: other principal, same session id", key("t", args, alice1), key("t", args, bob1), false},
		{"session: other arguments", key("t", args, alice1), key("t", `{"a":2}`, alice1), false},
		{"session: other tool", key("t", args, alice1), key("u", args, alice1), false},
		{"stateless: principal alone", key("t", args, Caller{Principal: "x"}), key("t", args, Caller{Principal: "x"}), true},
		{"principal: across sessions", key("p_t", args, alice1), key("p_t", args, alice2), true},
		{"principal: across principals", key("p_t", args, alice1), key("p_t", args, bob1), false},
		{"global: across principals", key("g_t", args, alice1), key("g_t", args, bob1), true},
		{"absent and null arguments", key("t", `null`, alice1), key("t", `{}`, alice1), true},
	}
	for _, tt := range tests {
		if (tt.a == tt.b) != tt.equal {
			t.Errorf("%s: keys equal = %v, want %v", tt.name, tt.a == tt.b, tt.equal)
		}
	}
	// Explicit keys: the principal's own, across tools and sessions.
	k := func(tool string, c Caller) string {
		c.HeaderKey, c.HasHeaderKey = "order-1", true
		return key(tool, args, c)
	}
	if k("t", alice1) != k("p_t", alice2) {
		t.Error("an explicit key depends on the tool or session")
	}
	if k("t", alice1) == k("t", bob1) {
		t.Error("two principals share an explicit key")
	}
}

func TestPlanPassthrough(t *testing.T) {
	e := New(Options{Policy: mustPolicy(t, `spec: {tools: [{name: get_*, mode: Passthrough}]}`), Store: store.NewMemory(0)})
	e.Hints().ObserveListResult(json.RawMessage(`{"tools":[{"name":"read","annotations":{"readOnlyHint":true}},{"name":"write","annotations":{"readOnlyHint":false}}]}`))
	for tool, want := range map[string]bool{"get_x": false, "read": false, "write": true, "unknown": true} {
		tc, _ := ParseToolCall(json.RawMessage(fmt.Sprintf(`{"name":%q}`, tool)))
		p, err := e.Plan(tc, alice)
		if err != nil || (p != nil) != want {
			t.Errorf("Plan(%s) deduplicates = %v (%v), want %v", tool, p != nil, err, want)
		}
	}
	// A bad key on a call that is not deduplicated is not our business.
	tc, _ := ParseToolCall(json.RawMessage(`{"name":"get_x","_meta":{"idempotency-key":""}}`))
	if p, err := e.Plan(tc, alice); p != nil || err != nil {
		t.Errorf("Plan(passthrough with bad key) = %v, %v", p, err)
	}
}

func TestParseToolCallErrors(t *testing.T) {
	for params, want := range map[string]string{
		``:                    "has no params",
		`{"arguments":{}}`:    "params.name is missing",
		`{"name":7}`:          "params.name must be a string",
		`[1]`:                 "must be a JSON object",
		`{"name":"", "x": 1}`: "params.name is missing",
	} {
		_, err := ParseToolCall(json.RawMessage(params))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseToolCall(%s) = %v, want %q", params, err, want)
		}
	}
}

func TestSettleDecisions(t *testing.T) {
	tests := []struct {
		name     string
		resp     string
		status   int
		err      error
		cacheErr bool
		stored   bool
	}{
		{"success", `{"jsonrpc":"2.0","id":1,"result":{"content":[]}}`, 200, nil, false, true},
		{"jsonrpc error", `{"jsonrpc":"2.0","id":1,"error":{"code":-32601,"message":"no"}}`, 200, nil, false, false},
		{"tool error", `{"jsonrpc":"2.0","id":1,"result":{"isError":true}}`, 200, nil, false, false},
		{"tool error cached", `{"jsonrpc":"2.0","id":1,"result":{"isError":true}}`, 200, nil, true, true},
		{"input required", `{"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required","inputRequests":{}}}`, 200, nil, false, false},
		{"task created", `{"jsonrpc":"2.0","id":1,"result":{"task":{"taskId":"t1","status":"working"}}}`, 200, nil, false, true},
		{"http error", `{}`, 500, nil, false, false},
		{"transport", ``, 0, errors.New("reset"), false, false},
		{"no response", ``, 200, nil, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			yaml := "spec: {defaultMode: Deduplicate}"
			if tt.cacheErr {
				yaml = "spec: {defaultMode: Deduplicate, tools: [{name: t, cacheToolErrors: true}]}"
			}
			e := New(Options{Policy: mustPolicy(t, yaml), Store: store.NewMemory(0)})
			tc, _ := ParseToolCall(json.RawMessage(`{"name":"t"}`))
			p, _ := e.Plan(tc, alice)
			fwd := func(context.Context) (Upstream, error) {
				var r []byte
				if tt.resp != "" {
					r = []byte(tt.resp)
				}
				return Upstream{Response: r, Status: tt.status}, tt.err
			}
			_, _ = e.Execute(context.Background(), p, fwd)
			out, err := e.Execute(context.Background(), p, func(context.Context) (Upstream, error) {
				return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":2,"result":{"second":true}}`), Status: 200}, nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if (out.Kind == Replayed) != tt.stored {
				t.Fatalf("second call kind = %v, want replayed = %v", out.Kind, tt.stored)
			}
			if tt.stored {
				var m struct {
					ID     json.RawMessage
					Result map[string]json.RawMessage
				}
				if err := json.Unmarshal(mcpmsg.WithID(out.Response, json.RawMessage(`"r"`)), &m); err != nil {
					t.Fatal(err)
				}
				if string(m.ID) != `"r"` || string(m.Result["_meta"]) != `{"idemcp.io/replayed":true}` {
					t.Errorf("replay = id %s meta %s", m.ID, m.Result["_meta"])
				}
			}
		})
	}
}

func TestStoreUnavailable(t *testing.T) {
	for _, mode := range []v1alpha1.StoreUnavailableAction{v1alpha1.FailClosed, v1alpha1.FailOpen} {
		e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, onStoreUnavailable: "+string(mode)+"}"), Store: downStore{}})
		tc, _ := ParseToolCall(json.RawMessage(`{"name":"t"}`))
		p, _ := e.Plan(tc, alice)
		ran := 0
		out, err := e.Execute(context.Background(), p, func(context.Context) (Upstream, error) {
			ran++
			return Upstream{Response: []byte(`{"result":{}}`), Status: 200}, nil
		})
		switch mode {
		case v1alpha1.FailClosed:
			var ee *Error
			if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeStoreUnavailable || ran != 0 {
				t.Errorf("FailClosed: err %v, ran %d; want store-unavailable and nothing run", err, ran)
			}
		case v1alpha1.FailOpen:
			if err != nil || out.Kind != ForwardedOpen || ran != 1 {
				t.Errorf("FailOpen: %v %v ran %d; want forwarded once", out, err, ran)
			}
		}
	}
}

// downStore is a store that cannot be reached: the failure path of a pure
// function's unit test; real stores are tested against the contract.
type downStore struct{ store.Store }

func (downStore) Reserve(context.Context, store.Claim) (store.Reservation, error) {
	return store.Reservation{}, fmt.Errorf("dial tcp: connection refused: %w", store.ErrUnavailable)
}

func (downStore) Release(context.Context, string, string) error {
	return fmt.Errorf("dial tcp: connection refused: %w", store.ErrUnavailable)
}

// flakyStore is the memory store with faults injected where a test says.
type flakyStore struct {
	*store.Memory
	failWait     bool
	failComplete atomic.Int32 // fail this many Completes
}

func (f *flakyStore) Wait(ctx context.Context, key string) error {
	if f.failWait {
		return fmt.Errorf("read tcp: i/o timeout: %w", store.ErrUnavailable)
	}
	return f.Memory.Wait(ctx, key)
}

func (f *flakyStore) Complete(ctx context.Context, key, owner string, resp []byte, ttl time.Duration) error {
	if f.failComplete.Add(-1) >= 0 {
		return fmt.Errorf("read tcp: i/o timeout: %w", store.ErrUnavailable)
	}
	return f.Memory.Complete(ctx, key, owner, resp, ttl)
}

// A duplicate waiting on a running call never becomes a second execution
// when the store stops answering, even with FailOpen.
func TestWaitErrorNeverForwardsADuplicate(t *testing.T) {
	fs := &flakyStore{Memory: store.NewMemory(0), failWait: true}
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, onStoreUnavailable: FailOpen}"), Store: fs})
	tc, _ := ParseToolCall(json.RawMessage(`{"name":"t"}`))
	p, _ := e.Plan(tc, alice)
	release := make(chan struct{})
	var ran atomic.Int32
	fwd := func(context.Context) (Upstream, error) {
		ran.Add(1)
		<-release
		return Upstream{Response: []byte(`{"result":{}}`), Status: 200}, nil
	}
	go func() { _, _ = e.Execute(context.Background(), p, fwd) }()
	for ran.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	_, err := e.Execute(context.Background(), p, fwd)
	close(release)
	var ee *Error
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeInFlight || ran.Load() != 1 {
		t.Fatalf("duplicate: err %v, ran %d; want in-flight error and 1 run", err, ran.Load())
	}
}

// A store blip when the result is stored is retried, so the result is not
// lost and the retry does not run the tool again.
func TestCompleteIsRetried(t *testing.T) {
	fs := &flakyStore{Memory: store.NewMemory(0)}
	fs.failComplete.Store(2)
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate}"), Store: fs})
	tc, _ := ParseToolCall(json.RawMessage(`{"name":"t"}`))
	p, _ := e.Plan(tc, alice)
	ran := 0
	fwd := func(context.Context) (Upstream, error) {
		ran++
		return Upstream{Response: []byte(`{"result":{"ok":true}}`), Status: 200}, nil
	}
	if _, err := e.Execute(context.Background(), p, fwd); err != nil {
		t.Fatal(err)
	}
	out, err := e.Execute(context.Background(), p, fwd)
	if err != nil || out.Kind != Replayed || ran != 1 {
		t.Fatalf("retry: %v %v, ran %d; want a replay and 1 run", out.Kind, err, ran)
	}
}

// A response the transport could not keep is not released: the call ran.
func TestTooLargeUpstreamIsNotRunAgain(t *testing.T) {
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate}"), Store: store.NewMemory(0)})
	tc, _ := ParseToolCall(json.RawMessage(`{"name":"t"}`))
	p, _ := e.Plan(tc, alice)
	ran := 0
	fwd := func(context.Context) (Upstream, error) {
		ran++
		return Upstream{TooLarge: true, Size: 100 << 20, Status: 200}, nil
	}
	if _, err := e.Execute(context.Background(), p, fwd); err != nil {
		t.Fatal(err)
	}
	out, err := e.Execute(context.Background(), p, fwd)
	if err != nil || out.Kind != Replayed || ran != 1 || !strings.Contains(string(out.Response), `"code":-32014`) {
		t.Fatalf("retry: %v %s %v, ran %d; want the not-stored error replayed, 1 run", out.Kind, out.Response, err, ran)
	}
}

// TestPendingOutcome: a Forward whose outcome comes Later answers its
// caller at once; duplicates wait for what Later brings; and an outcome
// that cannot be had (ErrOutcomeUnknown) is neither stored nor released, so
// the claim lapses and onAbandoned decides.
func TestPendingOutcome(t *testing.T) {
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Global, leaseDuration: 1s, waitTimeout: 5s, onAbandoned: Error}"), Store: store.NewMemory(0)})
	plan := func(args string) *Plan {
		tc, _ := ParseToolCall(json.RawMessage(`{"name":"t","arguments":` + args + `}`))
		p, err := e.Plan(tc, Caller{})
		if err != nil || p == nil {
			t.Fatalf("Plan: %v, %v", p, err)
		}
		return p
	}
	var ran atomic.Int32
	pending := func(later func(context.Context) (Upstream, error)) Forward {
		return func(context.Context) (Upstream, error) {
			ran.Add(1)
			return Upstream{Status: 200, Later: later}, nil
		}
	}

	p := plan(`{"a":1}`)
	start := time.Now()
	out, err := e.Execute(context.Background(), p, pending(func(context.Context) (Upstream, error) {
		time.Sleep(300 * time.Millisecond)
		return Upstream{Status: 200, Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[]}}`)}, nil
	}))
	if err != nil || out.Kind != Executed || time.Since(start) > 200*time.Millisecond {
		t.Fatalf("first call: %v, %v after %s; want Executed at once", out.Kind, err, time.Since(start))
	}
	out, err = e.Execute(context.Background(), p, pending(nil))
	if err != nil || out.Kind != Replayed {
		t.Fatalf("duplicate: %v, %v; want the response Later brought, replayed", out.Kind, err)
	}

	p = plan(`{"a":2}`)
	if _, err := e.Execute(context.Background(), p, pending(func(context.Context) (Upstream, error) {
		return Upstream{}, fmt.Errorf("%w: gone", ErrOutcomeUnknown)
	})); err != nil {
		t.Fatal(err)
	}
	_, err = e.Execute(context.Background(), p, pending(nil))
	var ee *Error
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeOutcomeUnknown {
		t.Fatalf("retry after an unknown outcome: %v; want outcome unknown (onAbandoned: Error)", err)
	}
	if n := ran.Load(); n != 2 {
		t.Fatalf("the tool ran %d times, want 2 (once per call)", n)
	}
	if err := e.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// alice is a caller with a principal and no session, as on a stateless
// server: her derived keys have a scope.
var alice = Caller{Principal: "Bearer alice"}
