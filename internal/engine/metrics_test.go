package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemcp/idemcp/internal/store"
)

// TestCallsByTool: each outcome is counted by tool too, and a client that
// sends call after call to tools no listing named makes a bounded number
// of series.
func TestCallsByTool(t *testing.T) {
	e := New(Options{Policy: mustPolicy(t, `spec: {defaultMode: Auto, tools: [{name: "charge", mode: Deduplicate}]}`), Store: store.NewMemory(0)})
	e.Hints().ObserveListResult(json.RawMessage(`{"tools":[{"name":"charge"},{"name":"read","annotations":{"readOnlyHint":true}}]}`))
	ctx := context.Background()
	fwd := func(context.Context) (Upstream, error) {
		return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[]}}`), Status: 200}, nil
	}
	call := func(tool string, c Caller) {
		t.Helper()
		tc, err := ParseToolCall(json.RawMessage(`{"name":"` + tool + `","arguments":{"amount":1}}`))
		if err != nil {
			t.Fatal(err)
		}
		p, err := e.Plan(tc, c)
		if err != nil || p == nil {
			return
		}
		if _, err := e.Execute(ctx, p, fwd); err != nil {
			t.Fatal(err)
		}
	}
	call("charge", alice)
	call("charge", alice)
	call("read", alice)
	call("charge", Caller{})
	byTool := e.Metrics().CallsByTool
	for _, tt := range []struct {
		tool, outcome string
		want          float64
	}{
		{"charge", OutcomeExecuted, 1},
		{"charge", OutcomeReplayed, 1},
		{"charge", OutcomeUnscoped, 1},
		{"read", OutcomePassthrough, 1},
	} {
		if n := counter(byTool.WithLabelValues(tt.tool, tt.outcome)); n != tt.want {
			t.Errorf(`idemcp_tool_calls_by_tool_total{tool=%q,outcome=%q} = %v, want %v`, tt.tool, tt.outcome, n, tt.want)
		}
	}

	for i := range 3 * maxUnlistedToolLabels {
		call(fmt.Sprintf("junk_%d", i), alice)
	}
	if n := testSeries(t, byTool); n > 4+maxUnlistedToolLabels+1 {
		t.Errorf("%d series after calls to %d unlisted tools, want at most %d", n, 3*maxUnlistedToolLabels, 4+maxUnlistedToolLabels+1)
	}
	if n := counter(byTool.WithLabelValues(ToolOther, OutcomeExecuted)); n != 2*maxUnlistedToolLabels {
		t.Errorf(`idemcp_tool_calls_by_tool_total{tool="other",outcome="executed"} = %v, want %d`, n, 2*maxUnlistedToolLabels)
	}
	if n := counter(byTool.WithLabelValues("charge", OutcomeExecuted)); n != 1 {
		t.Errorf("a listed tool's count changed to %v after the unlisted ones filled their labels", n)
	}
}

// TestAddedLatencyObservedOncePerExecution: a call that runs upstream is
// timed once, a replay not at all.
func TestAddedLatencyObservedOncePerExecution(t *testing.T) {
	e := New(Options{Policy: mustPolicy(t, `spec: {defaultMode: Deduplicate}`), Store: store.NewMemory(0)})
	ctx := context.Background()
	for range 2 {
		tc, _ := ParseToolCall(json.RawMessage(`{"name":"charge","arguments":{}}`))
		p, err := e.Plan(tc, alice)
		if err != nil || p == nil {
			t.Fatal(p, err)
		}
		if _, err := e.Execute(ctx, p, func(context.Context) (Upstream, error) {
			return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{}}`), Status: 200}, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	var m dto.Metric
	if err := e.Metrics().AddedLatency.Write(&m); err != nil {
		t.Fatal(err)
	}
	if n := m.GetHistogram().GetSampleCount(); n != 1 {
		t.Fatalf("idemcp_added_latency_seconds counted %d calls, want 1 (the execution; the replay was not forwarded)", n)
	}
	if s := m.GetHistogram().GetSampleSum(); s <= 0 || s > 5 {
		t.Fatalf("idemcp_added_latency_seconds sum = %vs", s)
	}
}

func testSeries(t *testing.T, c prometheus.Collector) int {
	t.Helper()
	ch := make(chan prometheus.Metric, 1024)
	go func() { c.Collect(ch); close(ch) }()
	n := 0
	for range ch {
		n++
	}
	return n
}
