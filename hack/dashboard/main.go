// Command dashboard writes idemcp's Grafana dashboard, whose panels use
// only the metrics docs/metrics.md lists (test/monitoring checks it) and
// link to that page.
//
//	go run ./hack/dashboard -out config/monitoring/grafana-dashboard.json
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
)

const metricsPage = "https://github.com/idemcp/idemcp/blob/main/docs/metrics.md"

func main() {
	out := flag.String("out", "config/monitoring/grafana-dashboard.json", "file to write")
	flag.Parse()
	b, err := json.MarshalIndent(dashboard(), "", "  ")
	if err == nil {
		err = os.WriteFile(*out, append(b, '\n'), 0o644)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "dashboard: %v\n", err)
		os.Exit(1)
	}
}

// obj keeps the JSON close to what Grafana exports, without a struct per
// panel kind.
type obj = map[string]any

// query is one PromQL expression of a panel and its legend.
type query struct{ expr, legend string }

// panel is one graph: what it shows, the section of the metrics page that
// explains its metrics, its unit.
type panel struct {
	title, description, section, unit string
	queries                           []query
	stat                              bool
}

// Selectors every sidecar query uses: Prometheus Operator's PodMonitor
// and ServiceMonitor give each series its namespace and pod.
const (
	sc = `namespace=~"$namespace"`
	rw = `[$__rate_interval]`
)

