package webhook_test

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/test/envtestutil"
)

// TestSealKeyReachesTheSidecar: the controller makes the policy's seal
// Secret, and the webhook points the sidecar's IDEMCP_SEAL_KEYS at it, so
// the kubelet hands the sidecar a keyring it can use.
func TestSealKeyReachesTheSidecar(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", managedSpec())
	var secret corev1.Secret
	envtestutil.Eventually(t, "the seal Secret", func() error {
		return k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "payments-seal"}, &secret)
	})
	pod := mcpPod(ns, "mcp-0", optIn)
	if err := k8s.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	c, _ := sidecarOf(t, pod)
	env := envValue(c, "IDEMCP_SEAL_KEYS")
	if env == nil || env.Value != "" || env.ValueFrom == nil || env.ValueFrom.SecretKeyRef == nil {
		t.Fatalf("IDEMCP_SEAL_KEYS = %+v, want a secretKeyRef", env)
	}
	ref := env.ValueFrom.SecretKeyRef
	if ref.Name != secret.Name {
		t.Fatalf("IDEMCP_SEAL_KEYS refers to Secret %s, the controller made %s", ref.Name, secret.Name)
	}
	ring, err := store.ParseKeyring(string(secret.Data[ref.Key]))
	if err != nil {
		t.Fatalf("the keyring at %s/%s does not parse: %v", ref.Name, ref.Key, err)
	}
	if len(ring.IDs()) != 1 {
		t.Errorf("a new policy's keyring has %d keys, want 1", len(ring.IDs()))
	}
	if secret.Labels[v1alpha1.LabelCredentials] != "true" {
		t.Errorf("seal Secret labels %v lack %s", secret.Labels, v1alpha1.LabelCredentials)
	}
	for _, e := range c.Env {
		if e.Value != "" && e.Value == string(secret.Data[ref.Key]) {
			t.Errorf("env %s carries the keys in the pod spec", e.Name)
		}
	}

	// A memory policy stores nothing outside the sidecar: no key.
	mem := namespace(t, true)
	createPolicy(t, mem, "payments", v1alpha1.IdempotencyPolicySpec{})
	mpod := mcpPod(mem, "mcp-0", optIn)
	if err := k8s.Create(ctx, mpod); err != nil {
		t.Fatal(err)
	}
	if c, _ := sidecarOf(t, mpod); envValue(c, "IDEMCP_SEAL_KEYS") != nil {
		t.Errorf("a Memory policy's sidecar got IDEMCP_SEAL_KEYS")
	}
}
