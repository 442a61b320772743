package controllers_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/controllers"
)

func storeMessage(p *v1alpha1.IdempotencyPolicy) string {
	if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady); c != nil {
		return c.Message
	}
	return ""
}

// markReady reports the StatefulSet's pod ready, as a kubelet would
// (envtest runs none).
func markReady(t *testing.T, sts *appsv1.StatefulSet) {
	t.Helper()
	sts.Status = appsv1.StatefulSetStatus{Replicas: 1, ReadyReplicas: 1, AvailableReplicas: 1, ObservedGeneration: sts.Generation}
	if err := k8s.Status().Update(context.Background(), sts); err != nil {
		t.Fatal(err)
	}
}

func TestManagedRedis(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "payments")); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "payments-redis"}
	var (
		secret corev1.Secret
		sts    appsv1.StatefulSet
		svc    corev1.Service
		pdb    policyv1.PodDisruptionBudget
		np     networkingv1.NetworkPolicy
	)
	eventually(t, "the Secret, StatefulSet, Service, PodDisruptionBudget and NetworkPolicy", func() error {
		return errors.Join(k8s.Get(ctx, key, &secret), k8s.Get(ctx, key, &sts), k8s.Get(ctx, key, &svc), k8s.Get(ctx, key, &pdb), k8s.Get(ctx, key, &np))
	})
	p := getPolicy(t, ns, "payments")
	for _, o := range []client.Object{&secret, &sts, &svc, &pdb, &np} {
		if ref := metav1.GetControllerOf(o); ref == nil || ref.UID != p.UID || ref.Kind != "IdempotencyPolicy" {
			t.Errorf("%T %s is not owned by the policy: %v", o, o.GetName(), o.GetOwnerReferences())
		}
	}
	if !slices.Contains(p.Finalizers, v1alpha1.FinalizerInUse) {
		t.Errorf("policy finalizers %v lack %s", p.Finalizers, v1alpha1.FinalizerInUse)
	}
	if err := k8s.Get(ctx, key, &appsv1.Deployment{}); !apierrors.IsNotFound(err) {
		t.Errorf("a Deployment runs Redis too: %v", err)
	}

	password := string(secret.Data["password"])
	if len(password) < 32 || !strings.Contains(string(secret.Data["redis.conf"]), "requirepass "+password) {
		t.Errorf("secret holds password %q and redis.conf %q", password, secret.Data["redis.conf"])
	}
	if secret.Labels[v1alpha1.LabelCredentials] != "true" || !slices.Contains(secret.Finalizers, v1alpha1.FinalizerInUse) {
		t.Errorf("secret labels %v finalizers %v", secret.Labels, secret.Finalizers)
	}

	// Durable by default: a volume claim, removed with the StatefulSet.
	vct := sts.Spec.VolumeClaimTemplates
	if len(vct) != 1 || vct[0].Spec.Resources.Requests.Storage().String() != "1Gi" {
		t.Errorf("volume claim templates %+v, want one of 1Gi", vct)
	}
	if r := sts.Spec.PersistentVolumeClaimRetentionPolicy; r == nil || r.WhenDeleted != appsv1.DeletePersistentVolumeClaimRetentionPolicyType {
		t.Errorf("claim retention %+v: a deleted StatefulSet would orphan its claim", r)
	}
	if *sts.Spec.Replicas != 1 || sts.Spec.Template.Labels[v1alpha1.LabelInject] != "false" {
		t.Errorf("replicas %d, pod labels %v", *sts.Spec.Replicas, sts.Spec.Template.Labels)
	}
	for _, v := range sts.Spec.Template.Spec.Volumes {
		if v.EmptyDir != nil {
			t.Errorf("volume %s is an emptyDir", v.Name)
		}
	}
	c := sts.Spec.Template.Spec.Containers[0]
	args := strings.Join(c.Args, " ")
	for _, want := range []string{"/etc/redis/redis.conf", "--appendonly yes", "--maxmemory-policy noeviction", "--maxmemory 201326592"} {
		if !strings.Contains(args, want) {
			t.Errorf("redis args %q lack %q", args, want)
		}
	}
	// Guaranteed QoS: requests equal limits for CPU and memory.
	if !c.Resources.Requests.Cpu().Equal(*c.Resources.Limits.Cpu()) || !c.Resources.Requests.Memory().Equal(*c.Resources.Limits.Memory()) || c.Resources.Limits.Cpu().IsZero() {
		t.Errorf("resources %+v are not Guaranteed", c.Resources)
	}
	// Ready only when Redis answers PONG (not LOADING), with the password.
	if pr := c.ReadinessProbe; pr == nil || pr.Exec == nil || !slices.Equal(pr.Exec.Command, controllers.RedisReadinessCommand) {
		t.Errorf("readiness probe %+v", pr)
	}
	if len(c.Env) != 1 || c.Env[0].Name != "REDISCLI_AUTH" || c.Env[0].ValueFrom.SecretKeyRef.Name != "payments-redis" {
		t.Errorf("env %+v", c.Env)
	}
	if sc := c.SecurityContext; sc == nil || !*sc.RunAsNonRoot || !*sc.ReadOnlyRootFilesystem || *sc.AllowPrivilegeEscalation {
		t.Errorf("redis security context %+v", sc)
	}
	if svc.Spec.Ports[0].Port != 6379 || svc.Spec.Selector["app.kubernetes.io/instance"] != "payments-redis" {
		t.Errorf("service %+v", svc.Spec)
	}
	if pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 0 || pdb.Spec.Selector.MatchLabels["app.kubernetes.io/instance"] != "payments-redis" {
		t.Errorf("pod disruption budget %+v", pdb.Spec)
	}
	// 6379 only from the policy's own pods, never the Redis itself.
	in := np.Spec.Ingress
	if len(in) != 1 || len(in[0].From) != 1 || in[0].From[0].PodSelector.MatchLabels[v1alpha1.LabelPolicy] != "payments" ||
		in[0].From[0].NamespaceSelector != nil || in[0].Ports[0].Port.IntValue() != 6379 || len(in[0].From[0].PodSelector.MatchExpressions) != 1 {
		t.Errorf("network policy %+v", np.Spec)
	}

	eventually(t, "StoreReady False while Redis is not ready, with the image recorded", func() error {
		p := getPolicy(t, ns, "payments")
		if p.Status.Store == nil || p.Status.Store.Image != "redis:7.4-alpine" {
			return fmt.Errorf("store status %+v", p.Status.Store)
		}
		return condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonRedisProvisioning)
	})
	markReady(t, &sts)
	eventually(t, "StoreReady True once Redis is ready", func() error {
		p := getPolicy(t, ns, "payments")
		if p.Status.Store == nil || p.Status.Store.Endpoint != "payments-redis."+ns+".svc:6379" {
			return fmt.Errorf("endpoint %+v", p.Status.Store)
		}
		return errors.Join(condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable),
			condition(p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonReady))
	})

	// A hand edit is put back; a deleted StatefulSet comes back.
	if err := k8s.Get(ctx, key, &sts); err != nil {
		t.Fatal(err)
	}
	sts.Spec.Template.Spec.Containers[0].Args = []string{"--maxmemory-policy", "allkeys-lru"}
	if err := k8s.Update(ctx, &sts); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the hand edit to be repaired", func() error {
		if err := k8s.Get(ctx, key, &sts); err != nil {
			return err
		}
		if a := strings.Join(sts.Spec.Template.Spec.Containers[0].Args, " "); !strings.Contains(a, "noeviction") {
			return fmt.Errorf("args still %q", a)
		}
		return nil
	})

	// A new image in the policy rolls Redis; the password never changes.
	updatePolicy(t, ns, "payments", func(p *v1alpha1.IdempotencyPolicy) {
		p.Spec.Store.Redis.Managed.Image = "redis:8.0-alpine"
	})
	eventually(t, "the new image in the pod template and the status", func() error {
		if err := k8s.Get(ctx, key, &sts); err != nil {
			return err
		}
		if img := sts.Spec.Template.Spec.Containers[0].Image; img != "redis:8.0-alpine" {
			return fmt.Errorf("image %s", img)
		}
		if s := getPolicy(t, ns, "payments").Status.Store; s == nil || s.Image != "redis:8.0-alpine" {
			return fmt.Errorf("status.store %+v", s)
		}
		return nil
	})
	if err := k8s.Get(ctx, key, &secret); err != nil {
		t.Fatal(err)
	}
	if string(secret.Data["password"]) != password {
		t.Error("the Redis password changed across reconciles")
	}
	assertEvent(t, ns, "payments", "Created", "Created StatefulSet payments-redis")
}