func rows() []struct {
	title  string
	panels []panel
} {
	return []struct {
		title  string
		panels []panel
	}{
		{"Calls (sidecars)", []panel{
			{title: "Calls by outcome", section: "sidecar", unit: "reqps",
				description: "tools/call requests each second by outcome: executed (ran upstream, first of its key), replayed (answered from the store), passthrough, rejected (an idemcp error), failed_open (store down, forwarded undeduplicated), unscoped.",
				queries:     []query{{`sum by (outcome) (rate(idemcp_tool_calls_total{` + sc + `}` + rw + `))`, "{{outcome}}"}}},
			{title: "Calls by tool and outcome", section: "sidecar", unit: "reqps",
				description: "The same calls by tool. A tool no tools/list named is \"other\" once 64 such names are counted.",
				queries:     []query{{`sum by (tool, outcome) (rate(idemcp_tool_calls_by_tool_total{` + sc + `}` + rw + `))`, "{{tool}} {{outcome}}"}}},
			{title: "Replay ratio", section: "sidecar", unit: "percentunit",
				description: "Share of deduplicated calls answered from the store instead of running again: retries that would have run twice without idemcp. A sudden rise means clients retry much more (timeouts, a failing network); see the IdemcpReplayRatioJump runbook.",
				queries:     []query{{`sum(rate(idemcp_tool_calls_total{outcome="replayed",` + sc + `}` + rw + `)) / sum(rate(idemcp_tool_calls_total{outcome=~"executed|replayed",` + sc + `}` + rw + `))`, "replayed / (executed + replayed)"}}},
			{title: "Unscoped and unknown-tool calls", section: "sidecar", unit: "reqps",
				description: "unscoped: calls forwarded without dedup because their derived key had no session or principal to scope it. unknown tool: calls under defaultMode Auto to a tool no tools/list named in time (they were deduplicated).",
				queries: []query{
					{`sum(rate(idemcp_tool_calls_total{outcome="unscoped",` + sc + `}` + rw + `))`, "unscoped"},
					{`sum(rate(idemcp_unknown_tool_calls_total{` + sc + `}` + rw + `))`, "unknown tool"},
				}},
			{title: "Results not stored", section: "sidecar", unit: "reqps",
				description: "Deduplicated calls whose result was not kept, by reason; a retry of them runs again (or gets -32014 for too_large). outcome_unknown: the response could not be had and onAbandoned decides.",
				queries:     []query{{`sum by (reason) (rate(idemcp_results_not_stored_total{` + sc + `}` + rw + `))`, "{{reason}}"}}},
			{title: "Refused over a bound", section: "sidecar", unit: "reqps",
				description: "Requests refused with -32017 because a caller, or all callers together, was over a bound.",
				queries:     []query{{`sum by (limit) (rate(idemcp_over_limit_total{` + sc + `}` + rw + `))`, "{{limit}}"}}},
		}},
		{"Latency and store (sidecars)", []panel{
			{title: "Added latency", section: "sidecar", unit: "s",
				description: "Time a deduplicated call that runs upstream spends in idemcp before it is forwarded: classifying it and claiming its key.",
				queries: []query{
					{`histogram_quantile(0.5, sum by (le) (rate(idemcp_added_latency_seconds_bucket{` + sc + `}` + rw + `)))`, "p50"},
					{`histogram_quantile(0.99, sum by (le) (rate(idemcp_added_latency_seconds_bucket{` + sc + `}` + rw + `)))`, "p99"},
				}},
			{title: "Store latency (p99)", section: "sidecar", unit: "s",
				description: "Store round trips by operation, failed ones and sealing included.",
				queries:     []query{{`histogram_quantile(0.99, sum by (le, op) (rate(idemcp_store_duration_seconds_bucket{` + sc + `}` + rw + `)))`, "{{op}}"}}},
			{title: "Store errors", section: "sidecar", unit: "ops",
				description: "Store operations that failed, by operation. reserve errors mean calls are refused (FailClosed) or forwarded undeduplicated (FailOpen); see the IdemcpStoreUnavailable runbook.",
				queries:     []query{{`sum by (op) (rate(idemcp_store_errors_total{` + sc + `}` + rw + `))`, "{{op}}"}}},
			{title: "Sealed records that did not open", section: "sidecar", unit: "ops",
				description: "Stored results that failed to open and were treated as absent, by reason (the call ran as new).",
				queries:     []query{{`sum by (reason) (rate(idemcp_sealed_open_failures_total{` + sc + `}` + rw + `))`, "{{reason}}"}}},
			{title: "Claims taken over, panics", section: "sidecar", unit: "short",
				description: "Claims whose owner died mid-call and that another call took over (each may have run twice), and panics recovered while handling a call (each is a bug), over the range's step.",
				queries: []query{
					{`sum(increase(idemcp_claims_taken_over_total{` + sc + `}` + rw + `))`, "taken over"},
					{`sum by (where) (increase(idemcp_panics_total{` + sc + `}` + rw + `))`, "panic in {{where}}"},
				}},
			{title: "Open streams", section: "sidecar", unit: "short",
				description: "Requests the sidecars hold open: POSTs until their response ends, and GET streams.",
				queries:     []query{{`sum by (namespace, pod) (idemcp_open_streams{` + sc + `})`, "{{namespace}}/{{pod}}"}}},
		}},
		{"Policy push (manager)", []panel{
			{title: "Sidecars in sync", section: "manager", unit: "short", stat: true,
				description: "Sidecars that applied their policy's current version, of those injected, summed over the policies shown (status.sidecars of kubectl get idpol).",
				queries: []query{
					{`sum(max by (namespace, policy) (idemcp_policy_sidecars{state="synced",` + sc + `}))`, "synced"},
					{`sum(max by (namespace, policy) (idemcp_policy_sidecars{state="injected",` + sc + `}))`, "injected"},
				}},
			{title: "Sidecars out of sync, by policy", section: "manager", unit: "short",
				description: "Injected sidecars that have not applied their policy's current version: they enforce an older one, or hold no stream. See the IdemcpSidecarsOutOfSync runbook.",
				queries:     []query{{`max by (namespace, policy) (idemcp_policy_sidecars{state="injected",` + sc + `}) - max by (namespace, policy) (idemcp_policy_sidecars{state="synced",` + sc + `})`, "{{namespace}}/{{policy}}"}}},
			{title: "Policy sync lag", section: "manager", unit: "s",
				description: "Time from sending a policy version to a sidecar until it acknowledged applying it.",
				queries: []query{
					{`histogram_quantile(0.5, sum by (le) (rate(idemcp_policy_sync_duration_seconds_bucket` + rw + `)))`, "p50"},
					{`histogram_quantile(0.99, sum by (le) (rate(idemcp_policy_sync_duration_seconds_bucket` + rw + `)))`, "p99"},
				}},
			{title: "Reconciles and webhook", section: "manager", unit: "ops",
				description: "IdempotencyPolicy reconcile errors, and pods the webhook injected or refused.",
				queries: []query{
					{`sum(rate(controller_runtime_reconcile_errors_total` + rw + `))`, "reconcile errors"},
					{`sum(rate(idemcp_webhook_injections_total` + rw + `))`, "injected"},
					{`sum by (reason) (rate(idemcp_webhook_denials_total` + rw + `))`, "refused: {{reason}}"},
				}},
		}},
	}
}

