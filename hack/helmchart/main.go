// Command helmchart writes the Helm chart in dist/chart from the kustomize
// build of config/default, so the chart and `kubectl apply -k` install the
// same objects: CRDs go to crds/, everything else to templates/ with the
// namespace, the image and the manager's replicas made values. With
// -monitoring, the kustomize build of config/monitoring (ServiceMonitor,
// PodMonitor, PrometheusRule, the Grafana dashboard) becomes templates that
// render only when their monitoring.*.enabled value is true.
//
//	kustomize build config/monitoring > monitoring.yaml
//	kustomize build config/default | go run ./hack/helmchart -out dist/chart -version 0.1.0 -monitoring monitoring.yaml
package main

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"sigs.k8s.io/yaml"
)

const (
	defaultNamespace = "idemcp-system"
	defaultImage     = "ghcr.io/idemcp/idemcp"
)

func main() {
	out := flag.String("out", "dist/chart", "directory of the chart to write (replaced)")
	version := flag.String("version", "0.1.0", "the chart's version and appVersion")
	monitoring := flag.String("monitoring", "", "the kustomize build of config/monitoring, made optional templates")
	flag.Parse()
	if err := run(os.Stdin, *out, *version, *monitoring); err != nil {
		fmt.Fprintf(os.Stderr, "helmchart: %v\n", err)
		os.Exit(1)
	}
}

type meta struct {
	Kind     string `json:"kind"`
	Metadata struct {
		Name string `json:"name"`
	} `json:"metadata"`
}

var imageLine = regexp.MustCompile(`(?m)^(\s*image: )` + regexp.QuoteMeta(defaultImage) + `:\S+$`)
var replicasLine = regexp.MustCompile(`(?m)^(  replicas: )\d+$`)

func run(in io.Reader, out, version, monitoring string) error {
	all, err := io.ReadAll(in)
	if err != nil {
		return err
	}
	var mon []byte
	if monitoring != "" {
		if mon, err = os.ReadFile(monitoring); err != nil {
			return err
		}
	}
	if err := os.RemoveAll(out); err != nil {
		return err
	}
	for _, d := range []string{"crds", "templates"} {
		if err := os.MkdirAll(filepath.Join(out, d), 0o755); err != nil {
			return err
		}
	}
	n := 0
	var resources string // the manager's, as values.yaml gives them
	for _, doc := range splitDocs(all) {
		var m meta
		if err := yaml.Unmarshal(doc, &m); err != nil {
			return fmt.Errorf("document %d: %w", n, err)
		}
		if m.Kind == "" {
			continue
		}
		n++
		file := strings.ToLower(m.Kind) + "-" + m.Metadata.Name + ".yaml"
		switch m.Kind {
		case "Namespace":
			// helm install --create-namespace makes it; the chart must not
			// own the namespace it is installed into.
			continue
		case "CustomResourceDefinition":
			if err := os.WriteFile(filepath.Join(out, "crds", file), doc, 0o644); err != nil {
				return err
			}
			continue
		}
		t := string(doc)
		t = strings.ReplaceAll(t, defaultNamespace, "{{ .Release.Namespace }}")
		t = imageLine.ReplaceAllString(t, `${1}"{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"`)
		if m.Kind == "Deployment" {
			t = replicasLine.ReplaceAllString(t, `${1}{{ .Values.replicas }}`)
			t, err = tracingValues(t)
			if err != nil {
				return err
			}
			if t, resources, err = resourcesValue(t); err != nil {
				return err
			}
		}
		if err := os.WriteFile(filepath.Join(out, "templates", file), []byte(t), 0o644); err != nil {
			return err
		}
	}
	if err := writeMonitoring(mon, filepath.Join(out, "templates")); err != nil {
		return err
	}
	chart := fmt.Sprintf(`apiVersion: v2
name: idemcp
description: Exactly-once MCP tool calls on Kubernetes (generated from config/default by hack/helmchart; do not edit)
type: application
version: %s
appVersion: %q
`, version, "v"+version)
	values := `# The image of the manager, also injected as the sidecar.
image:
  repository: ` + defaultImage + `
  # Defaults to the chart's appVersion.
  tag: ""
# Manager replicas; one is the leader, the webhook is served by all.
replicas: 2
# The manager's requests and limits. Its memory grows with the sidecars it
# serves (each one's policy stream, and its pod in the manager's cache):
# give it about 64 MiB plus 120 KiB per sidecar, requests and limits alike
# (256Mi: about 1,600; docs/manager.md#memory). Its Go runtime's soft limit
# (GOMEMLIMIT) is 80% of limits.memory.
` + resources + `# OpenTelemetry tracing (docs/tracing.md). enabled traces the manager's
# reconciles and policy pushes and every tools/call of the sidecars it
# injects (a policy's spec.tracing.enabled turns it on for one policy).
# env is the OTEL_* environment of the manager, given to every injected
# sidecar too (less OTEL_SERVICE_NAME), for example:
#   - {name: OTEL_EXPORTER_OTLP_ENDPOINT, value: "http://otel-collector.observability:4318"}
tracing:
  enabled: false
  env: []
` + monitoringValues
	if err := os.WriteFile(filepath.Join(out, "Chart.yaml"), []byte(chart), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(out, "values.yaml"), []byte(values), 0o644)
}

func splitDocs(b []byte) [][]byte {
	var docs [][]byte
	var cur bytes.Buffer
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		if sc.Text() == "---" {
			docs = append(docs, append([]byte(nil), cur.Bytes()...))
			cur.Reset()
			continue
		}
		cur.Write(sc.Bytes())
		cur.WriteByte('\n')
	}
	return append(docs, cur.Bytes())
}

