package storeopen

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// NewDurationMetrics registers idemcp_store_duration_seconds with reg and
// returns what store.Timed reports to.
func NewDurationMetrics(reg prometheus.Registerer) func(op string, d time.Duration) {
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "idemcp_store_duration_seconds",
		Help:    "Store round trips by operation (reserve, renew, complete, release, ping), failed ones included, sealing included.",
		Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
	}, []string{"op"})
	reg.MustRegister(h)
	return func(op string, d time.Duration) { h.WithLabelValues(op).Observe(d.Seconds()) }
}
