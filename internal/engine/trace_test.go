package engine

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/tracing"
)

// Each way a call is answered is the outcome on its span, what the user
// sent stays out of every span, and a replay names and links the
// execution; a policy without tracing makes no span at all.
func TestCallSpans(t *testing.T) {
	e, st, rec := tracedEngine(t, `
metadata: {name: payments, namespace: shop}
spec:
  keyScope: Principal
  tools: [{name: charge, mode: Deduplicate}, {name: read, mode: Passthrough}]
`)
	pol := e.policy.Load()
	ok := func(context.Context) (Upstream, error) {
		return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"RESULT-SECRET"}]}}`)}, nil
	}
	call := func(tool, args, key string, c Caller) Outcome {
		t.Helper()
		tc := &ToolCall{Name: tool, Arguments: json.RawMessage(args)}
		if key != "" {
			tc.Meta = map[string]json.RawMessage{"idempotency-key": json.RawMessage(`"` + key + `"`)}
		}
		ctx, span := e.StartCall(context.Background(), CallInfo{Tool: tool, RequestID: json.RawMessage("1"), Meta: tc.Meta})
		defer span.End()
		p, err := e.PlanCall(ctx, tc, c)
		if err != nil || p == nil {
			return Outcome{}
		}
		out, _ := e.Execute(ctx, p, ok)
		if err := e.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
		return out
	}
	agent := Caller{Principal: "Bearer agent"}
	call("charge", `{"card":"ARG-SECRET"}`, "KEY-SECRET", agent)
	replay := call("charge", `{"card":"ARG-SECRET"}`, "KEY-SECRET", agent)
	call("charge", `{"card":"OTHER"}`, "KEY-SECRET", agent)
	call("charge", `{"card":"ARG-SECRET"}`, "", Caller{})
	call("read", `{}`, "", agent)

	spans := rec.Ended()
	want := []string{"executed", "replayed", "conflict", "unscoped", "passthrough"}
	if len(spans) < len(want) {
		t.Fatalf("got %d spans, want at least %d", len(spans), len(want))
	}
	var calls []sdktrace.ReadOnlySpan
	for _, s := range spans {
		if strings.HasPrefix(s.Name(), "tools/call ") {
			calls = append(calls, s)
		}
		for _, a := range s.Attributes() {
			for _, secret := range []string{"KEY-SECRET", "ARG-SECRET", "RESULT-SECRET"} {
				if strings.Contains(a.Value.String(), secret) {
					t.Errorf("span %s: %s holds %s", s.Name(), a.Key, secret)
				}
			}
		}
	}
	for i, o := range want {
		got := ""
		for _, a := range calls[i].Attributes() {
			if a.Key == "idemcp.outcome" {
				got = a.Value.AsString()
			}
		}
		if got != o {
			t.Errorf("call %d (%s): outcome %q, want %q", i, calls[i].Name(), got, o)
		}
	}
	exec, rep := calls[0].SpanContext(), calls[1]
	if len(rep.Links()) != 1 || rep.Links()[0].SpanContext.SpanID() != exec.SpanID() {
		t.Errorf("the replay links to %v, want the execution %v", rep.Links(), exec.SpanID())
	}
	if want := `"idemcp.io/execution":"00-` + exec.TraceID().String() + "-" + exec.SpanID().String() + `-01"`; !strings.Contains(string(replay.Response), want) {
		t.Errorf("replayed response %s does not name the execution (%s)", replay.Response, want)
	}

	// Tracing off: no span.
	rec2 := tracetest.NewSpanRecorder()
	off := New(Options{Policy: pol, Store: st, Tracing: Tracing{Provider: func() trace.TracerProvider {
		return sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec2))
	}}})
	if _, span := off.StartCall(context.Background(), CallInfo{Tool: "charge"}); span != nil {
		t.Error("a policy without spec.tracing got a span")
	}
}

// An executed call's span has exactly the MCP semantic conventions'
// attributes the call had and idemcp's of its plan, key and outcome; an
// error answered adds its code. Each span keeps its own attributes after
// later calls end (End lends the SDK a pooled slice).
func TestCallSpanAttributes(t *testing.T) {
	e, _, rec := tracedEngine(t, `
metadata: {name: payments, namespace: shop}
spec:
  keyScope: Session
  tools: [{name: charge_*, mode: Deduplicate}]
