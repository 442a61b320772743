package controllers_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/controllers"
)

// TestForegroundDeletionKeepsTheStoreWhilePodsUseIt: kubectl delete
// --cascade=foreground (or Argo CD's prune) of a policy whose pods still
// run. The managed objects have a second owner, the namespace, which is
// not being deleted, so the garbage collector deletes none of them; it
// only removes the policy's reference, as this test does in its place
// (envtest runs no garbage collector). The status and an Event say what
// holds the deletion and name the pod; once it is gone, the controller
// deletes the store itself. Before, the garbage collector deleted the
// StatefulSet, Service, PodDisruptionBudget and NetworkPolicy at once.
func TestForegroundDeletionKeepsTheStoreWhilePodsUseIt(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "held")); err != nil {
		t.Fatal(err)
	}
	var nsObj corev1.Namespace
	if err := k8s.Get(ctx, client.ObjectKey{Name: ns}, &nsObj); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: controllers.RedisName("held")}
	objs := []client.Object{&appsv1.StatefulSet{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}, &networkingv1.NetworkPolicy{}}
	eventually(t, "the managed objects, owned by the policy and held by the namespace", func() error {
		for _, o := range objs {
			if err := k8s.Get(ctx, key, o); err != nil {
				return err
			}
			held := false
			for _, ref := range o.GetOwnerReferences() {
				if ref.Kind == "Namespace" && ref.UID == nsObj.UID && (ref.Controller == nil || !*ref.Controller) && (ref.BlockOwnerDeletion == nil || !*ref.BlockOwnerDeletion) {
					held = true
				}
			}
			if !held || metav1.GetControllerOf(o) == nil || metav1.GetControllerOf(o).Kind != "IdempotencyPolicy" {
				return fmt.Errorf("%T owners %+v: want the policy as controller and the namespace as a second owner", o, o.GetOwnerReferences())
			}
		}
		return nil
	})
	pod := injectedPod(t, ns, "server-0", "held", nil, true)
	if err := k8s.Delete(ctx, getPolicy(t, ns, "held"), client.PropagationPolicy(metav1.DeletePropagationForeground)); err != nil {
		t.Fatal(err)
	}
	// What the garbage collector does to a dependent with another owner
	// that is not being deleted.
	p := getPolicy(t, ns, "held")
	for _, o := range objs {
		if err := k8s.Get(ctx, key, o); err != nil {
			t.Fatal(err)
		}
		var refs []metav1.OwnerReference
		for _, ref := range o.GetOwnerReferences() {
			if ref.UID != p.UID {
				refs = append(refs, ref)
			}
		}
		o.SetOwnerReferences(refs)
		if err := k8s.Update(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "PolicyInUse saying the store stays, naming the pod", func() error {
		p := getPolicy(t, ns, "held")
		if err := condition(p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonPolicyInUse); err != nil {
			return err
		}
		for _, want := range []string{"1 pod (server-0) still do", "its store (StatefulSet, Service, PodDisruptionBudget, NetworkPolicy and Secret held-redis, Secret held-seal) stays until then, whatever the deletion's propagation"} {
			if msg := readyMessage(p); !strings.Contains(msg, want) {
				return fmt.Errorf("message %q lacks %q", msg, want)
			}
		}
		return nil
	})
	assertEvent(t, ns, "held", v1alpha1.ReasonPolicyInUse, "Deletion waits for 1 pod (server-0) that use this policy; its store stays until they are gone")
	for _, o := range objs {
		if err := k8s.Get(ctx, key, o); err != nil || o.GetDeletionTimestamp() != nil {
			t.Errorf("%T of a policy in use: %v, deleting %v", o, err, o.GetDeletionTimestamp())
		}
	}

	if err := k8s.Delete(ctx, pod); err != nil {
		t.Fatal(err)
	}
	eventually(t, "everything to go once the last pod is gone", func() error {
		var errs []error
		for _, o := range objs {
			if err := k8s.Get(ctx, key, o); !apierrors.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("%T still there: %w", o, err))
			}
		}
		p := &v1alpha1.IdempotencyPolicy{}
		if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "held"}, p); err == nil {
			for _, f := range p.Finalizers {
				if f == v1alpha1.FinalizerInUse {
					errs = append(errs, errors.New("the policy keeps its in-use finalizer"))
				}
			}
		}
		for _, name := range []string{"held-redis", "held-seal"} {
			var s corev1.Secret
			if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &s); err == nil && len(s.Finalizers) > 0 {
				errs = append(errs, fmt.Errorf("Secret %s keeps finalizers %v", name, s.Finalizers))
			}
		}
		return errors.Join(errs...)
	})
}
