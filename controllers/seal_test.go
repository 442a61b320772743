package controllers_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/controllers"
)

func sealKeys(t *testing.T, ns, policy string) ([]string, *corev1.Secret) {
	t.Helper()
	var s corev1.Secret
	if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: controllers.SealName(policy)}, &s); err != nil {
		t.Fatal(err)
	}
	return strings.Fields(string(s.Data[controllers.SealKeysKey])), &s
}

// TestSealKeyRotation: a rotation never leaves a running sidecar with a
// result it cannot open: the new key is added for reading, becomes the
// sealing key once every pod holds it, and the old one goes once no pod
// seals with it and the TTL has passed.
func TestSealKeyRotation(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	p := managedPolicy(ns, "payments")
	p.Spec.TTL = &metav1.Duration{Duration: 2 * time.Second}
	p.Spec.RetryWindow = &metav1.Duration{Duration: time.Second} // at most the ttl
	p.Spec.LeaseDuration = &metav1.Duration{Duration: time.Second}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	name := client.ObjectKey{Namespace: ns, Name: controllers.SealName("payments")}
	var secret corev1.Secret
	eventually(t, "the seal Secret", func() error { return k8s.Get(ctx, name, &secret) })
	pol := getPolicy(t, ns, "payments")
	if ref := metav1.GetControllerOf(&secret); ref == nil || ref.UID != pol.UID {
		t.Errorf("the seal Secret is not owned by the policy: %v", secret.OwnerReferences)
	}
	if !slices.Contains(secret.Finalizers, v1alpha1.FinalizerInUse) {
		t.Errorf("the seal Secret has no finalizer %s: deleting it would lose every stored result", v1alpha1.FinalizerInUse)
	}
	first, _ := sealKeys(t, ns, "payments")
	if len(first) != 1 {
		t.Fatalf("keys = %d, want 1", len(first))
	}

	// A pod that read the Secret before the rotation.
	time.Sleep(1100 * time.Millisecond) // creation times have whole seconds
	old := injectedPod(t, ns, "old", "payments", nil, true)
	time.Sleep(1100 * time.Millisecond)

	before := secret.DeepCopy()
	if secret.Annotations == nil {
		secret.Annotations = map[string]string{}
	}
	secret.Annotations[controllers.AnnotationRotateSealKey] = "now"
	if err := k8s.Patch(ctx, &secret, client.MergeFrom(before)); err != nil {
		t.Fatal(err)
	}
	var staged []string
	eventually(t, "the new key added for opening", func() error {
		staged, _ = sealKeys(t, ns, "payments")
		if len(staged) != 2 || staged[0] != first[0] {
			return fmt.Errorf("keys %d, first unchanged %v", len(staged), len(staged) > 0 && staged[0] == first[0])
		}
		return nil
	})
	// The old pod cannot open results sealed with the new key: it stays
	// the opening key only.
	time.Sleep(2 * time.Second)
	if keys, s := sealKeys(t, ns, "payments"); keys[0] != first[0] || s.Annotations[controllers.AnnotationRotateSealKey] != "" {
		t.Fatalf("with a pod from before the rotation running, the new key seals (or the request stays): %v", s.Annotations)
	}

	// The pod restarts (envtest has no kubelet: it is deleted).
	if err := k8s.Delete(ctx, old, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the new key sealing, then the old one dropped after the TTL", func() error {
		keys, _ := sealKeys(t, ns, "payments")
		if len(keys) != 1 || keys[0] != staged[1] {
			return fmt.Errorf("%d keys, the new one first: %v", len(keys), len(keys) > 0 && keys[0] == staged[1])
		}
		return nil
	})
	assertEvent(t, ns, "payments", "SealKeyRotation", "now seals")
	assertEvent(t, ns, "payments", "SealKeyRotation", "dropped the previous seal keys")
}