func dashboard() obj {
	ds := obj{"type": "prometheus", "uid": "${datasource}"}
	var panels []any
	id, y := 1, 0
	for _, r := range rows() {
		panels = append(panels, obj{"id": id, "type": "row", "title": r.title, "collapsed": false,
			"gridPos": obj{"h": 1, "w": 24, "x": 0, "y": y}, "panels": []any{}})
		id++
		y++
		for i, p := range r.panels {
			var targets []any
			for j, q := range p.queries {
				targets = append(targets, obj{"refId": string(rune('A' + j)), "datasource": ds, "expr": q.expr, "legendFormat": q.legend, "range": true})
			}
			kind, options := "timeseries", obj{"legend": obj{"displayMode": "list", "placement": "bottom", "showLegend": true}, "tooltip": obj{"mode": "multi", "sort": "desc"}}
			if p.stat {
				kind, options = "stat", obj{"reduceOptions": obj{"calcs": []string{"lastNotNull"}, "fields": "", "values": false}, "colorMode": "value", "graphMode": "area", "textMode": "value_and_name"}
			}
			panels = append(panels, obj{
				"id": id, "type": kind, "title": p.title, "description": p.description, "datasource": ds,
				"gridPos":     obj{"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8*(i/2)},
				"targets":     targets,
				"fieldConfig": obj{"defaults": obj{"unit": p.unit}, "overrides": []any{}},
				"options":     options,
				"links":       []any{obj{"title": "These metrics on the metrics page", "url": metricsPage + "#" + p.section, "targetBlank": true}},
			})
			id++
		}
		y += 8 * ((len(r.panels) + 1) / 2)
	}
	return obj{
		"uid": "idemcp", "title": "idemcp", "tags": []string{"idemcp", "mcp"},
		"description": "Exactly-once MCP tool calls: what the sidecars decided and what it cost, and the manager's policy push. Every metric is on " + metricsPage,
		"editable":    true, "schemaVersion": 39, "version": 1, "refresh": "30s", "graphTooltip": 1,
		"time": obj{"from": "now-6h", "to": "now"}, "timezone": "",
		"annotations": obj{"list": []any{}},
		"links":       []any{obj{"title": "idemcp metrics", "url": metricsPage, "targetBlank": true, "type": "link", "icon": "doc"}},
		"templating": obj{"list": []any{
			obj{"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "current": obj{}, "hide": 0},
			obj{"name": "namespace", "label": "Namespace", "type": "query", "datasource": ds,
				"query":      obj{"query": "label_values(idemcp_policy_sidecars, namespace)", "refId": "namespaces"},
				"definition": "label_values(idemcp_policy_sidecars, namespace)",
				"includeAll": true, "multi": true, "allValue": ".*", "refresh": 2, "sort": 1,
				"current": obj{"text": "All", "value": "$__all"}},
		}},
		"panels": panels,
	}
}
