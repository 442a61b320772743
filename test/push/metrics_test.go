package push

import (
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/idemcp/idemcp/test/poll"

	dto "github.com/prometheus/client_model/go"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestSyncMetrics: the manager serves what status.sidecars says as
// idemcp_policy_sidecars, and how long each push took to be acknowledged
// as idemcp_policy_sync_duration_seconds, for the dashboard and the
// sidecars-out-of-sync alert.
func TestSyncMetrics(t *testing.T) {
	const ns, name = "push-metrics", "payments"
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t))
	endpoint := "https://" + mgr.addr
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	start := compiled(t, ns, name, spec)

	pod0, token0 := createPod(t, ns, "mcp-0", name)
	_, _ = createPod(t, ns, "mcp-1", name)
	first := startSidecarClient(t, endpoint, ns, name, pod0.Name, token0, start)
	waitSidecarsGauge(t, ns, name, map[string]float64{"injected": 2, "connected": 1, "synced": 1})

	before := syncCount(t)
	changed := time.Now()
	hash := updatePolicy(t, ns, name, func(s *v1alpha1.IdempotencyPolicySpec) {
		s.Tools = append(s.Tools, v1alpha1.ToolRule{Name: "refund", Mode: v1alpha1.ModePassthrough})
	})
	waitApplied(t, []*sidecarClient{first}, hash, changed, 5*time.Second)
	waitSidecarsGauge(t, ns, name, map[string]float64{"injected": 2, "connected": 1, "synced": 1})
	poll.Within(t, 5*time.Second, "idemcp_policy_sync_duration_seconds to count the acknowledgement of "+hash, func() error {
		if n := syncCount(t); n <= before {
			return fmt.Errorf("it counted %d acknowledgements, as before the sidecar applied %s", n, hash)
		}
		return nil
	})
}

// waitSidecarsGauge waits until idemcp_policy_sidecars of the policy has
// exactly the values want, by state.
func waitSidecarsGauge(t *testing.T, ns, name string, want map[string]float64) {
	t.Helper()
	poll.Within(t, 10*time.Second, fmt.Sprintf("idemcp_policy_sidecars{namespace=%q,policy=%q} to be %v", ns, name, want), func() error {
		got := map[string]float64{}
		for _, m := range family(t, "idemcp_policy_sidecars") {
			l := labels(m)
			if l["namespace"] == ns && l["policy"] == name {
				got[l["state"]] = m.GetGauge().GetValue()
			}
		}
		if !maps.Equal(got, want) {
			return fmt.Errorf("it is %v", got)
		}
		return nil
	})
}

func syncCount(t *testing.T) uint64 {
	var n uint64
	for _, m := range family(t, "idemcp_policy_sync_duration_seconds") {
		n += m.GetHistogram().GetSampleCount()
	}
	return n
}

// family gathers one metric family from the registry the manager serves
// on /metrics.
func family(t *testing.T, name string) []*dto.Metric {
	t.Helper()
	mfs, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()
		}
	}
	return nil
}

func labels(m *dto.Metric) map[string]string {
	l := map[string]string{}
	for _, p := range m.GetLabel() {
		l[p.GetName()] = p.GetValue()
	}
	return l
}
