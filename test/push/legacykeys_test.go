package push

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/test/poll"
)

// statusPod creates a pod of the policy as a webhook left it, its status
// mark naming keySpace ("": an idemcp before key spaces), with a token.
func statusPod(t *testing.T, ns, name, policyName, keySpace string) (*corev1.Pod, string) {
	t.Helper()
	status := `{"container":"idemcp-proxy","policy":"` + policyName + `"}`
	if keySpace != "" {
		status = `{"container":"idemcp-proxy","policy":"` + policyName + `","keySpace":"` + keySpace + `"}`
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{v1alpha1.LabelPolicy: policyName},
			Annotations: map[string]string{v1alpha1.AnnotationStatus: status}},
		Spec: corev1.PodSpec{ServiceAccountName: "mcp", Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}, {Name: "idemcp-proxy", Image: "idemcp:1"}}},
	}
	if err := k8s.Create(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	return pod, podToken(t, pod, policywire.TokenAudience)
}

// TestLegacyKeysArePushed: a connected sidecar learns that a pod without
// a key space runs under its policy, and, once it is deleted, the
// deadline of the legacy lookups the controller put in the status, with
// no change of the spec (the same version sent again).
func TestLegacyKeysArePushed(t *testing.T) {
	const ns, name = "push-legacy", "payments"
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t))
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	start := compiled(t, ns, name, spec)
	pod, token := statusPod(t, ns, "api-new", name, "Deployment/api")
	s := startSidecarClient(t, "https://"+mgr.addr, ns, name, pod.Name, token, start)
	waitStatus(t, ns, name, 20*time.Second, synced(1, start.Hash))
	if l := s.engine.LegacyKeys(); l.Writers || !l.Until.IsZero() {
		t.Fatalf("a policy with key-spaced pods only: the sidecar has legacy keys %+v", l)
	}

	old, _ := statusPod(t, ns, "api-old", name, "")
	waitStatus(t, ns, name, 20*time.Second, func(p *v1alpha1.IdempotencyPolicy) error {
		if l := p.Status.LegacyKeys; l == nil || l.Writers != 1 {
			return fmt.Errorf("status.legacyKeys = %+v, want 1 writer", p.Status.LegacyKeys)
		}
		return nil
	})
	poll.Within(t, 10*time.Second, "the sidecar to learn of the writer", func() error {
		if !s.engine.LegacyKeys().Writers {
			return fmt.Errorf("the sidecar has legacy keys %+v, want writers", s.engine.LegacyKeys())
		}
		return nil
	})

	if err := k8s.Delete(context.Background(), old, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	p := waitStatus(t, ns, name, 20*time.Second, func(p *v1alpha1.IdempotencyPolicy) error {
		if l := p.Status.LegacyKeys; l == nil || l.Writers != 0 || l.Until == nil {
			return fmt.Errorf("status.legacyKeys = %+v, want a deadline", p.Status.LegacyKeys)
		}
		return nil
	})
	want := p.Status.LegacyKeys.Until.Time
	poll.Within(t, 10*time.Second, "the sidecar to learn the deadline", func() error {
		if l := s.engine.LegacyKeys(); l.Writers || !l.Until.Equal(want) {
			return fmt.Errorf("the sidecar has legacy keys %+v, want until %v", l, want)
		}
		return nil
	})
	if got := s.engine.Policy().Hash; got != start.Hash {
		t.Fatalf("the sidecar enforces %s, want %s: the spec did not change", got, start.Hash)
	}
}
