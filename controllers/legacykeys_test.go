package controllers_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// legacyPod makes a pod as an idemcp without key spaces injected it: the
// webhook's status mark names no key space.
func legacyPod(t *testing.T, ns, name, policy string) *corev1.Pod {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
			Labels:      map[string]string{v1alpha1.LabelPolicy: policy},
			Annotations: map[string]string{v1alpha1.AnnotationStatus: `{"container":"idemcp-proxy","policy":"` + policy + `"}`}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}, {Name: "idemcp-proxy", Image: "idemcp:old"}}},
	}
	if err := k8s.Create(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	return pod
}

// keySpacedPod makes a pod as this idemcp injects it: its status mark
// names its key space.
func keySpacedPod(t *testing.T, ns, name, policy string, env ...corev1.EnvVar) *corev1.Pod {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
			Labels:      map[string]string{v1alpha1.LabelPolicy: policy},
			Annotations: map[string]string{v1alpha1.AnnotationStatus: `{"container":"idemcp-proxy","policy":"` + policy + `","keySpace":"Pod/` + name + `"}`}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}, {Name: "idemcp-proxy", Image: "idemcp:new", Env: env}}},
	}
	if err := k8s.Create(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	return pod
}

// TestLegacyWritersThenDeadline: a policy whose pods all have key spaces
// has no legacy keys; a pod injected by an idemcp without key spaces (its
// status annotation names none) puts the policy's status in legacy mode,
// with the pods of this idemcp beside it; once that pod is deleted the
// status holds the deadline of the legacy lookups (ttl + leaseDuration
// from then, and a margin); a pod without key space again puts it back.
func TestLegacyWritersThenDeadline(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	pol := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "payments", Namespace: ns},
		Spec: v1alpha1.IdempotencyPolicySpec{TTL: &metav1.Duration{Duration: 2 * time.Hour}, LeaseDuration: &metav1.Duration{Duration: 30 * time.Second}}}
	if err := k8s.Create(ctx, pol); err != nil {
		t.Fatal(err)
	}
	keySpacedPod(t, ns, "new-1", "payments")
	eventually(t, "the policy reconciled with its key-spaced pod", func() error {
		p := getPolicy(t, ns, "payments")
		if p.Status.ObservedGeneration == 0 {
			return fmt.Errorf("no status yet")
		}
		if l := p.Status.LegacyKeys; l != nil {
			return fmt.Errorf("status.legacyKeys = %+v with key-spaced pods only, want none", l)
		}
		return nil
	})

	old := legacyPod(t, ns, "old", "payments")
	keySpacedPod(t, ns, "new-2", "payments")
	eventually(t, "status.legacyKeys.writers 1", func() error {
		if l := getPolicy(t, ns, "payments").Status.LegacyKeys; l == nil || l.Writers != 1 || l.Until != nil {
			return fmt.Errorf("status.legacyKeys = %+v", l)
		}
		return nil
	})

	deleted := time.Now()
	if err := k8s.Delete(ctx, old); err != nil {
		t.Fatal(err)
	}
	var until time.Time
	eventually(t, "status.legacyKeys.until", func() error {
		l := getPolicy(t, ns, "payments").Status.LegacyKeys
		if l == nil || l.Writers != 0 || l.Until == nil {
			return fmt.Errorf("status.legacyKeys = %+v", l)
		}
		until = l.Until.Time
		return nil
	})
	// ttl 2h + lease 30s, from the delete, and a minute's margin for clocks.
	if lo, hi := deleted.Add(2*time.Hour+30*time.Second).Truncate(time.Second), time.Now().Add(2*time.Hour+30*time.Second+time.Minute+2*time.Second); until.Before(lo) || until.After(hi) {
		t.Errorf("status.legacyKeys.until = %v, want between %v and %v", until, lo, hi)
	}
	// Later reconciles keep the deadline where it is.
	keySpacedPod(t, ns, "new-3", "payments")
	eventually(t, "the deadline kept through a reconcile", func() error {
		p := getPolicy(t, ns, "payments")
		if l := p.Status.LegacyKeys; l == nil || l.Until == nil || !l.Until.Time.Equal(until) {
			return fmt.Errorf("status.legacyKeys = %+v, want until %v", l, until)
		}
		return nil
	})

	// A pod without a key space again (an old manager's webhook during
	// its rollout): its keys are the legacy ones, so sidecars take them
	// again.
	legacyPod(t, ns, "old-again", "payments")
	eventually(t, "a pod without key space again: writers", func() error {
		if l := getPolicy(t, ns, "payments").Status.LegacyKeys; l == nil || l.Writers != 1 {
			return fmt.Errorf("status.legacyKeys = %+v", l)
		}
		return nil
	})
}