`)
	pol := e.policy.Load()
	run := func(tool, session string, code int) {
		t.Helper()
		tc := &ToolCall{Name: tool, Arguments: json.RawMessage(`{"amount":1}`)}
		ctx, span := e.StartCall(context.Background(), CallInfo{Tool: tool, RequestID: json.RawMessage(`"req-7"`), Session: session, ProtocolVersion: "2026-07-28", Transport: "tcp"})
		p, err := e.PlanCall(ctx, tc, Caller{Session: session})
		if err != nil || p == nil {
			t.Fatal(p, err)
		}
		if _, err := e.Execute(ctx, p, func(context.Context) (Upstream, error) {
			return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{}}`)}, nil
		}); err != nil {
			t.Fatal(err)
		}
		if code != 0 {
			span.Error(code)
		}
		span.End()
	}
	run("charge_card", "S1", 0)
	run("charge_other", "S2", -32001)
	if err := e.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	var calls []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if strings.HasPrefix(s.Name(), "tools/call ") {
			calls = append(calls, s)
		}
	}
	if len(calls) != 2 {
		t.Fatalf("got %d call spans, want 2", len(calls))
	}
	want := func(tool, session string) map[string]string {
		return map[string]string{
			"mcp.method.name": "tools/call", "gen_ai.tool.name": tool, "gen_ai.operation.name": "execute_tool",
			"jsonrpc.request.id": "req-7", "mcp.session.id": session, "mcp.protocol.version": "2026-07-28", "network.transport": "tcp",
			"idemcp.policy.name": "payments", "idemcp.policy.hash": pol.Hash, "idemcp.rule": "charge_*", "idemcp.mode.reason": "rule",
			"idemcp.scope": "Session", "idemcp.key.kind": "derived", "idemcp.outcome": "executed", "idemcp.forwarded": "true",
		}
	}
	first, second := want("charge_card", "S1"), want("charge_other", "S2")
	second["rpc.response.status_code"], second["error.type"] = "-32001", "-32001"
	for i, w := range []map[string]string{first, second} {
		got := map[string]string{}
		for _, a := range calls[i].Attributes() {
			got[string(a.Key)] = a.Value.String()
		}
		if len(got["idemcp.key.hash"]) != 12 {
			t.Errorf("span %d: idemcp.key.hash %q, want 12 hex digits", i, got["idemcp.key.hash"])
		}
		delete(got, "idemcp.key.hash")
		if !maps.Equal(got, w) {
			t.Errorf("span %d (%s) attributes:\n got %v\nwant %v", i, calls[i].Name(), got, w)
		}
	}
	if calls[0].Status().Code != codes.Unset || calls[1].Status().Code != codes.Error {
		t.Errorf("statuses %v and %v, want unset and error", calls[0].Status(), calls[1].Status())
	}
}

// tracedEngine is an engine under policyYAML, on a memory store, that
// traces every call into the recorder it returns.
func tracedEngine(t *testing.T, policyYAML string) (*Engine, *store.Memory, *tracetest.SpanRecorder) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	st := store.NewMemory(0)
	t.Cleanup(func() { _ = st.Close() })
	e := New(Options{Policy: mustPolicy(t, policyYAML), Store: st, Tracing: Tracing{Provider: func() trace.TracerProvider { return tp }, On: true}})
	return e, st, rec
}

// A span of another provider may keep the slice its SetAttributes is
// given, a wrapper of the SDK's spans too: End gives such a span a slice
// of its own, not a pooled one that the next call's span overwrites.
func TestCallSpanAttributesOfAnotherProvider(t *testing.T) {
	sdk := sdktrace.NewTracerProvider()
	for name, wrap := range map[string]func(trace.Span) trace.Span{
		"its own spans": nil,
		"SDK spans, wrapped": func(trace.Span) trace.Span {
			_, s := sdk.Tracer("test").Start(context.Background(), "wrapped")
			return struct{ sdktrace.ReadWriteSpan }{s.(sdktrace.ReadWriteSpan)}
		},
	} {
		t.Run(name, func(t *testing.T) {
			tp := &keepingProvider{wrap: wrap}
			e := New(Options{Policy: mustPolicy(t, `spec: {keyScope: Global}`), Store: store.NewMemory(0), Tracing: Tracing{Provider: func() trace.TracerProvider { return tp }, On: true}})
			for _, tool := range []string{"first", "second", "third"} {
				_, span := e.StartCall(context.Background(), CallInfo{Tool: tool})
				span.End()
			}
			if len(tp.spans) != 3 {
				t.Fatalf("got %d spans, want 3", len(tp.spans))
			}
			for i, tool := range []string{"first", "second", "third"} {
				got := ""
				for _, a := range tp.spans[i].attrs {
					if a.Key == "gen_ai.tool.name" {
						got = a.Value.AsString()
					}
				}
				if got != tool {
					t.Errorf("span %d keeps gen_ai.tool.name %q, want %q (attributes %v)", i, got, tool, tp.spans[i].attrs)
				}
			}
		})
	}
}