// TestManagedRedisKeepsItsImage: a Redis whose policy names no image keeps
// the image it runs, whatever the manager's --redis-image says later.
func TestManagedRedisKeepsItsImage(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "older")); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "older-redis"}
	var sts appsv1.StatefulSet
	// Let the first reconciles (StatefulSet, Secrets, status) settle, then
	// edit the StatefulSet as if an earlier manager, whose default was
	// 7.2, had made it.
	eventually(t, "the first status", func() error {
		if s := getPolicy(t, ns, "older").Status.Store; s == nil || s.Image != controllers.DefaultRedisImage {
			return fmt.Errorf("status.store %+v", s)
		}
		return nil
	})
	eventually(t, "the StatefulSet edited", func() error {
		if err := k8s.Get(ctx, key, &sts); err != nil {
			return err
		}
		sts.Spec.Template.Spec.Containers[0].Image = "redis:7.2-alpine"
		return k8s.Update(ctx, &sts)
	})
	nudges := 0
	eventually(t, "status.store.image to say 7.2", func() error {
		p := getPolicy(t, ns, "older")
		if s := p.Status.Store; s == nil || s.Image != "redis:7.2-alpine" {
			// A change to the policy makes the controller look again, in
			// case the StatefulSet's update came before its watch saw it.
			nudges++
			patch := fmt.Sprintf(`{"metadata":{"annotations":{"test.idemcp.io/nudge":"%d"}}}`, nudges)
			_ = k8s.Patch(ctx, p, client.RawPatch(types.MergePatchType, []byte(patch)))
			return fmt.Errorf("status.store %+v", s)
		}
		return nil
	})
	if err := k8s.Get(ctx, key, &sts); err != nil {
		t.Fatal(err)
	}
	if img := sts.Spec.Template.Spec.Containers[0].Image; img != "redis:7.2-alpine" {
		t.Errorf("the manager moved Redis to %s on its own", img)
	}
}

