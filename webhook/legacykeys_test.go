package webhook_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/test/envtestutil"
	"github.com/idemcp/idemcp/webhook"
)

// TestNewPodsStartWithTheLegacyKeys: a pod injected while a pod of an
// idemcp without key spaces runs under its policy starts with
// IDEMCP_LEGACY_KEYS=writers; one injected after that pod is gone starts
// with the deadline of the policy's status; a policy that never had such
// a pod gives none, so its sidecars never look under another key.
func TestNewPodsStartWithTheLegacyKeys(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", managedSpec())
	n := 0
	legacyEnv := func() string {
		t.Helper()
		n++
		pod := mcpPod(ns, "new-"+strconv.Itoa(n), optIn)
		if err := k8s.Create(ctx, pod); err != nil {
			t.Fatal(err)
		}
		c, _ := sidecarOf(t, pod)
		if ev := envValue(c, webhook.EnvLegacyKeys); ev != nil {
			return ev.Value
		}
		return ""
	}
	if v := legacyEnv(); v != "" {
		t.Fatalf("a policy that never had a pod without key spaces: %s=%q, want none", webhook.EnvLegacyKeys, v)
	}

	// Created past the webhook (no idemcp.io/inject), as before the upgrade.
	old := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "old", Namespace: ns, Labels: map[string]string{v1alpha1.LabelPolicy: "payments"},
			Annotations: map[string]string{v1alpha1.AnnotationStatus: `{"container":"idemcp-proxy","policy":"payments"}`}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}, {Name: "idemcp-proxy", Image: "idemcp:old"}}},
	}
	if err := k8s.Create(ctx, old); err != nil {
		t.Fatal(err)
	}
	// The webhook reads the policy from its cache: the status reaches it
	// a moment after it is written.
	envtestutil.Eventually(t, "a pod injected beside the old one starts with writers", func() error {
		if v := legacyEnv(); v != "writers" {
			return fmt.Errorf("%s=%q, want writers", webhook.EnvLegacyKeys, v)
		}
		return nil
	})

	if err := k8s.Delete(ctx, old); err != nil {
		t.Fatal(err)
	}
	var p v1alpha1.IdempotencyPolicy
	envtestutil.Eventually(t, "status.legacyKeys.until", func() error {
		if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "payments"}, &p); err != nil {
			return err
		}
		if l := p.Status.LegacyKeys; l == nil || l.Until == nil {
			return fmt.Errorf("status.legacyKeys = %+v", l)
		}
		return nil
	})
	want := p.Status.LegacyKeys.Until.UTC().Format(time.RFC3339)
	envtestutil.Eventually(t, "a pod injected after the old one is gone starts with the deadline", func() error {
		if v := legacyEnv(); v != want {
			return fmt.Errorf("%s=%q, want %q", webhook.EnvLegacyKeys, v, want)
		}
		return nil
	})
}
