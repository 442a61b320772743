package mcpmiddleware_test

import (
	"context"
	"strings"
	"testing"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemcp/idemcp/idempotency"
	"github.com/idemcp/idemcp/idempotency/mcpmiddleware"
)

// callThrough makes one charge_card call, with the idempotency key
// order-1, through the middleware made of opts (LocalClient set; under
// outer, if not nil), to a server whose charge_card answers what tool
// returns; it returns the text the client got.
func callThrough(t *testing.T, opts mcpmiddleware.Options, outer mcp.Middleware, tool func(ctx context.Context) string) string {
	t.Helper()
	server := mcp.NewServer(&mcp.Implementation{Name: "payments", Version: "1"}, nil)
	mcp.AddTool(server, &mcp.Tool{Name: "charge_card"}, func(ctx context.Context, _ *mcp.CallToolRequest, _ chargeIn) (*mcp.CallToolResult, any, error) {
		return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: tool(ctx)}}}, nil, nil
	})
	opts.LocalClient = true
	mw, err := mcpmiddleware.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	if outer != nil {
		server.AddReceivingMiddleware(outer, mw.Handler)
	} else {
		server.AddReceivingMiddleware(mw.Handler)
	}
	ctx := context.Background()
	sst, cst := mcp.NewInMemoryTransports()
	if _, err := server.Connect(ctx, sst, nil); err != nil {
		t.Fatal(err)
	}
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "agent", Version: "1"}, nil).Connect(ctx, cst, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cs.Close() }()
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "charge_card", Arguments: map[string]any{"card": "4242", "amount": 5},
		Meta: mcp.Meta{"idempotency-key": "order-1"}})
	if err != nil {
		t.Fatal(err)
	}
	return res.Content[0].(*mcp.TextContent).Text
}

// A Group.Do in a tool's handler, inside a traced middleware call whose
// policy has no storeSpans: the call's round trips get no store spans,
// the Do's get theirs, under the Do's span, as the library promises.
func TestDoInsideTracedCallKeepsItsStoreSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	g := idempotency.NewGroup(idempotency.NewMemoryStore(), idempotency.Options{TracerProvider: tp})
	callThrough(t, mcpmiddleware.Options{TracerProvider: tp}, nil, func(ctx context.Context) string {
		if _, _, err := g.Do(ctx, "k", "fp", func(context.Context) ([]byte, error) { return []byte("v"), nil }); err != nil {
			t.Error(err)
		}
		return "ok"
	})
	var call, do sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		switch s.Name() {
		case "tools/call charge_card":
			call = s
		case "idempotency.Do":
			do = s
		}
	}
	if call == nil || do == nil {
		t.Fatalf("spans %v, want the call's and the Do's", spanNames(rec))
	}
	var underDo []string
	for _, s := range rec.Ended() {
		if !strings.HasPrefix(s.Name(), "idemcp.store ") {
			continue
		}
		switch s.Parent().SpanID() {
		case do.SpanContext().SpanID():
			underDo = append(underDo, s.Name())
		case call.SpanContext().SpanID():
			t.Errorf("the call, under a policy without storeSpans, has a store span %s", s.Name())
		default:
			t.Errorf("store span %s under neither the call nor the Do", s.Name())
		}
	}
	if strings.Join(underDo, ",") != "idemcp.store reserve,idemcp.store complete" {
		t.Errorf("the Do's store spans: %v, want reserve and complete (all spans: %v)", underDo, spanNames(rec))
	}
}

// With idemcp's tracing off (no TracerProvider, a policy without
// tracing), a call under an embedding application's sampled span makes
// no span of idemcp's at all: no call span, no store spans.
func TestTracingOffMakesNoSpansUnderAnAppSpan(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	app := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	outer := func(next mcp.MethodHandler) mcp.MethodHandler {
		return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
			ctx, span := app.Tracer("app").Start(ctx, "app "+method)
			defer span.End()
			return next(ctx, method, req)
		}
	}
	callThrough(t, mcpmiddleware.Options{}, outer, func(context.Context) string { return "ok" })
	names := spanNames(rec)
	if !strings.Contains(strings.Join(names, ","), "app tools/call") {
		t.Fatalf("spans %v, want the application's span of the call", names)
	}
	for _, n := range names {
		if !strings.HasPrefix(n, "app ") {
			t.Errorf("tracing off, idemcp made a span %q under the application's (all: %v)", n, names)
		}
	}
}

func spanNames(rec *tracetest.SpanRecorder) []string {
	var names []string
	for _, s := range rec.Ended() {
		names = append(names, s.Name())
	}
	return names
}
