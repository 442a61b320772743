package claim_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/internal/claim"
	"github.com/idemcp/idemcp/internal/store"
)

// spying keeps what was last stored, as a reader of the store sees it.
type spying struct {
	*store.Memory
	stored []byte
}

func (s *spying) Complete(ctx context.Context, key, owner string, resp []byte, ttl time.Duration) error {
	s.stored = append([]byte(nil), resp...)
	return s.Memory.Complete(ctx, key, owner, resp, ttl)
}

// The span of a traced call is kept with its record and handed to the
// replay; an untraced call's record is stored byte for byte as before,
// and a traced one still reads, to a reader that does not know the
// trailer, as the JSON it stored.
func TestExecutionKeptWithRecord(t *testing.T) {
	sampled := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		SpanID:     trace.SpanID{0xa, 0xb, 0xc, 0xd, 0xe, 0xf, 1, 2},
		TraceFlags: trace.FlagsSampled,
	})
	unsampled := trace.NewSpanContext(trace.SpanContextConfig{TraceID: sampled.TraceID(), SpanID: sampled.SpanID()})
	response := []byte(`{"jsonrpc":"2.0","result":{"content":[]}}`)
	for _, tc := range []struct {
		name      string
		sc        trace.SpanContext
		wantTrace bool
	}{
		{"traced", sampled, true},
		{"not sampled", unsampled, false},
		{"no span", trace.SpanContext{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &spying{Memory: store.NewMemory(0)}
			defer func() { _ = st.Close() }()
			p := claim.New(claim.Options{Store: st})
			c := store.Claim{Key: "k", Fingerprint: "f", Owner: "o", Lease: time.Minute, Retention: time.Hour}
			if r, err := p.Reserve(context.Background(), c, claim.Waits{Timeout: time.Second}); err != nil || r.State != store.Won {
				t.Fatalf("Reserve = %v, %v", r, err)
			}
			ctx := trace.ContextWithSpanContext(context.Background(), tc.sc)
			if err := p.CompleteJSON(ctx, "k", "o", response, time.Hour, func() {}); err != nil {
				t.Fatal(err)
			}
			if !tc.wantTrace && string(st.stored) != string(response) {
				t.Errorf("an untraced record is stored as %q, want the response unchanged", st.stored)
			}
			var old any
			if err := json.Unmarshal(st.stored, &old); err != nil {
				t.Errorf("a reader that does not know trace trailers cannot read the record: %v", err)
			}
			c.Owner = "retry"
			r, err := p.Reserve(context.Background(), c, claim.Waits{Timeout: time.Second})
			if err != nil || r.State != store.Completed {
				t.Fatalf("retry's Reserve = %v, %v", r, err)
			}
			if string(r.Response) != string(response) {
				t.Errorf("replayed response = %q, want %q", r.Response, response)
			}
			if got := r.Execution.IsValid(); got != tc.wantTrace {
				t.Fatalf("Execution valid = %v, want %v", got, tc.wantTrace)
			}
			if tc.wantTrace && (r.Execution.TraceID() != sampled.TraceID() || r.Execution.SpanID() != sampled.SpanID() || !r.Execution.IsSampled()) {
				t.Errorf("Execution = %v, want the executing span %v", r.Execution, sampled)
			}
		})
	}
}

// A record that merely ends in whitespace (stored before trailers, or a
// value of the user's) is read as it is.
func TestOldRecordsRead(t *testing.T) {
	st := store.NewMemory(0)
	defer func() { _ = st.Close() }()
	p := claim.New(claim.Options{Store: st})
	value := []byte("value" + strings.Repeat(" \t", 120))
	c := store.Claim{Key: "k", Fingerprint: "f", Owner: "o", Lease: time.Minute, Retention: time.Hour}
	if _, err := p.Reserve(context.Background(), c, claim.Waits{Timeout: time.Second}); err != nil {
		t.Fatal(err)
	}
	if err := st.Complete(context.Background(), "k", "o", value, time.Hour); err != nil {
		t.Fatal(err)
	}
	c.Owner = "retry"
	r, err := p.Reserve(context.Background(), c, claim.Waits{Timeout: time.Second})
	if err != nil || string(r.Response) != string(value) || r.Execution.IsValid() {
		t.Fatalf("Reserve = %q, %v, %v; want the record as stored, with no execution", r.Response, r.Execution, err)
	}
}
