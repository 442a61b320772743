// Package monitoring tests what config/monitoring ships (and the chart
// renders from it): the Grafana dashboard and the PrometheusRule name only
// metrics idemcp exports, the rules pass promtool's checks and a test case
// each, and the chart renders the monitors only when asked.
package monitoring

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/idemcp/idemcp/internal/metricsdoc"
	"github.com/idemcp/idemcp/test/testdeps"
)

const root = "../.."

type rule struct {
	Alert       string            `json:"alert"`
	Expr        string            `json:"expr"`
	Annotations map[string]string `json:"annotations"`
}

type ruleGroup struct {
	Name  string `json:"name"`
	Rules []rule `json:"rules"`
}

// rules returns the spec of config/monitoring/prometheusrule.yaml as
// YAML (a Prometheus rule file) and its groups.
func rules(t *testing.T) ([]byte, []ruleGroup) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "config/monitoring/prometheusrule.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var pr struct {
		Kind string          `json:"kind"`
		Spec json.RawMessage `json:"spec"`
	}
	if err := yaml.Unmarshal(b, &pr); err != nil {
		t.Fatal(err)
	}
	var spec struct {
		Groups []ruleGroup `json:"groups"`
	}
	if err := json.Unmarshal(pr.Spec, &spec); err != nil {
		t.Fatal(err)
	}
	file, err := yaml.JSONToYAML(pr.Spec)
	if err != nil {
		t.Fatal(err)
	}
	if pr.Kind != "PrometheusRule" || len(spec.Groups) == 0 {
		t.Fatalf("prometheusrule.yaml is a %q with %d groups", pr.Kind, len(spec.Groups))
	}
	return file, spec.Groups
}

type dashboardPanel struct {
	Type    string `json:"type"`
	Title   string `json:"title"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
	Links []struct {
		URL string `json:"url"`
	} `json:"links"`
}

func dashboard(t *testing.T) []dashboardPanel {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "config/monitoring/grafana-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []dashboardPanel `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	return d.Panels
}

var (
	stringLit  = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)
	matchers   = regexp.MustCompile(`\{[^}]*\}`)
	grouping   = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	ranges     = regexp.MustCompile(`\[[^\]]*\]`)
	identifier = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)
	keywords   = []string{"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring", "group_left", "group_right"}
)

// metricNames returns the metric names a PromQL expression selects:
// identifiers outside strings, label matchers, groupings and ranges that
// are neither keywords nor functions (followed by a parenthesis).
func metricNames(expr string) []string {
	e := stringLit.ReplaceAllString(expr, `""`)
	e = matchers.ReplaceAllString(e, "")
	e = grouping.ReplaceAllString(e, "")
	e = ranges.ReplaceAllString(e, "")
	var names []string
	for _, loc := range identifier.FindAllStringIndex(e, -1) {
		name := e[loc[0]:loc[1]]
		if slices.Contains(keywords, name) || strings.HasPrefix(strings.TrimLeft(e[loc[1]:], " \t\n"), "(") {
			continue
		}
		if loc[0] > 0 && (e[loc[0]-1] == '$' || e[loc[0]-1] >= '0' && e[loc[0]-1] <= '9') {
			continue
		}
		names = append(names, name)
	}
	return names
}

// exported returns every metric name docs/metrics.md lists for the
// sidecar and the manager. TestMetricsDoc (in sidecar and cmd/manager)
// proves the page lists exactly what each process registers, series or
// not, so a name missing here is a name the code does not export.
func exported(t *testing.T) []string {
	t.Helper()
	page, err := os.ReadFile(filepath.Join(root, "docs/metrics.md"))
	if err != nil {
		t.Fatal(err)
	}
	names := append(metricsdoc.Documented(page, "Sidecar"), metricsdoc.Documented(page, "Manager")...)
	if len(names) < 20 {
		t.Fatalf("docs/metrics.md lists only %d metrics: did its sections move?", len(names))
	}
	return names
}

// isExported reports whether name (or, for a histogram's series, the
// histogram) is exported.
func isExported(name string, exported []string) bool {
	base := name
	for _, s := range []string{"_bucket", "_sum", "_count"} {
		if b, ok := strings.CutSuffix(name, s); ok && slices.Contains(exported, b) {
			base = b
		}
	}
	for _, e := range exported {
		if f, ok := strings.CutSuffix(e, "*"); ok && strings.HasPrefix(base, f) || e == base {
			return true
		}
	}
	return false
}

