package engine

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the engine's Prometheus series.
type Metrics struct {
	Calls       *prometheus.CounterVec
	Classified  *prometheus.CounterVec
	NotStored   *prometheus.CounterVec
	StoreErrors *prometheus.CounterVec
	TakeOvers   prometheus.Counter
	Panics      *prometheus.CounterVec
	OverLimit   *prometheus.CounterVec
	Running     prometheus.Gauge
	// EarlierReplays counts replays found under the key a call had before
	// a policy change moved it (history.go).
	EarlierReplays prometheus.Counter
	// LegacyReplays counts replays found under the key a call had in the
	// other key space, during an upgrade to key spaces (legacy.go).
	LegacyReplays prometheus.Counter
	// CallsByTool is Calls by tool as well: idemcp_tool_calls_by_tool_total.
	// Its tool label is bounded (see toolLabel).
	CallsByTool *prometheus.CounterVec
	// AddedLatency is the time a call that runs upstream spends in idemcp
	// before it is forwarded: classifying it and claiming its key.
	AddedLatency prometheus.Histogram

	mu sync.Mutex
	// unlisted are the tool names no listing named that got a label of
	// their own, at most maxUnlistedToolLabels.
	unlisted map[string]bool
}

// ToolOther is the tool label of idemcp_tool_calls_by_tool_total for a
// tool no listing named, once maxUnlistedToolLabels such names have a
// label: a client sends any name it likes, and each would be a series.
const ToolOther = "other"

const maxUnlistedToolLabels = 64

// toolLabel is tool itself if the server listed it or fewer than
// maxUnlistedToolLabels unlisted names came before it; otherwise ToolOther.
func (m *Metrics) toolLabel(tool string, listed bool) string {
	if listed {
		return tool
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.unlisted[tool] {
		return tool
	}
	if len(m.unlisted) >= maxUnlistedToolLabels {
		return ToolOther
	}
	if m.unlisted == nil {
		m.unlisted = map[string]bool{}
	}
	m.unlisted[tool] = true
	return tool
}

// Outcome labels of idemcp_tool_calls_total.
const (
	OutcomeExecuted    = "executed"
	OutcomeReplayed    = "replayed"
	OutcomePassthrough = "passthrough"
	OutcomeRejected    = "rejected"
	OutcomeFailedOpen  = "failed_open"
	// OutcomeUnscoped is a call forwarded without deduplication because its
	// derived key would have had no scope (no session, no principal).
	OutcomeUnscoped = "unscoped"
)

// NewMetrics registers the engine's series with reg (nil: not registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemcp_tool_calls_total",
			Help: "tools/call requests by outcome: executed, replayed, passthrough, rejected (an idemcp error), failed_open or unscoped (no session or principal to scope a derived key).",
		}, []string{"outcome"}),
		Classified: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemcp_tool_calls_classified_total",
			Help: "tools/call requests by how their mode was decided (reason: rule, readOnlyHint, idempotentHint, noAnnotations or unknown) and what it is (mode: deduplicate or passthrough).",
		}, []string{"reason", "mode"}),
		NotStored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemcp_results_not_stored_total",
			Help: "Deduplicated calls whose result was not kept for replay, by reason.",
		}, []string{"reason"}),
		StoreErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemcp_store_errors_total",
			Help: "Store operations that failed, by operation.",
		}, []string{"op"}),
		TakeOvers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idemcp_claims_taken_over_total",
			Help: "Claims whose owner died mid-call and that another call took over (onAbandoned: Retry).",
		}),
		Panics: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemcp_panics_total",
			Help: "Panics recovered while handling a call, by where they happened; the process went on.",
		}, []string{"where"}),
		OverLimit: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemcp_over_limit_total",
			Help: "Requests refused, or work skipped, because a caller, or all callers together, was over a bound: waiters_per_key, waiters_per_principal, streams_per_principal, streams_total, running_per_principal, running_total, tools_list_buffers, tools_list_contexts.",
		}, []string{"limit"}),
		Running: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idemcp_calls_running",
			Help: "Deduplicated calls running upstream, those whose client left included, and calls forwarded under FailOpen.",
		}),
		EarlierReplays: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idemcp_replays_under_earlier_policy_total",
			Help: "Retries replayed from the key they had under an earlier policy, because a live change of keyScope or ignoreArguments moved their key; they are also counted as replayed.",
		}),
		LegacyReplays: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idemcp_replays_under_legacy_keys_total",
			Help: "Retries replayed from the key they had in the other key derivation (with or without the sidecar's key space) while an upgrade from an idemcp without key spaces is under way; they are also counted as replayed.",
		}),
		CallsByTool: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemcp_tool_calls_by_tool_total",
			Help: "tools/call requests by tool and outcome (the outcomes of idemcp_tool_calls_total); a tool no tools/list named is \"other\" once 64 such names are counted.",
		}, []string{"tool", "outcome"}),
		AddedLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "idemcp_added_latency_seconds",
			Help:    "Time a deduplicated call that runs upstream spends in idemcp before it is forwarded (classifying it, claiming its key in the store).",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
		}),
	}
	if reg != nil {
		reg.MustRegister(m.Calls, m.Classified, m.NotStored, m.StoreErrors, m.TakeOvers, m.Panics, m.OverLimit, m.Running, m.EarlierReplays, m.LegacyReplays, m.CallsByTool, m.AddedLatency)
	}
	return m
}