// TestManagedRedisWithoutMemoryLimit: requests alone still give a
// Guaranteed pod and a maxmemory.
func TestManagedRedisWithoutMemoryLimit(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	p := managedPolicy(ns, "small")
	p.Spec.Store.Redis.Managed.Resources = &corev1.ResourceRequirements{Requests: corev1.ResourceList{
		corev1.ResourceCPU: resource.MustParse("200m"), corev1.ResourceMemory: resource.MustParse("128Mi"),
	}}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	var sts appsv1.StatefulSet
	eventually(t, "the StatefulSet", func() error { return k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "small-redis"}, &sts) })
	c := sts.Spec.Template.Spec.Containers[0]
	if c.Resources.Limits.Memory().String() != "128Mi" || c.Resources.Limits.Cpu().String() != "200m" {
		t.Errorf("limits %v, want the requests", c.Resources.Limits)
	}
	if a := strings.Join(c.Args, " "); !strings.Contains(a, "--maxmemory 100663296") {
		t.Errorf("args %q lack a maxmemory of 75%% of 128Mi", a)
	}
}

func TestManagedRedisEphemeral(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	p := managedPolicy(ns, "scratch")
	p.Spec.Store.Redis.Managed.Ephemeral = true
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	var sts appsv1.StatefulSet
	eventually(t, "the StatefulSet", func() error { return k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "scratch-redis"}, &sts) })
	if len(sts.Spec.VolumeClaimTemplates) != 0 {
		t.Errorf("ephemeral Redis has volume claims %+v", sts.Spec.VolumeClaimTemplates)
	}
	markReady(t, &sts)
	eventually(t, "a status that says the data is lost on restart", func() error {
		p := getPolicy(t, ns, "scratch")
		if !strings.Contains(storeMessage(p), "emptyDir") {
			return fmt.Errorf("message %q", storeMessage(p))
		}
		return condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable)
	})
}