// A call with none of the optional facts gets none of their attributes,
// but for an id of "", which is an id; a replay that took a claim over
// says so and links the execution.
func TestCallSpanOptionalAttributes(t *testing.T) {
	e, _, rec := tracedEngine(t, `spec: {keyScope: Global}`)
	ctx, span := e.StartCall(context.Background(), CallInfo{Tool: "t", RequestID: json.RawMessage(`""`)})
	execution := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{7}, SpanID: trace.SpanID{9}, TraceFlags: trace.FlagsSampled})
	traceReplay(ctx, execution, true)
	traceOutcome(ctx, tracing.OutcomeReplayed)
	span.End()
	spans := rec.Ended()
	if len(spans) != 1 {
		t.Fatalf("got %d spans, want 1", len(spans))
	}
	got := map[string]string{}
	for _, a := range spans[0].Attributes() {
		got[string(a.Key)] = a.Value.String()
	}
	want := map[string]string{
		"mcp.method.name": "tools/call", "gen_ai.tool.name": "t", "gen_ai.operation.name": "execute_tool", "jsonrpc.request.id": "",
		"idemcp.outcome": "replayed", "idemcp.took_over": "true",
	}
	if !maps.Equal(got, want) {
		t.Errorf("attributes:\n got %v\nwant %v", got, want)
	}
	if links := spans[0].Links(); len(links) != 1 || !links[0].SpanContext.Equal(execution) {
		t.Errorf("links %v, want one to the execution %v", links, execution)
	}
}

// keepingProvider makes spans that keep, as they may, the very slice
// SetAttributes is given; with wrap, each wraps the span wrap returns.
type keepingProvider struct {
	noop.TracerProvider
	wrap  func(trace.Span) trace.Span
	spans []*keepingSpan
}

func (p *keepingProvider) Tracer(string, ...trace.TracerOption) trace.Tracer {
	return keepingTracer{p: p}
}

type keepingTracer struct {
	noop.Tracer
	p *keepingProvider
}

func (t keepingTracer) Start(ctx context.Context, _ string, _ ...trace.SpanStartOption) (context.Context, trace.Span) {
	s := &keepingSpan{sc: trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{byte(len(t.p.spans) + 1)}, TraceFlags: trace.FlagsSampled,
	})}
	t.p.spans = append(t.p.spans, s)
	if t.p.wrap != nil {
		w := &keepingSDKSpan{ReadWriteSpan: t.p.wrap(s).(sdktrace.ReadWriteSpan), keeper: s}
		return trace.ContextWithSpan(ctx, w), w
	}
	return trace.ContextWithSpan(ctx, s), s
}

type keepingSpan struct {
	noop.Span
	sc    trace.SpanContext
	attrs []attribute.KeyValue
}

func (s *keepingSpan) IsRecording() bool                      { return true }
func (s *keepingSpan) SpanContext() trace.SpanContext         { return s.sc }
func (s *keepingSpan) SetAttributes(kv ...attribute.KeyValue) { s.attrs = kv }

// keepingSDKSpan is an SDK span, wrapped: it is a ReadWriteSpan, and it
// keeps the slice SetAttributes is given before passing it on.
type keepingSDKSpan struct {
	sdktrace.ReadWriteSpan
	keeper *keepingSpan
}

func (s *keepingSDKSpan) SetAttributes(kv ...attribute.KeyValue) {
	s.keeper.attrs = kv
	s.ReadWriteSpan.SetAttributes(kv...)
}

