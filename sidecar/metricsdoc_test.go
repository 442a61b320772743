package sidecar

import (
	"os"
	"testing"

	"github.com/idemcp/idemcp/internal/metricsdoc"
	"github.com/idemcp/idemcp/internal/storeopen"
)

// TestMetricsDoc checks that docs/metrics.md lists every metric the
// sidecar serves on /metrics, and nothing it does not.
func TestMetricsDoc(t *testing.T) {
	s, err := New(Options{Upstream: "http://127.0.0.1:1", LogLevel: "info", Store: storeopen.Options{Kind: "memory"}})
	if err != nil {
		t.Fatal(err)
	}
	registered, err := metricsdoc.Names(s.registry)
	if err != nil {
		t.Fatal(err)
	}
	page, err := os.ReadFile("../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range metricsdoc.Compare(registered, metricsdoc.Documented(page, "Sidecar")) {
		t.Error(p)
	}
}