// TestSealKeyKeptForTheLongestTTLItSealedUnder: the previous key is kept
// for the longest TTL the policy had while the key sealed, not the TTL at
// the step where it stops sealing: records sealed under 72h live 72h
// however the TTL changes meanwhile. Before, the key was kept for the TTL
// of that step (1h here), and a record with 70h left no longer opened, so
// its call ran again.
func TestSealKeyKeptForTheLongestTTLItSealedUnder(t *testing.T) {
	for _, tc := range []struct {
		name string
		// ttls: the policy's TTL when it is created, then during the
		// rotation while the old key still seals.
		ttls []time.Duration
	}{
		{"shortened", []time.Duration{72 * time.Hour, time.Hour}},
		{"lengthened, then shortened", []time.Duration{time.Hour, 72 * time.Hour, time.Hour}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			ns := newNamespace(t)
			p := managedPolicy(ns, "payments")
			p.Spec.TTL = &metav1.Duration{Duration: tc.ttls[0]}
			p.Spec.LeaseDuration = &metav1.Duration{Duration: time.Second}
			if err := k8s.Create(ctx, p); err != nil {
				t.Fatal(err)
			}
			name := client.ObjectKey{Namespace: ns, Name: controllers.SealName("payments")}
			var secret corev1.Secret
			eventually(t, "the seal Secret", func() error { return k8s.Get(ctx, name, &secret) })

			// A pod from before the rotation holds it at its first step,
			// where the old key still seals.
			time.Sleep(1100 * time.Millisecond) // creation times have whole seconds
			old := injectedPod(t, ns, "old", "payments", nil, true)
			time.Sleep(1100 * time.Millisecond)
			before := secret.DeepCopy()
			if secret.Annotations == nil {
				secret.Annotations = map[string]string{}
			}
			secret.Annotations[controllers.AnnotationRotateSealKey] = "now"
			if err := k8s.Patch(ctx, &secret, client.MergeFrom(before)); err != nil {
				t.Fatal(err)
			}
			eventually(t, "the new key added for opening", func() error {
				if keys, _ := sealKeys(t, ns, "payments"); len(keys) != 2 {
					return fmt.Errorf("%d keys", len(keys))
				}
				return nil
			})

			for _, ttl := range tc.ttls[1:] {
				pol := getPolicy(t, ns, "payments")
				patch := client.MergeFrom(pol.DeepCopy())
				pol.Spec.TTL = &metav1.Duration{Duration: ttl}
				if err := k8s.Patch(ctx, pol, patch); err != nil {
					t.Fatal(err)
				}
				// The status is written after the seal key's step: a
				// status of this generation saw the TTL.
				eventually(t, fmt.Sprintf("the policy with TTL %v reconciled", ttl), func() error {
					if p := getPolicy(t, ns, "payments"); p.Status.ObservedGeneration != pol.Generation {
						return fmt.Errorf("observedGeneration %d, want %d", p.Status.ObservedGeneration, pol.Generation)
					}
					return nil
				})
			}

			if err := k8s.Delete(ctx, old, client.GracePeriodSeconds(0)); err != nil {
				t.Fatal(err)
			}
			var retireAfter time.Time
			eventually(t, "the old key retiring", func() error {
				_, s := sealKeys(t, ns, "payments")
				if s.Annotations["idemcp.io/seal-rotation-stage"] != "retiring" {
					return fmt.Errorf("stage %q", s.Annotations["idemcp.io/seal-rotation-stage"])
				}
				var err error
				retireAfter, err = time.Parse(time.RFC3339Nano, s.Annotations["idemcp.io/seal-retire-after"])
				return err
			})
			// 72h, plus the lease and the grace for clock skew (shortened in
			// this suite, export_test.go).
			if left := time.Until(retireAfter); left < 72*time.Hour || left > 72*time.Hour+10*time.Minute {
				t.Errorf("the old key goes in %v, want 72h and a few minutes: it sealed records under a TTL of 72h", left.Round(time.Minute))
			}
			if keys, _ := sealKeys(t, ns, "payments"); len(keys) != 2 {
				t.Errorf("%d keys while the old one retires, want 2", len(keys))
			}
		})
	}
}

// TestSealSecretWithoutKeysGetsANewKey: a seal Secret whose keyring was
// emptied (or lost its key) gets a new key, with a Warning Event that
// says what that costs: results sealed under the lost key run again once,
// and running pods hold the old keyring until they restart. Deleting the
// Secret, as the refusal's advice said before, only left it Terminating on
// its finalizer, keyless, and every new pod refused.
func TestSealSecretWithoutKeysGetsANewKey(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "payments", Namespace: ns},
		Spec: v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{
			Addresses: []string{"redis.shared.svc:6379"}}}}}}); err != nil {
		t.Fatal(err)
	}
	name := client.ObjectKey{Namespace: ns, Name: controllers.SealName("payments")}
	eventually(t, "the seal Secret", func() error { return k8s.Get(ctx, name, &corev1.Secret{}) })
	lost, secret := sealKeys(t, ns, "payments")
	injectedPod(t, ns, "mcp-0", "payments", nil, true)

	before := secret.DeepCopy()
	delete(secret.Data, controllers.SealKeysKey)
	if err := k8s.Patch(ctx, secret, client.MergeFrom(before)); err != nil {
		t.Fatal(err)
	}
	// What the refusal's advice said to do before.
	if err := k8s.Delete(ctx, secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a new seal key", func() error {
		keys, _ := sealKeys(t, ns, "payments")
		if len(keys) != 1 || keys[0] == lost[0] {
			return fmt.Errorf("%d keys, the lost one %v", len(keys), slices.Contains(keys, lost[0]))
		}
		return nil
	})
	assertEvent(t, ns, "payments", controllers.ReasonSealKeysRepaired, "had no seal keys under \"keys\"; made a new key")
	assertEvent(t, ns, "payments", controllers.ReasonSealKeysRepaired, "results stored under the lost key cannot be opened, so a retry of such a call runs again, once; the pods of this policy that run now hold the old keyring until they restart, and neither side opens the other's results: restart them (kubectl rollout restart): 1 pod (mcp-0)")
}
