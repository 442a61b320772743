package controllers_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

func setPodReady(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	pod.Status.Phase = corev1.PodRunning
	if err := k8s.Status().Update(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
}

// newDeployment makes a Deployment and one ReplicaSet per revision, owned
// the way the Deployment controller owns them (envtest runs no
// controllers, so nothing acts on them).
func newDeployment(t *testing.T, ns, name string, revisions ...string) map[string]*appsv1.ReplicaSet {
	t.Helper()
	ctx := context.Background()
	labels := map[string]string{"app": name}
	tmpl := corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}}}}
	dep := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: appsv1.DeploymentSpec{Selector: &metav1.LabelSelector{MatchLabels: labels}, Template: tmpl}}
	if err := k8s.Create(ctx, dep); err != nil {
		t.Fatal(err)
	}
	out := map[string]*appsv1.ReplicaSet{}
	for _, rev := range revisions {
		rs := &appsv1.ReplicaSet{ObjectMeta: metav1.ObjectMeta{Name: name + "-" + rev, Namespace: ns,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "Deployment", Name: name, UID: dep.UID, Controller: ptr.To(true)}}},
			Spec: appsv1.ReplicaSetSpec{Selector: &metav1.LabelSelector{MatchLabels: labels}, Template: tmpl}}
		if err := k8s.Create(ctx, rs); err != nil {
			t.Fatal(err)
		}
		out[rev] = rs
	}
	return out
}

// injectedPod makes a pod as the webhook leaves it: the policy label and
// the status mark, owned by rs (if any).
func injectedPod(t *testing.T, ns, name, policy string, rs *appsv1.ReplicaSet, ready bool) *corev1.Pod {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
			Labels:      map[string]string{v1alpha1.LabelPolicy: policy, v1alpha1.LabelInject: "true"},
			Annotations: map[string]string{v1alpha1.AnnotationStatus: `{"policy":"` + policy + `"}`}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}}},
	}
	if rs != nil {
		pod.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: rs.Name, UID: rs.UID, Controller: ptr.To(true)}}
	}
	if err := k8s.Create(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	if ready {
		setPodReady(t, pod)
	}
	return pod
}

// TestMemoryStoreSharedCountsServingReplicas: the overlap of a one-replica
// rollout is not "shared"; two replicas serving at once are.
func TestMemoryStoreSharedCountsServingReplicas(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "mem", Namespace: ns}}); err != nil {
		t.Fatal(err)
	}
	rss := newDeployment(t, ns, "app", "aaaa", "bbbb")
	injectedPod(t, ns, "app-aaaa-1", "mem", rss["aaaa"], true)
	injectedPod(t, ns, "app-bbbb-1", "mem", rss["bbbb"], true) // the rollout's new pod, old one still ready
	// A pod labelled by hand, never injected, does not count.
	stray := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "stray", Namespace: ns, Labels: map[string]string{v1alpha1.LabelPolicy: "mem"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "x", Image: "x"}}}}
	if err := k8s.Create(ctx, stray); err != nil {
		t.Fatal(err)
	}
	setPodReady(t, stray)
	eventually(t, "MemoryStore through the rollout", func() error {
		return condition(getPolicy(t, ns, "mem"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonMemoryStore)
	})
	// Stays so: the reconciles the pods caused are done.
	if err := condition(getPolicy(t, ns, "mem"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonMemoryStore); err != nil {
		t.Fatal(err)
	}

	injectedPod(t, ns, "app-bbbb-2", "mem", rss["bbbb"], true)
	eventually(t, "MemoryStoreShared with two ready replicas", func() error {
		p := getPolicy(t, ns, "mem")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonMemoryStoreShared); err != nil {
			return err
		}
		if msg := storeMessage(p); !strings.Contains(msg, "2 replicas") || !strings.Contains(msg, "Deployment/app") {
			return fmt.Errorf("message %q", msg)
		}
		return nil
	})
	assertEvent(t, ns, "mem", v1alpha1.ReasonMemoryStoreShared, "Deployment/app")
}

// TestRedisPolicySharedByWorkloads: two different servers behind one Redis
// policy share one key space, and the policy says so.
func TestRedisPolicySharedByWorkloads(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	p := &v1alpha1.IdempotencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "shared", Namespace: ns},
		Spec: v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{
			External: &v1alpha1.ExternalRedis{Addresses: []string{"redis.shared.svc:6379"}},
		}}},
	}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	a := newDeployment(t, ns, "billing", "1111")
	injectedPod(t, ns, "billing-1111-x", "shared", a["1111"], true)
	injectedPod(t, ns, "billing-1111-y", "shared", a["1111"], false)
	eventually(t, "one workload: ExternalRedisConfigured", func() error {
		return condition(getPolicy(t, ns, "shared"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonExternalRedis)
	})
	b := newDeployment(t, ns, "crm", "2222")
	injectedPod(t, ns, "crm-2222-x", "shared", b["2222"], true)
	eventually(t, "StoreSharedByWorkloads naming both", func() error {
		p := getPolicy(t, ns, "shared")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonStoreSharedByWorkloads); err != nil {
			return err
		}
		if msg := storeMessage(p); !strings.Contains(msg, "Deployment/billing, Deployment/crm") {
			return fmt.Errorf("message %q", msg)
		}
		return nil
	})
	assertEvent(t, ns, "shared", v1alpha1.ReasonStoreSharedByWorkloads, "Deployment/billing, Deployment/crm")

	// Pods injected with a key space of their own (each workload's, or one
	// two workloads share by idemcp.io/key-space) share nothing they did
	// not ask to: the store is ready with no warning.
	for _, name := range []string{"billing-1111-x", "billing-1111-y", "crm-2222-x"} {
		pod := &corev1.Pod{}
		if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, pod); err != nil {
			t.Fatal(err)
		}
		space := "Deployment/" + strings.SplitN(name, "-", 2)[0]
		pod.Annotations[v1alpha1.AnnotationStatus] = `{"policy":"shared","keySpace":"` + space + `"}`
		if err := k8s.Update(ctx, pod); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "own key spaces: ExternalRedisConfigured", func() error {
		return condition(getPolicy(t, ns, "shared"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonExternalRedis)
	})
}