func TestMetricNames(t *testing.T) {
	if got, want := metricNames(`sum by (namespace) (rate(a_total{outcome="replayed",namespace=~"$namespace"}[$__rate_interval])) / on(x) histogram_quantile(0.99, sum by (le) (rate(b_bucket[5m]))) > 3 * c offset 10m unless d`), []string{"a_total", "b_bucket", "c", "d"}; !slices.Equal(got, want) {
		t.Fatalf("metricNames = %v, want %v", got, want)
	}
}

// TestMonitoringNamesExportedMetrics: a panel or an alert that names a
// metric the code does not export (renamed, removed, mistyped) fails.
func TestMonitoringNamesExportedMetrics(t *testing.T) {
	exp := exported(t)
	check := func(where, expr string) {
		names := metricNames(expr)
		if len(names) == 0 {
			t.Errorf("%s: no metric in %q", where, expr)
		}
		for _, n := range names {
			if !isExported(n, exp) {
				t.Errorf("%s names %s, which idemcp does not export (docs/metrics.md)", where, n)
			}
		}
	}
	_, groups := rules(t)
	for _, g := range groups {
		for _, r := range g.Rules {
			check("alert "+r.Alert, r.Expr)
		}
	}
	panels := dashboard(t)
	for _, p := range panels {
		for _, q := range p.Targets {
			check("panel "+p.Title, q.Expr)
		}
	}
	if len(panels) < 10 {
		t.Fatalf("the dashboard has %d panels", len(panels))
	}
}

// TestLinksResolve: each panel links to a section of the metrics page,
// each alert's runbook_url to a section of docs/runbooks.md.
func TestLinksResolve(t *testing.T) {
	anchors := func(page string) map[string]bool {
		b, err := os.ReadFile(filepath.Join(root, "docs", page))
		if err != nil {
			t.Fatal(err)
		}
		a := map[string]bool{}
		for _, line := range strings.Split(string(b), "\n") {
			if h, ok := strings.CutPrefix(line, "## "); ok {
				a[strings.ToLower(strings.ReplaceAll(strings.TrimSpace(h), " ", "-"))] = true
			}
		}
		return a
	}
	const base = "https://github.com/idemcp/idemcp/blob/main/docs/"
	resolve := func(where, url string) {
		page, anchor, ok := strings.Cut(strings.TrimPrefix(url, base), "#")
		if !strings.HasPrefix(url, base) || !ok || !anchors(page)[anchor] {
			t.Errorf("%s links to %s, which is not a section of a page in docs/", where, url)
		}
	}
	for _, p := range dashboard(t) {
		if p.Type == "row" {
			continue
		}
		if len(p.Links) == 0 || !strings.Contains(p.Links[0].URL, "/metrics.md#") {
			t.Errorf("panel %q does not link to the metrics page", p.Title)
			continue
		}
		resolve("panel "+p.Title, p.Links[0].URL)
	}
	_, groups := rules(t)
	for _, g := range groups {
		for _, r := range g.Rules {
			if !strings.Contains(r.Annotations["runbook_url"], "/runbooks.md#") {
				t.Errorf("alert %s has no runbook_url in docs/runbooks.md", r.Alert)
				continue
			}
			resolve("alert "+r.Alert, r.Annotations["runbook_url"])
		}
	}
}

func promtool(t *testing.T) string {
	t.Helper()
	p := os.Getenv("PROMTOOL")
	if p == "" {
		testdeps.Missing(t, "PROMTOOL is not set: run through make test, which builds promtool into bin/ (make promtool)")
	}
	if _, err := os.Stat(p); err != nil {
		testdeps.Missing(t, "promtool: "+err.Error()+" (make promtool builds it)")
	}
	return p
}

func run(t *testing.T, dir, name string, args ...string) []byte {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(name), strings.Join(args, " "), err, out)
	}
	return out
}