// TestStorageChangeIsRefused: a new size or kind of volume would replace
// Redis's data, so the API server refuses it with a way forward.
func TestStorageChangeIsRefused(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "orders")); err != nil {
		t.Fatal(err)
	}
	for _, change := range []func(m *v1alpha1.ManagedRedis){
		func(m *v1alpha1.ManagedRedis) { q := resource.MustParse("2Gi"); m.Storage = &q },
		func(m *v1alpha1.ManagedRedis) { m.Ephemeral = true },
	} {
		eventually(t, "the update to be refused", func() error {
			p := getPolicy(t, ns, "orders")
			change(p.Spec.Store.Redis.Managed)
			err := k8s.Update(ctx, p)
			if apierrors.IsConflict(err) { // the controller wrote first
				return err
			}
			if err == nil || !strings.Contains(err.Error(), "storage and ephemeral cannot change while the managed Redis exists") {
				t.Fatalf("update: %v", err)
			}
			return nil
		})
	}
}

// TestForeignObjectsAreNotAdopted: a Service of the same name that idemcp
// did not create is left alone, and the status names it.
func TestForeignObjectsAreNotAdopted(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	theirs := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "cache-redis", Namespace: ns},
		Spec:       corev1.ServiceSpec{Selector: map[string]string{"app": "theirs"}, Ports: []corev1.ServicePort{{Port: 6379}}},
	}
	if err := k8s.Create(ctx, theirs); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Create(ctx, &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "cache", Namespace: ns}}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the Memory policy's status", func() error {
		return condition(getPolicy(t, ns, "cache"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonMemoryStore)
	})
	// Switching to managed Redis fails on the conflict, and clears the
	// old endpoint.
	updatePolicy(t, ns, "cache", func(p *v1alpha1.IdempotencyPolicy) {
		p.Spec.Store = managedPolicy(ns, "cache").Spec.Store
	})
	eventually(t, "a conflict naming the Service", func() error {
		p := getPolicy(t, ns, "cache")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonRedisObjectConflict); err != nil {
			return err
		}
		if msg := storeMessage(p); !strings.Contains(msg, "Service "+ns+"/cache-redis") {
			return fmt.Errorf("message %q does not name the Service", msg)
		}
		if p.Status.Store != nil && p.Status.Store.Endpoint != "" {
			return fmt.Errorf("status still shows endpoint %q", p.Status.Store.Endpoint)
		}
		return condition(p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady)
	})
	assertEvent(t, ns, "cache", v1alpha1.ReasonRedisObjectConflict, "cache-redis")
	var svc corev1.Service
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(theirs), &svc); err != nil {
		t.Fatal(err)
	}
	if svc.Spec.Selector["app"] != "theirs" || len(svc.OwnerReferences) != 0 {
		t.Errorf("the foreign Service was taken over: selector %v owners %v", svc.Spec.Selector, svc.OwnerReferences)
	}
}

