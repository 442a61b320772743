package policysync

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/internal/claim"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/internal/store"
)

// A sidecar asked for a stored result (kubectl idemcp keys show --result
// on a Memory store) sends the response as the call returned it, not with
// the tracing trailer its record holds.
func TestKeysLookupSendsResultWithoutTracingTrailer(t *testing.T) {
	start := policy.Default()
	start.Namespace, start.Name = "shop", "pay"
	mem := store.NewMemory(0)
	defer func() { _ = mem.Close() }()
	c, err := New(Options{Endpoint: "https://manager", Namespace: "shop", Name: "pay", Token: func() (string, error) { return "t", nil },
		Engine: engine.New(engine.Options{Policy: start}), Keys: mem})
	if err != nil {
		t.Fatal(err)
	}
	sampled := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		SpanID:     trace.SpanID{1, 2, 3, 4, 5, 6, 7, 8},
		TraceFlags: trace.FlagsSampled,
	})
	const key = "0123456789abcdef0123456789abcdef"
	response := []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[]}}`)
	p := claim.New(claim.Options{Store: mem})
	if r, err := p.Reserve(context.Background(), store.Claim{Key: key, Fingerprint: "f", Owner: "o", Lease: time.Minute, Retention: time.Hour}, claim.Waits{Timeout: time.Second}); err != nil || r.State != store.Won {
		t.Fatalf("Reserve = %v, %v", r, err)
	}
	if err := p.CompleteJSON(trace.ContextWithSpanContext(context.Background(), sampled), key, "o", response, time.Hour, func() {}); err != nil {
		t.Fatal(err)
	}
	if _, stored, _ := mem.Lookup(context.Background(), key); string(stored) == string(response) {
		t.Fatal("the stored record has no trailer: this test shows nothing")
	}
	rep := c.keysReport(context.Background(), &policywire.KeysRequest{ID: "x-keys", Op: policywire.KeysLookup, Key: key, Response: true})
	if rep.KeysReply == nil || rep.KeysReply.Error != "" || rep.KeysReply.Code != "" {
		t.Fatalf("reply = %+v", rep.KeysReply)
	}
	if got := string(rep.KeysReply.Response); got != string(response) {
		t.Errorf("the sidecar sent the result %q, want %q", got, response)
	}
}
