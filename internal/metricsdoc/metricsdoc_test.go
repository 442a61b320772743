package metricsdoc

import (
	"reflect"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestNamesListsVectorsWithoutSeries(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		prometheus.NewCounterVec(prometheus.CounterOpts{Name: "a_total", Help: "a"}, []string{"x"}),
		prometheus.NewGauge(prometheus.GaugeOpts{Name: "b", Help: "b"}),
	)
	got, err := Names(reg)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"a_total", "b"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("Names = %v, want %v", got, want)
	}
}

func TestCompare(t *testing.T) {
	page := []byte("# Metrics\n\n## Sidecar\n\n| metric | type |\n| --- | --- |\n" +
		"| `idemcp_a_total` | counter; see `idemcp_b_total` |\n| `go_*` | mixed |\n| `gone_total` | counter |\n| `proc_*` | mixed |\n\n" +
		"## Manager\n\n| `idemcp_m_total` | counter |\n")
	doc := Documented(page, "Sidecar")
	if want := []string{"idemcp_a_total", "go_*", "gone_total", "proc_*"}; !reflect.DeepEqual(doc, want) {
		t.Fatalf("Documented = %v, want %v", doc, want)
	}
	got := Compare([]string{"go_goroutines", "idemcp_a_total", "idemcp_new_total"}, doc)
	want := []string{
		"gone_total has a row in docs/metrics.md but is not registered",
		"idemcp_new_total is registered but has no row in docs/metrics.md",
		"proc_* has a row in docs/metrics.md but no registered metric starts with proc_",
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Compare =\n%q\nwant\n%q", got, want)
	}
}
