package idempotency_test

import (
	"context"
	"slices"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemcp/idemcp/idempotency"
)

// A Do that runs fn has its store round trips as child spans, reserve
// then complete; its replay has its reserve alone. No policy turns them
// off: a Group has none.
func TestDoStoreSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	g := idempotency.NewGroup(idempotency.NewMemoryStore(), idempotency.Options{TracerProvider: tp})
	for range 2 {
		if _, _, err := g.Do(context.Background(), "order-1", "fp", func(context.Context) ([]byte, error) { return []byte("v"), nil }); err != nil {
			t.Fatal(err)
		}
	}
	var dos []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "idempotency.Do" {
			dos = append(dos, s)
		}
	}
	if len(dos) != 2 {
		t.Fatalf("%d Do spans, want 2", len(dos))
	}
	for i, want := range [][]string{{"idemcp.store reserve", "idemcp.store complete"}, {"idemcp.store reserve"}} {
		var got []string
		for _, s := range rec.Ended() {
			if s.Parent().SpanID() == dos[i].SpanContext().SpanID() {
				got = append(got, s.Name())
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("Do %d: child spans %v, want %v", i+1, got, want)
		}
	}
}
