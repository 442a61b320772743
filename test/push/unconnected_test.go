package push

import (
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestUnconnectedPodIsNotSynced: an injected pod whose sidecar holds no
// stream may enforce any older policy, so SidecarsSynced is False
// (SidecarsNotConnected, naming it) and so is Ready, until it connects and
// acknowledges. Before, one pod without a stream read True,
// NoSidecarsConnected, and Ready said "enforced by every sidecar".
func TestUnconnectedPodIsNotSynced(t *testing.T) {
	const ns, name = "push-unconnected", "payments"
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t))
	endpoint := "https://" + mgr.addr
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	start := compiled(t, ns, name, spec)
	a, tokenA := createPod(t, ns, "mcp-a", name)
	createPod(t, ns, "mcp-b", name)

	notConnected := func(synced int) func(p *v1alpha1.IdempotencyPolicy) error {
		return func(p *v1alpha1.IdempotencyPolicy) error {
			c := condition(p, v1alpha1.ConditionSidecarsSynced)
			if c == nil || c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonSidecarsNotConnected {
				return fmt.Errorf("SidecarsSynced = %+v, want False/%s", c, v1alpha1.ReasonSidecarsNotConnected)
			}
			want := "1 injected pod (mcp-b) hold no policy stream"
			if synced == 0 {
				want = "2 injected pods (mcp-a, mcp-b) hold no policy stream"
			}
			if !strings.Contains(c.Message, want) {
				return fmt.Errorf("message %q lacks %q", c.Message, want)
			}
			if r := condition(p, v1alpha1.ConditionReady); r == nil || r.Status != metav1.ConditionFalse || r.Reason != v1alpha1.ReasonSidecarsNotSynced {
				return fmt.Errorf("Ready = %+v, want False/%s", r, v1alpha1.ReasonSidecarsNotSynced)
			}
			if s := p.Status.Sidecars; s == nil || s.Ratio != fmt.Sprintf("%d/2", synced) {
				return fmt.Errorf("status.sidecars = %+v, want %d/2", s, synced)
			}
			return nil
		}
	}
	waitStatus(t, ns, name, 20*time.Second, notConnected(0))
	startSidecarClient(t, endpoint, ns, name, a.Name, tokenA, start)
	waitStatus(t, ns, name, 20*time.Second, notConnected(1))
}
