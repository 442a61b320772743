package engine

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/internal/store"
)

// Each way a call is answered is the outcome on its span, what the user
// sent stays out of every span, and a replay names and links the
// execution; a policy without tracing makes no span at all.
func TestCallSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	pol := mustPolicy(t, `
metadata: {name: payments, namespace: shop}
spec:
  keyScope: Principal
  tools: [{name: charge, mode: Deduplicate}, {name: read, mode: Passthrough}]
`)
	st := store.NewMemory(0)
	defer func() { _ = st.Close() }()
	e := New(Options{Policy: pol, Store: st, Tracing: Tracing{Provider: func() trace.TracerProvider { return tp }, On: true}})
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
