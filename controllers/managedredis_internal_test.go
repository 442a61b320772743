package controllers

import (
	"context"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestManagedRedisKeepsAnImageEditedMidReconcile: the StatefulSet's
// image, changed (by hand, or by an earlier manager) between the
// reconcile's first read of it and its update, is kept: the update does
// not put back the image of the first read. CI saw a reconcile in flight
// revert such an edit (TestManagedRedisKeepsItsImage).
func TestManagedRedisKeepsAnImageEditedMidReconcile(t *testing.T) {
	ctx := context.Background()
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	p := &v1alpha1.IdempotencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "older", Namespace: "ns", UID: "policy-uid"},
		Spec: v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{
			Type:  v1alpha1.StoreRedis,
			Redis: &v1alpha1.RedisStoreSpec{Managed: &v1alpha1.ManagedRedis{}},
		}},
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ns", UID: "ns-uid"}}
	base := fake.NewClientBuilder().WithScheme(scheme).WithObjects(p, ns).Build()
	r := &IdempotencyPolicyReconciler{Client: base, APIReader: base, Scheme: scheme, Recorder: events.NewFakeRecorder(100)}

	// The first reconcile creates the StatefulSet with the default image.
	if _, _, err := r.reconcileManagedRedis(ctx, p, &policyPods{}); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: "ns", Name: RedisName(p.Name)}
	var sts appsv1.StatefulSet
	if err := base.Get(ctx, key, &sts); err != nil {
		t.Fatal(err)
	}
	if got := containerImage(sts.Spec.Template.Spec.Containers); got != DefaultRedisImage {
		t.Fatalf("the first image %s, want %s", got, DefaultRedisImage)
	}

	// The next reconcile's first read of the StatefulSet sees the default;
	// the edit to 7.2 lands right after it.
	const edited = "redis:7.2-alpine"
	reads := 0
	r.Client = interceptor.NewClient(base, interceptor.Funcs{
		Get: func(ctx context.Context, c client.WithWatch, k client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			if err := c.Get(ctx, k, obj, opts...); err != nil {
				return err
			}
			if _, ok := obj.(*appsv1.StatefulSet); ok && k == key {
				if reads++; reads == 1 {
					var live appsv1.StatefulSet
					if err := c.Get(ctx, k, &live); err != nil {
						return err
					}
					live.Spec.Template.Spec.Containers[0].Image = edited
					return c.Update(ctx, &live)
				}
			}
			return nil
		},
	})
	st, _, err := r.reconcileManagedRedis(ctx, p, &policyPods{})
	if err != nil {
		t.Fatal(err)
	}
	if reads < 2 {
		t.Fatalf("the StatefulSet was read %d times in a reconcile; the test needs the read before the update", reads)
	}
	if err := base.Get(ctx, key, &sts); err != nil {
		t.Fatal(err)
	}
	if got := containerImage(sts.Spec.Template.Spec.Containers); got != edited {
		t.Errorf("the StatefulSet runs %s after the reconcile, want the edited %s kept", got, edited)
	}
	if st.image != edited {
		t.Errorf("the status would say %s, want %s", st.image, edited)
	}
}