// TestLegacyDeadlineFollowsStaleWriters: a pod injected while legacy
// writers ran carries IDEMCP_LEGACY_KEYS=writers for its life, and its
// sidecar, restarted with the manager away, derives keys without its key
// space again; while such a pod lives the deadline stays a retention
// ahead, and a ttl lowered meanwhile never moves it earlier. A pod with the
// label and a status mark but no sidecar container is no writer.
func TestLegacyDeadlineFollowsStaleWriters(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	pol := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "payments", Namespace: ns},
		Spec: v1alpha1.IdempotencyPolicySpec{TTL: &metav1.Duration{Duration: 2 * time.Hour}}}
	if err := k8s.Create(ctx, pol); err != nil {
		t.Fatal(err)
	}
	fake := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "copied", Namespace: ns,
		Labels: map[string]string{v1alpha1.LabelPolicy: "payments"}, Annotations: map[string]string{v1alpha1.AnnotationStatus: `{}`}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "busybox", Image: "busybox"}}}}
	if err := k8s.Create(ctx, fake); err != nil {
		t.Fatal(err)
	}
	old := legacyPod(t, ns, "old", "payments")
	eventually(t, "one writer (the copied pod is none)", func() error {
		if l := getPolicy(t, ns, "payments").Status.LegacyKeys; l == nil || l.Writers != 1 {
			return fmt.Errorf("status.legacyKeys = %+v, want 1 writer", l)
		}
		return nil
	})
	stale := keySpacedPod(t, ns, "stale", "payments", corev1.EnvVar{Name: "IDEMCP_LEGACY_KEYS", Value: "writers"})
	if err := k8s.Delete(ctx, old); err != nil {
		t.Fatal(err)
	}
	var first time.Time
	eventually(t, "a deadline", func() error {
		l := getPolicy(t, ns, "payments").Status.LegacyKeys
		if l == nil || l.Writers != 0 || l.Until == nil {
			return fmt.Errorf("status.legacyKeys = %+v", l)
		}
		first = l.Until.Time
		return nil
	})
	// The ttl lowered: the deadline does not move earlier.
	// The controller writes the policy's status meanwhile: the update
	// retries on a conflict (CI saw one).
	updatePolicy(t, ns, "payments", func(p *v1alpha1.IdempotencyPolicy) {
		p.Spec.TTL = &metav1.Duration{Duration: time.Minute}
	})
	eventually(t, "the lowered ttl reconciled", func() error {
		p := getPolicy(t, ns, "payments")
		if p.Status.ObservedGeneration != p.Generation {
			return fmt.Errorf("generation %d observed %d", p.Generation, p.Status.ObservedGeneration)
		}
		if l := p.Status.LegacyKeys; l == nil || l.Until == nil || l.Until.Before(&metav1.Time{Time: first}) {
			return fmt.Errorf("status.legacyKeys = %+v, want until at least %v", l, first)
		}
		return nil
	})
	// The stale pod gone: the deadline runs from then (a minute's ttl now,
	// but never before the one set).
	if err := k8s.Delete(ctx, stale); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the deadline kept after the stale pod went", func() error {
		if l := getPolicy(t, ns, "payments").Status.LegacyKeys; l == nil || l.Until == nil || l.Until.Time.Before(first) {
			return fmt.Errorf("status.legacyKeys = %+v, want until at least %v", l, first)
		}
		return nil
	})
}