// TestSwitchingAwayRemovesManagedRedis: a policy moved to the Memory store
// leaves no Redis running, and Redis's own pods never count as users.
func TestSwitchingAwayRemovesManagedRedis(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "tickets")); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "tickets-redis"}
	var sts appsv1.StatefulSet
	eventually(t, "the StatefulSet", func() error { return k8s.Get(ctx, key, &sts) })
	// Two pods of the Redis itself, as its StatefulSet would label them.
	for i := range 2 {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("tickets-redis-%d", i), Namespace: ns, Labels: sts.Spec.Template.Labels},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "redis", Image: "redis"}}},
		}
		if err := k8s.Create(ctx, pod); err != nil {
			t.Fatal(err)
		}
		setPodReady(t, pod)
	}
	updatePolicy(t, ns, "tickets", func(p *v1alpha1.IdempotencyPolicy) {
		p.Spec.Store = v1alpha1.StoreSpec{Type: v1alpha1.StoreMemory}
	})
	eventually(t, "the managed Redis to go", func() error {
		var errs []error
		for _, o := range []client.Object{&appsv1.StatefulSet{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}, &networkingv1.NetworkPolicy{}} {
			if err := k8s.Get(ctx, key, o); !apierrors.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("%T still there (%w)", o, err))
			}
		}
		return errors.Join(errs...)
	})
	eventually(t, "MemoryStore, not MemoryStoreShared", func() error {
		return condition(getPolicy(t, ns, "tickets"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonMemoryStore)
	})
	var secret corev1.Secret
	if err := k8s.Get(ctx, key, &secret); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(secret.Finalizers, v1alpha1.FinalizerInUse) {
		t.Error("the Secret of a removed Redis still holds the finalizer")
	}
}

// TestDeletedManagedSecretKeepsItsPassword: deleting the Secret while
// Redis runs leaves it in place, same password, until Redis goes.
func TestDeletedManagedSecretKeepsItsPassword(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "keep")); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "keep-redis"}
	var secret corev1.Secret
	var sts appsv1.StatefulSet
	eventually(t, "the Secret and StatefulSet", func() error { return errors.Join(k8s.Get(ctx, key, &secret), k8s.Get(ctx, key, &sts)) })
	password := string(secret.Data["password"])
	hash := sts.Spec.Template.Annotations["idemcp.io/config-hash"]
	if err := k8s.Delete(ctx, &secret); err != nil {
		t.Fatal(err)
	}
	markReady(t, &sts)
	eventually(t, "the status to say the Secret is held", func() error {
		if msg := storeMessage(getPolicy(t, ns, "keep")); !strings.Contains(msg, "is being deleted and stays, with the same password") {
			return fmt.Errorf("message %q", msg)
		}
		return nil
	})
	if err := k8s.Get(ctx, key, &secret); err != nil {
		t.Fatal(err)
	}
	if string(secret.Data["password"]) != password || secret.DeletionTimestamp == nil {
		t.Errorf("secret deleting %v, password kept %v", secret.DeletionTimestamp, string(secret.Data["password"]) == password)
	}
	if err := k8s.Get(ctx, key, &sts); err != nil {
		t.Fatal(err)
	}
	if got := sts.Spec.Template.Annotations["idemcp.io/config-hash"]; got != hash {
		t.Errorf("Redis restarts: config hash %s -> %s", hash, got)
	}
	// Switching away releases it, and then it goes.
	updatePolicy(t, ns, "keep", func(p *v1alpha1.IdempotencyPolicy) {
		p.Spec.Store = v1alpha1.StoreSpec{Type: v1alpha1.StoreMemory}
	})
	eventually(t, "the Secret to go", func() error {
		if err := k8s.Get(ctx, key, &corev1.Secret{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("still there: %w", err)
		}
		return nil
	})
}

