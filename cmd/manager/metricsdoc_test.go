package manager

import (
	"os"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/idemcp/idemcp/internal/metricsdoc"
)

// TestMetricsDoc checks that docs/metrics.md lists every metric the
// manager serves on /metrics (idemcp's webhook counters and what
// controller-runtime registers), and nothing it does not.
func TestMetricsDoc(t *testing.T) {
	reg, ok := metrics.Registry.(*prometheus.Registry)
	if !ok {
		t.Fatalf("controller-runtime's metrics.Registry is a %T, not a *prometheus.Registry", metrics.Registry)
	}
	registered, err := metricsdoc.Names(reg)
	if err != nil {
		t.Fatal(err)
	}
	page, err := os.ReadFile("../../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range metricsdoc.Compare(registered, metricsdoc.Documented(page, "Manager")) {
		t.Error(p)
	}
}
