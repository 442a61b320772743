package claim_test

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/internal/claim"
	"github.com/idemcp/idemcp/internal/store"
)

// A traced call's record, read back by an Inspector (as kubectl idemcp
// keys show --result reads it), holds the tracing trailer; StripTrace
// gives the response as the call returned it, and leaves a response with
// no trailer as it is.
func TestStoredResultShownWithoutTracingTrailer(t *testing.T) {
	sampled := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		SpanID:     trace.SpanID{0xa, 0xb, 0xc, 0xd, 0xe, 0xf, 1, 2},
		TraceFlags: trace.FlagsSampled,
	})
	response := []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[]}}`)
	st := store.NewMemory(0)
	defer func() { _ = st.Close() }()
	p := claim.New(claim.Options{Store: st})
	c := store.Claim{Key: "k", Fingerprint: "f", Owner: "o", Lease: time.Minute, Retention: time.Hour}
	if r, err := p.Reserve(context.Background(), c, claim.Waits{Timeout: time.Second}); err != nil || r.State != store.Won {
		t.Fatalf("Reserve = %v, %v", r, err)
	}
	ctx := trace.ContextWithSpanContext(context.Background(), sampled)
	if err := p.CompleteJSON(ctx, "k", "o", response, time.Hour, func() {}); err != nil {
		t.Fatal(err)
	}
	_, stored, err := st.Lookup(context.Background(), "k")
	if err != nil {
		t.Fatal(err)
	}
	if string(stored) == string(response) {
		t.Fatal("the stored record has no trailer: this test shows nothing")
	}
	if got := claim.StripTrace(stored); string(got) != string(response) {
		t.Errorf("StripTrace(stored) = %q, want %q", got, response)
	}
	if got := claim.StripTrace(response); string(got) != string(response) {
		t.Errorf("StripTrace of a response with no trailer = %q, want it as it is", got)
	}
	if got := claim.StripTrace(nil); len(got) != 0 {
		t.Errorf("StripTrace(nil) = %q", got)
	}
}