// resourcesBlock is the manager container's resources in the Deployment
// kustomize writes, its lines indented under it.
var resourcesBlock = regexp.MustCompile(`(?m)^        resources:\n((?:          .*\n)+)`)

// resourcesValue makes the manager's resources the chart's resources
// value, and returns that value's default as values.yaml writes it.
func resourcesValue(t string) (string, string, error) {
	m := resourcesBlock.FindStringSubmatch(t)
	if m == nil {
		return "", "", errors.New("the manager's Deployment no longer has the resources block the resources value replaces")
	}
	var def strings.Builder
	def.WriteString("resources:\n")
	for _, line := range strings.SplitAfter(strings.TrimSuffix(m[1], "\n"), "\n") {
		def.WriteString(strings.TrimPrefix(line, "        "))
	}
	def.WriteString("\n")
	return resourcesBlock.ReplaceAllString(t, "        resources:\n          {{- toYaml .Values.resources | nindent 10 }}\n"), def.String(), nil
}

// tracingValues makes the manager's --tracing flag and OTEL_* environment
// the chart's tracing values.
func tracingValues(t string) (string, error) {
	const flag = "        - --policy-stream-bind-address=:9444\n"
	const env = "              fieldPath: metadata.namespace\n"
	if !strings.Contains(t, flag) || !strings.Contains(t, env) {
		return "", errors.New("the manager's Deployment no longer has the --policy-stream-bind-address arg or the POD_NAMESPACE env the tracing values follow")
	}
	t = strings.Replace(t, flag, flag+"        {{- if .Values.tracing.enabled }}\n        - --tracing\n        {{- end }}\n", 1)
	return strings.Replace(t, env, env+"        {{- with .Values.tracing.env }}\n        {{- toYaml . | nindent 8 }}\n        {{- end }}\n", 1), nil
}

// monitoringValues are the values of the optional monitoring templates:
// each needs the Prometheus Operator's CRDs (or Grafana's dashboard
// sidecar), so each is off by default.
const monitoringValues = `# Prometheus Operator and Grafana objects (docs/metrics.md, docs/runbooks.md).
# Each needs the Prometheus Operator's CRDs; all are off by default.
# labels are added to the object (for example the release label a
# Prometheus's serviceMonitorSelector or ruleSelector matches).
monitoring:
  # A Service for the manager's /metrics (HTTPS) and a ServiceMonitor for it.
  # Bind Prometheus's service account to the ClusterRole idemcp-metrics-reader.
  serviceMonitor:
    enabled: false
    labels: {}
  # A PodMonitor for every injected sidecar (pods labelled idemcp.io/inject: "true",
  # in every namespace), on their port idemcp-admin.
  podMonitor:
    enabled: false
    labels: {}
  # idemcp's alerts.
  prometheusRule:
    enabled: false
    labels: {}
  # The Grafana dashboard, as a ConfigMap labelled grafana_dashboard: "1" for
  # Grafana's dashboard sidecar; namespace defaults to the release's.
  dashboard:
    enabled: false
    labels: {}
    namespace: ""
`

// monitoringValue is the value under monitoring that turns a kind on.
var monitoringValue = map[string]string{
	"Service":        "serviceMonitor",
	"ServiceMonitor": "serviceMonitor",
	"PodMonitor":     "podMonitor",
	"PrometheusRule": "prometheusRule",
	"ConfigMap":      "dashboard",
}

// writeMonitoring writes each object of the monitoring build as a
// template that renders only when its value is enabled. The objects hold
// Grafana legends and alert annotations written as {{ ... }}, which are
// not Helm's: they are escaped so that Helm prints them as they are.
func writeMonitoring(build []byte, dir string) error {
	for i, doc := range splitDocs(build) {
		var m meta
		if err := yaml.Unmarshal(doc, &m); err != nil {
			return fmt.Errorf("monitoring document %d: %w", i, err)
		}
		if m.Kind == "" {
			continue
		}
		value, ok := monitoringValue[m.Kind]
		if !ok {
			return fmt.Errorf("monitoring document %d: no chart value turns a %s on", i, m.Kind)
		}
		t := escapeBraces(string(doc))
		v := ".Values.monitoring." + value
		ns := "{{ .Release.Namespace }}"
		if value == "dashboard" {
			ns = "{{ " + v + ".namespace | default .Release.Namespace }}"
		}
		t = strings.ReplaceAll(t, "namespace: "+defaultNamespace, "namespace: "+ns)
		if !strings.Contains(t, "\nmetadata:\n  labels:\n") {
			return fmt.Errorf("monitoring document %d (%s): metadata has no labels to add to", i, m.Kind)
		}
		t = strings.Replace(t, "\nmetadata:\n  labels:\n", "\nmetadata:\n  labels:\n    {{- with "+v+".labels }}\n    {{- toYaml . | nindent 4 }}\n    {{- end }}\n", 1)
		t = "{{- if " + v + ".enabled }}\n" + t + "{{- end }}\n"
		file := strings.ToLower(m.Kind) + "-" + m.Metadata.Name + ".yaml"
		if err := os.WriteFile(filepath.Join(dir, file), []byte(t), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// escapeBraces makes every {{ and }} of s literal text for Helm.
func escapeBraces(s string) string {
	const open, closing = "\x00open\x00", "\x00close\x00"
	s = strings.ReplaceAll(s, "{{", open)
	s = strings.ReplaceAll(s, "}}", closing)
	s = strings.ReplaceAll(s, open, `{{ "{{" }}`)
	return strings.ReplaceAll(s, closing, `{{ "}}" }}`)
}