// TestPromtool: the rules pass promtool check rules, every alert has a
// promtool test rules case, and the cases pass. The dashboard's queries are
// checked by the same parser, as recording rules.
func TestPromtool(t *testing.T) {
	pt := promtool(t)
	dir := t.TempDir()
	file, groups := rules(t)
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), file, 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, dir, pt, "check", "rules", "rules.yaml")

	cases, err := os.ReadFile("testdata/alerts_test.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var tests struct {
		Tests []struct {
			AlertRuleTests []struct {
				Alertname string `json:"alertname"`
			} `json:"alert_rule_test"`
		} `json:"tests"`
	}
	if err := yaml.Unmarshal(cases, &tests); err != nil {
		t.Fatal(err)
	}
	tested := map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTests {
			tested[a.Alertname] = true
		}
	}
	for _, g := range groups {
		for _, r := range g.Rules {
			if !tested[r.Alert] {
				t.Errorf("alert %s has no case in testdata/alerts_test.yaml", r.Alert)
			}
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "alerts_test.yaml"), cases, 0o644); err != nil {
		t.Fatal(err)
	}
	out := run(t, dir, pt, "test", "rules", "alerts_test.yaml")
	t.Logf("promtool test rules:\n%s", out)

	// Grafana's variables are not PromQL: give them values Prometheus takes.
	vars := strings.NewReplacer("$__rate_interval", "5m", "$namespace", ".*")
	type recording struct {
		Record string `json:"record"`
		Expr   string `json:"expr"`
	}
	var recs []recording
	for _, p := range dashboard(t) {
		for _, q := range p.Targets {
			recs = append(recs, recording{Record: "idemcp:dashboard:panel", Expr: vars.Replace(q.Expr)})
		}
	}
	b, err := yaml.Marshal(map[string]any{"groups": []any{map[string]any{"name": "dashboard", "rules": recs}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "dashboard.yaml"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, dir, pt, "check", "rules", "--lint=none", "dashboard.yaml")
}

// TestChartMonitors: helm template renders the ServiceMonitor, the
// PodMonitor, the PrometheusRule and the dashboard only when their values
// ask for them, with the labels given; helm lint passes both ways.
func TestChartMonitors(t *testing.T) {
	helm := os.Getenv("HELM")
	if helm == "" {
		testdeps.Missing(t, "HELM is not set: run through make test, which installs helm into bin/")
	}
	chart := filepath.Join(root, "dist/chart")
	kinds := func(out []byte) map[string]map[string]any {
		got := map[string]map[string]any{}
		for _, doc := range bytes.Split(out, []byte("\n---\n")) {
			var o struct {
				Kind     string `json:"kind"`
				Metadata struct {
					Name      string            `json:"name"`
					Namespace string            `json:"namespace"`
					Labels    map[string]string `json:"labels"`
				} `json:"metadata"`
			}
			if err := yaml.Unmarshal(doc, &o); err != nil {
				t.Fatalf("helm template printed a document that is not YAML: %v\n%s", err, doc)
			}
			if o.Kind != "" {
				got[o.Kind+"/"+o.Metadata.Name] = map[string]any{"namespace": o.Metadata.Namespace, "labels": o.Metadata.Labels}
			}
		}
		return got
	}
	monitors := []string{"ServiceMonitor/idemcp-manager", "Service/idemcp-manager-metrics", "PodMonitor/idemcp-sidecars", "PrometheusRule/idemcp-alerts", "ConfigMap/idemcp-dashboard"}

	off := kinds(run(t, ".", helm, "template", "idemcp", chart, "--namespace", "idemcp-system"))
	if _, ok := off["Deployment/idemcp-manager"]; !ok {
		t.Fatalf("helm template rendered no manager: %v", off)
	}
	for _, m := range monitors {
		if _, ok := off[m]; ok {
			t.Errorf("helm template rendered %s by default; monitoring is off by default", m)
		}
	}

	on := []string{
		"--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.serviceMonitor.labels.release=prom",
		"--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.podMonitor.labels.release=prom",
		"--set", "monitoring.prometheusRule.enabled=true", "--set", "monitoring.prometheusRule.labels.release=prom",
		"--set", "monitoring.dashboard.enabled=true", "--set", "monitoring.dashboard.labels.release=prom",
		"--set", "monitoring.dashboard.namespace=grafana",
	}
	out := run(t, ".", helm, append([]string{"template", "idemcp", chart, "--namespace", "idemcp-system"}, on...)...)
	got := kinds(out)
	for _, m := range monitors {
		o, ok := got[m]
		if !ok {
			t.Errorf("helm template with monitoring.*.enabled=true did not render %s", m)
			continue
		}
		labels, _ := o["labels"].(map[string]string)
		if m != "Service/idemcp-manager-metrics" && labels["release"] != "prom" {
			t.Errorf("%s has labels %v, want release=prom from its value", m, labels)
		}
		wantNS := "idemcp-system"
		if m == "ConfigMap/idemcp-dashboard" {
			wantNS = "grafana"
			if labels["grafana_dashboard"] != "1" {
				t.Errorf("the dashboard ConfigMap has labels %v, want grafana_dashboard=1 for Grafana's sidecar", labels)
			}
		}
		if o["namespace"] != wantNS {
			t.Errorf("%s is in namespace %v, want %s", m, o["namespace"], wantNS)
		}
	}
	// Helm must print Grafana's and Prometheus's own {{ }} as they are.
	for _, want := range []string{`"legendFormat": "{{outcome}}"`, "{{ $labels.namespace }}"} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("the rendered monitoring objects do not contain %s", want)
		}
	}

	run(t, ".", helm, "lint", chart)
	run(t, ".", helm, append([]string{"lint", chart}, on...)...)
}