// Under spec.tracing.storeSpans, a call's store round trips are child
// spans of its span, each within the call and in the order they were
// made, with the operation and, for one that failed, an error status and
// its type; the round trips of a call whose span has already ended (it
// settles after its client left) still get their spans, under it. A
// policy pushed without storeSpans makes none from its next call on.
func TestStoreSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	fs := &flakyStore{Memory: store.NewMemory(0)}
	t.Cleanup(func() { _ = fs.Close() })
	e := New(Options{Policy: mustPolicy(t, `spec: {keyScope: Global, tracing: {storeSpans: true}, tools: [{name: charge, mode: Deduplicate}]}`), Store: fs,
		Tracing: Tracing{Provider: func() trace.TracerProvider { return tp }, On: true}})
	ok := func(context.Context) (Upstream, error) {
		return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{}}`)}, nil
	}
	// storeSpans is the call span named tool's store spans, as "op" or
	// "op:error.type", each checked to lie within it, after the last.
	storeSpans := func(tool string) []string {
		t.Helper()
		var call sdktrace.ReadOnlySpan
		for _, s := range rec.Ended() {
			if s.Name() == "tools/call "+tool {
				call = s
			}
		}
		if call == nil {
			t.Fatalf("no span of %s", tool)
		}
		var ops []string
		last := call.StartTime()
		for _, s := range rec.Ended() {
			if s.Parent().SpanID() != call.SpanContext().SpanID() {
				continue
			}
			op := ""
			for _, a := range s.Attributes() {
				switch a.Key {
				case tracing.StoreOperation:
					op += a.Value.AsString()
				case tracing.ErrorType:
					op += ":" + a.Value.AsString()
				}
			}
			if s.Name() != "idemcp.store "+strings.SplitN(op, ":", 2)[0] || s.SpanKind() != trace.SpanKindClient {
				t.Errorf("%s: store span %q (%v) for %q, want a client span idemcp.store <op>", tool, s.Name(), s.SpanKind(), op)
			}
			if failed := strings.Contains(op, ":"); failed != (s.Status().Code == codes.Error) {
				t.Errorf("%s: store span %s has status %v", tool, op, s.Status())
			}
			if s.StartTime().Before(last) || s.EndTime().Before(s.StartTime()) || s.EndTime().After(call.EndTime()) {
				t.Errorf("%s: store span %s from %v to %v, want after %v, in order and before the call's end %v", tool, op, s.StartTime(), s.EndTime(), last, call.EndTime())
			}
			last = s.EndTime()
			ops = append(ops, op)
		}
		return ops
	}

	ctx, span := e.StartCall(context.Background(), CallInfo{Tool: "charge"})
	p, err := e.PlanCall(ctx, &ToolCall{Name: "charge", Arguments: json.RawMessage(`{"n":1}`)}, Caller{})
	if err != nil {
		t.Fatal(err)
	}
	fs.failComplete.Store(1) // the first Complete fails, the retry stores it
	if out, err := e.Execute(ctx, p, ok); err != nil || out.Kind != Executed {
		t.Fatal(out, err)
	}
	if err := e.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	span.End()
	if got, want := storeSpans("charge"), []string{"reserve", "complete:unavailable", "complete"}; !slices.Equal(got, want) {
		t.Errorf("the executed call's store spans: %v, want %v", got, want)
	}

	// A call whose span ended before its store round trips.
	ctx, span = e.StartCall(context.Background(), CallInfo{Tool: "charge"})
	p, err = e.PlanCall(ctx, &ToolCall{Name: "charge", Arguments: json.RawMessage(`{"n":2}`)}, Caller{})
	if err != nil {
		t.Fatal(err)
	}
	span.End()
	if out, err := e.Execute(ctx, p, ok); err != nil || out.Kind != Executed {
		t.Fatal(out, err)
	}
	if err := e.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	var calls []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "tools/call charge" {
			calls = append(calls, s)
		}
	}
	if len(calls) != 2 {
		t.Fatalf("%d call spans, want 2", len(calls))
	}
	var second []string
	for _, s := range rec.Ended() {
		if s.Parent().SpanID() == calls[1].SpanContext().SpanID() && s.SpanContext().TraceID() == calls[1].SpanContext().TraceID() {
			second = append(second, s.Name())
		}
	}
	if want := []string{"idemcp.store reserve", "idemcp.store complete"}; !slices.Equal(second, want) {
		t.Errorf("after its span ended, the call's round trips made %v, want %v", second, want)
	}

	// The same policy without storeSpans, pushed live: the call's span
	// says how it was answered, and it has no children.
	e.SetPolicy(mustPolicy(t, `spec: {keyScope: Global, tools: [{name: charge, mode: Deduplicate}]}`))
	ctx, span = e.StartCall(context.Background(), CallInfo{Tool: "refund"})
	p, err = e.PlanCall(ctx, &ToolCall{Name: "refund", Arguments: json.RawMessage(`{"n":3}`)}, Caller{})
	if err != nil {
		t.Fatal(err)
	}
	if out, err := e.Execute(ctx, p, ok); err != nil || out.Kind != Executed {
		t.Fatal(out, err)
	}
	if err := e.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	span.End()
	if got := storeSpans("refund"); len(got) != 0 {
		t.Errorf("without storeSpans, the call's store spans: %v, want none", got)
	}
	for _, s := range rec.Ended() {
		if s.Name() == "tools/call refund" && !slices.Contains(s.Attributes(), tracing.Outcome.String(tracing.OutcomeExecuted)) {
			t.Errorf("without storeSpans, the call's span has %v, want %s executed", s.Attributes(), tracing.Outcome)
		}
	}
}
