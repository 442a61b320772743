package controllers_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"k8s.io/client-go/util/retry"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
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

// TestRecreatedPolicyAdoptsTheStoreItsPredecessorLeft: a policy deleted
// without its finalizer (finalizers stripped, or its CRD deleted while the
// manager was down) leaves its managed objects to the namespace, their
// other owner: the garbage collector only removes the policy's reference
// (done here for the StatefulSet and Service, as envtest runs no garbage
// collector; the PodDisruptionBudget and NetworkPolicy keep the gone
// policy's reference, as before the collector gets to them) and deletes
// the Secrets, which their finalizer keeps. A policy of the same name made
// again takes them all over. Before, it was stuck on RedisObjectConflict.
func TestRecreatedPolicyAdoptsTheStoreItsPredecessorLeft(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "again")); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: controllers.RedisName("again")}
	objs := []client.Object{&appsv1.StatefulSet{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}, &networkingv1.NetworkPolicy{}, &corev1.Secret{}}
	secretKeys := []client.ObjectKey{key, {Namespace: ns, Name: controllers.SealName("again")}}
	eventually(t, "the managed objects and Secrets", func() error {
		var errs []error
		for _, o := range objs {
			errs = append(errs, k8s.Get(ctx, key, o))
		}
		return errors.Join(append(errs, k8s.Get(ctx, secretKeys[1], &corev1.Secret{}))...)
	})
	// The controller writes the policy too (its status, its finalizer):
	// take the finalizer off the version it last wrote.
	var old *v1alpha1.IdempotencyPolicy
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		old = getPolicy(t, ns, "again")
		old.Finalizers = nil
		return k8s.Update(ctx, old)
	}); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Delete(ctx, old); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the policy gone", func() error {
		if err := k8s.Get(ctx, client.ObjectKeyFromObject(old), &v1alpha1.IdempotencyPolicy{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("still there: %w", err)
		}
		return nil
	})
	for _, o := range objs[:2] {
		if err := k8s.Get(ctx, key, o); err != nil {
			t.Fatal(err)
		}
		var refs []metav1.OwnerReference
		for _, ref := range o.GetOwnerReferences() {
			if ref.UID != old.UID {
				refs = append(refs, ref)
			}
		}
		o.SetOwnerReferences(refs)
		if err := k8s.Update(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	for _, k := range secretKeys {
		if err := k8s.Delete(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: k.Name, Namespace: k.Namespace}}); err != nil {
			t.Fatal(err)
		}
	}

	if err := k8s.Create(ctx, managedPolicy(ns, "again")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the new policy controlling its predecessor's store", func() error {
		p := getPolicy(t, ns, "again")
		if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady); c == nil || c.Reason == v1alpha1.ReasonRedisObjectConflict {
			return fmt.Errorf("StoreReady %+v", c)
		}
		var errs []error
		check := func(k client.ObjectKey, o client.Object) {
			if err := k8s.Get(ctx, k, o); err != nil {
				errs = append(errs, err)
			} else if !metav1.IsControlledBy(o, p) {
				errs = append(errs, fmt.Errorf("%T %s owners %+v, want the new policy %s as controller", o, k.Name, o.GetOwnerReferences(), p.UID))
			}
		}
		for _, o := range objs[:4] {
			check(key, o)
		}
		for _, k := range secretKeys {
			check(k, &corev1.Secret{})
		}
		return errors.Join(errs...)
	})
	assertEvent(t, ns, "again", "Adopted", "Adopted StatefulSet again-redis, left by an earlier policy again (deleted without its finalizer)")
}
