package controllers_test

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

func conditionMessage(p *v1alpha1.IdempotencyPolicy, typ string) string {
	if c := meta.FindStatusCondition(p.Status.Conditions, typ); c != nil {
		return c.Message
	}
	return ""
}

// TestStreamOffSaysSyncIsNotObserved: this suite's manager runs without
// the policy stream, as --policy-stream-bind-address=0 does. With an
// injected pod, nobody hears what its sidecar applied: SidecarsSynced and
// Ready are Unknown (SyncNotObserved), the message says why and names the
// pods started with an older policy, and kubectl get idpol shows "?/1".
// Before, Ready was True, "enforced by every sidecar".
func TestStreamOffSaysSyncIsNotObserved(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "quiet", Namespace: ns}}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "Ready with no pod", func() error {
		p := getPolicy(t, ns, "quiet")
		return condition(p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonReady)
	})
	injectedPod(t, ns, "mcp-0", "quiet", nil, true)
	eventually(t, "SyncNotObserved", func() error {
		p := getPolicy(t, ns, "quiet")
		if err := condition(p, v1alpha1.ConditionSidecarsSynced, metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved); err != nil {
			return err
		}
		if err := condition(p, v1alpha1.ConditionReady, metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved); err != nil {
			return err
		}
		for _, want := range []string{"--policy-stream-bind-address=0", "0 of 1 injected pods started with policy " + p.Status.PolicyHash, "1 pod (mcp-0) with an older one"} {
			if msg := conditionMessage(p, v1alpha1.ConditionSidecarsSynced); !strings.Contains(msg, want) {
				return fmt.Errorf("message %q lacks %q", msg, want)
			}
		}
		if p.Status.Sidecars == nil || p.Status.Sidecars.Ratio != "?/1" {
			return fmt.Errorf("sidecars %+v, want ratio ?/1", p.Status.Sidecars)
		}
		return nil
	})
	kubectl := filepath.Join(assetsDir, "kubectl")
	kubeconfig := writeKubeconfig(t)
	out, err := exec.Command(kubectl, "--kubeconfig", kubeconfig, "-n", ns, "get", "idpol", "quiet", "-o", "wide").CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl get idpol: %v\n%s", err, out)
	}
	if row := strings.Fields(strings.Split(string(out), "\n")[1]); len(row) < 6 || row[3] != "?/1" || row[5] != "Unknown" || row[6] != v1alpha1.ReasonSyncNotObserved {
		t.Errorf("kubectl get idpol -o wide: want SYNCED ?/1, READY Unknown, REASON SyncNotObserved\n%s", out)
	}
	out, err = exec.Command(kubectl, "--kubeconfig", kubeconfig, "-n", ns, "describe", "idpol", "quiet").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "SyncNotObserved") || !strings.Contains(string(out), "policy-stream-bind-address=0") {
		t.Errorf("kubectl describe idpol (%v) does not say the sync is not observed:\n%s", err, out)
	}
}

// TestStatusStaysWritableWithAThousandWorkloads: pods of 1000 workloads
// under one Redis policy (Argo or Tekton runs) make messages that name
// the first few and say "and N more"; the status stays writable, so a
// spec edit still moves observedGeneration. Before, the message passed
// the API server's 32768 bytes and every status write was refused.
func TestStatusStaysWritableWithAThousandWorkloads(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "runs", Namespace: ns}, Spec: v1alpha1.IdempotencyPolicySpec{
		Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{Addresses: []string{"redis.shared.svc:6379"}}}},
	}}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	const n = 1000
	names := make(chan string)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range 8 {
		wg.Go(func() {
			for name := range names {
				pod := &corev1.Pod{
					ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
						Labels:      map[string]string{v1alpha1.LabelPolicy: "runs"},
						Annotations: map[string]string{v1alpha1.AnnotationStatus: `{"policy":"runs"}`}},
					Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}}},
				}
				if err := k8s.Create(ctx, pod); err != nil {
					errs <- err
				}
			}
		})
	}
	for i := range n {
		names <- fmt.Sprintf("pipeline-run-of-a-rather-long-tekton-pipeline-name-%04d-pod", i)
	}
	close(names)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.DeleteAllOf(ctx, &corev1.Pod{}, client.InNamespace(ns)) })

	eventually(t, "StoreSharedByWorkloads naming the first few", func() error {
		p := getPolicy(t, ns, "runs")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonStoreSharedByWorkloads); err != nil {
			return err
		}
		if msg := storeMessage(p); !strings.Contains(msg, "pods of 1000 workloads") || !strings.Contains(msg, "and 990 more") {
			return fmt.Errorf("message %.300q", msg)
		}
		return nil
	})
	start := time.Now()
	updatePolicy(t, ns, "runs", func(p *v1alpha1.IdempotencyPolicy) { p.Spec.TTL = &metav1.Duration{Duration: time.Hour} })
	eventually(t, "observedGeneration after a spec edit", func() error {
		p := getPolicy(t, ns, "runs")
		if p.Status.ObservedGeneration != p.Generation {
			return fmt.Errorf("observedGeneration %d, generation %d", p.Status.ObservedGeneration, p.Generation)
		}
		for _, c := range p.Status.Conditions {
			if len(c.Message) > 4096 {
				return fmt.Errorf("%s message of %d bytes", c.Type, len(c.Message))
			}
			if c.ObservedGeneration != p.Generation {
				return fmt.Errorf("%s observedGeneration %d, generation %d", c.Type, c.ObservedGeneration, p.Generation)
			}
		}
		if p.Status.Sidecars == nil || p.Status.Sidecars.Injected != n {
			return fmt.Errorf("sidecars %+v", p.Status.Sidecars)
		}
		return nil
	})
	t.Logf("status caught up with the spec edit in %s", time.Since(start))
}