// TestNoTwoRedisAtOnce: while an earlier Redis pod of the policy still
// runs, the new StatefulSet waits.
func TestNoTwoRedisAtOnce(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "swap", Namespace: ns}}); err != nil {
		t.Fatal(err)
	}
	// The pod an earlier idemcp's Deployment ran, still shutting down.
	old := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "swap-redis-5d8f-x", Namespace: ns, Labels: map[string]string{
			"app.kubernetes.io/instance": "swap-redis", v1alpha1.LabelComponent: "redis", v1alpha1.LabelPolicy: "swap",
		}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "redis", Image: "redis"}}},
	}
	if err := k8s.Create(ctx, old); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the Memory policy's status", func() error {
		return condition(getPolicy(t, ns, "swap"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonMemoryStore)
	})
	updatePolicy(t, ns, "swap", func(p *v1alpha1.IdempotencyPolicy) {
		p.Spec.Store = managedPolicy(ns, "swap").Spec.Store
	})
	eventually(t, "RedisReplacing naming the old pod", func() error {
		p := getPolicy(t, ns, "swap")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonRedisReplacing); err != nil {
			return err
		}
		if !strings.Contains(storeMessage(p), old.Name) {
			return fmt.Errorf("message %q", storeMessage(p))
		}
		return nil
	})
	key := client.ObjectKey{Namespace: ns, Name: "swap-redis"}
	if err := k8s.Get(ctx, key, &appsv1.StatefulSet{}); !apierrors.IsNotFound(err) {
		t.Fatalf("a StatefulSet runs beside the old Redis: %v", err)
	}
	if err := k8s.Delete(ctx, old); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the StatefulSet once the old pod is gone", func() error { return k8s.Get(ctx, key, &appsv1.StatefulSet{}) })
}

// TestLostSecretRestartsInOrder: a Secret lost anyway gets a new
// password, Redis restarts with it, and the status lists the pods that
// still hold the old one until they are replaced.
func TestLostSecretRestartsInOrder(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "lost")); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "lost-redis"}
	var secret corev1.Secret
	var sts appsv1.StatefulSet
	eventually(t, "the Secret and StatefulSet", func() error { return errors.Join(k8s.Get(ctx, key, &secret), k8s.Get(ctx, key, &sts)) })
	hash := sts.Spec.Template.Annotations["idemcp.io/config-hash"]
	pod := injectedPod(t, ns, "server-old", "lost", nil, true)
	// As an earlier idemcp's unprotected Secret: no finalizer, deleted.
	secret.Finalizers = nil
	if err := k8s.Update(ctx, &secret); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Delete(ctx, &secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "RedisPasswordReset naming the pod, and Redis restarted", func() error {
		p := getPolicy(t, ns, "lost")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonRedisPasswordReset); err != nil {
			return err
		}
		if !strings.Contains(storeMessage(p), "server-old") {
			return fmt.Errorf("message %q", storeMessage(p))
		}
		if err := k8s.Get(ctx, key, &sts); err != nil {
			return err
		}
		if sts.Spec.Template.Annotations["idemcp.io/config-hash"] == hash {
			return errors.New("Redis was not restarted with the new password")
		}
		return nil
	})
	assertEvent(t, ns, "lost", v1alpha1.ReasonRedisPasswordReset, "server-old")
	if err := k8s.Delete(ctx, pod); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // creation times have whole seconds
	injectedPod(t, ns, "server-new", "lost", nil, true)
	eventually(t, "the reset cleared once the pods are new", func() error {
		return condition(getPolicy(t, ns, "lost"), v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonRedisProvisioning)
	})
}

// updatePolicy changes a policy, retrying when the controller wrote it
// in between.
func updatePolicy(t *testing.T, ns, name string, change func(p *v1alpha1.IdempotencyPolicy)) {
	t.Helper()
	eventually(t, "updating policy "+name, func() error {
		p := getPolicy(t, ns, name)
		change(p)
		err := k8s.Update(context.Background(), p)
		if err != nil && !apierrors.IsConflict(err) {
			t.Fatal(err)
		}
		return err
	})
}
