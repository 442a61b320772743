package policystream

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// States of idemcp_policy_sidecars: the counts of status.sidecars.
const (
	stateInjected  = "injected"
	stateConnected = "connected"
	stateSynced    = "synced"
)

var (
	sidecarsGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "idemcp_policy_sidecars",
		Help: "Sidecars of each policy, as its status.sidecars counts them: injected (running pods that use it), connected (holding a policy stream), synced (applied its current version). Served by the leader only.",
	}, []string{"namespace", "policy", "state"})
	syncDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "idemcp_policy_sync_duration_seconds",
		Help:    "Time from sending a policy version to a sidecar until the sidecar acknowledged applying it.",
		Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
	})
)

func init() { metrics.Registry.MustRegister(sidecarsGauge, syncDuration) }

func setSidecarsGauge(key types.NamespacedName, injected, connected, synced int32) {
	sidecarsGauge.WithLabelValues(key.Namespace, key.Name, stateInjected).Set(float64(injected))
	sidecarsGauge.WithLabelValues(key.Namespace, key.Name, stateConnected).Set(float64(connected))
	sidecarsGauge.WithLabelValues(key.Namespace, key.Name, stateSynced).Set(float64(synced))
}

func forgetSidecarsGauge(key types.NamespacedName) {
	sidecarsGauge.DeletePartialMatch(prometheus.Labels{"namespace": key.Namespace, "policy": key.Name})
}

// observeAck records a report: the first one that names the version last
// sent to c ends that version's sync. Called with Server.mu held.
func (c *stream) observeAck(version string, now time.Time) {
	if c.pendingVersion == "" || version != c.pendingVersion {
		return
	}
	syncDuration.Observe(now.Sub(c.pendingSince).Seconds())
	c.pendingVersion = ""
}