// TestPolicyInUseIsHeld: deleting a policy while pods use it keeps it (and
// its Redis) until they are gone.
func TestPolicyInUseIsHeld(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "busy")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the finalizer", func() error {
		if p := getPolicy(t, ns, "busy"); len(p.Finalizers) == 0 {
			return errors.New("no finalizer yet")
		}
		return nil
	})
	pod := injectedPod(t, ns, "server-0", "busy", nil, true)
	if err := k8s.Delete(ctx, getPolicy(t, ns, "busy")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "Ready False PolicyInUse naming the pod", func() error {
		p := getPolicy(t, ns, "busy")
		if err := condition(p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonPolicyInUse); err != nil {
			return err
		}
		for c := range strings.SplitSeq("server-0,Pod/server-0", ",") {
			if msg := readyMessage(p); !strings.Contains(msg, c) {
				return fmt.Errorf("message %q lacks %q", msg, c)
			}
		}
		return nil
	})
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "busy-redis"}, &appsv1.StatefulSet{}); err != nil {
		t.Errorf("the Redis of a policy in use is gone: %v", err)
	}
	if err := k8s.Delete(ctx, pod); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the policy to go once its pod is gone", func() error {
		err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "busy"}, &v1alpha1.IdempotencyPolicy{})
		if !apierrors.IsNotFound(err) {
			return fmt.Errorf("still there: %w", err)
		}
		// Its Secret is released, so garbage collection can take it.
		var s corev1.Secret
		if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "busy-redis"}, &s); err == nil && len(s.Finalizers) > 0 {
			return fmt.Errorf("secret finalizers %v", s.Finalizers)
		}
		return nil
	})
}

func readyMessage(p *v1alpha1.IdempotencyPolicy) string {
	for _, c := range p.Status.Conditions {
		if c.Type == v1alpha1.ConditionReady {
			return c.Message
		}
	}
	return ""
}

// TestExternalRedisSecret: the referenced Secret must exist, be opted in
// with the credentials label and hold the key; each fix, and each later
// breakage, shows in the status within seconds (the Secret is watched).
func TestExternalRedisSecret(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	p := &v1alpha1.IdempotencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "msgs", Namespace: ns},
		Spec: v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{
			External: &v1alpha1.ExternalRedis{Addresses: []string{"redis.shared.svc:6379"}, PasswordSecretRef: &v1alpha1.SecretKeyRef{Name: "redis-auth", Key: "password"}},
		}}},
	}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	eventually(t, "StoreReady False naming the Secret", func() error {
		p := getPolicy(t, ns, "msgs")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonSecretNotFound); err != nil {
			return err
		}
		if msg := storeMessage(p); !strings.Contains(msg, ns+"/redis-auth") {
			return fmt.Errorf("message %q does not name the Secret", msg)
		}
		return condition(p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady)
	})
	assertEvent(t, ns, "msgs", v1alpha1.ReasonSecretNotFound, "redis-auth")

	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "redis-auth", Namespace: ns}, StringData: map[string]string{"password": "s3cret"}}
	if err := k8s.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "SecretNotLabelled naming the label", func() error {
		p := getPolicy(t, ns, "msgs")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonSecretNotLabelled); err != nil {
			return err
		}
		if msg := storeMessage(p); !strings.Contains(msg, `idemcp.io/credentials: "true"`) {
			return fmt.Errorf("message %q does not name the label", msg)
		}
		return nil
	})
	secret.Labels = map[string]string{v1alpha1.LabelCredentials: "true"}
	if err := k8s.Update(ctx, secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "recovery once the Secret is opted in", func() error {
		p := getPolicy(t, ns, "msgs")
		if p.Status.Store == nil || p.Status.Store.Endpoint != "redis.shared.svc:6379" {
			return fmt.Errorf("endpoint %+v", p.Status.Store)
		}
		return errors.Join(condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonExternalRedis),
			condition(p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonReady))
	})
	// A renamed key flips Ready: a healthy policy is never polled, so only
	// the Secret watch can notice.
	secret.Data = map[string][]byte{"pass": []byte("s3cret")}
	secret.StringData = nil
	if err := k8s.Update(ctx, secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "SecretKeyMissing after the key is renamed", func() error {
		p := getPolicy(t, ns, "msgs")
		return errors.Join(condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonSecretKeyMissing),
			condition(p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady))
	})
}
