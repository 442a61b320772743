package controllers_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

func getPolicy(t *testing.T, ns, name string) *v1alpha1.IdempotencyPolicy {
	t.Helper()
	var p v1alpha1.IdempotencyPolicy
	if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, &p); err != nil {
		t.Fatal(err)
	}
	return &p
}

// condition returns an error unless the policy's condition has the
// status and reason and describes its current generation.
func condition(p *v1alpha1.IdempotencyPolicy, typ string, status metav1.ConditionStatus, reason string) error {
	c := meta.FindStatusCondition(p.Status.Conditions, typ)
	switch {
	case c == nil:
		return fmt.Errorf("no %s condition yet (conditions: %v)", typ, p.Status.Conditions)
	case c.Status != status || c.Reason != reason:
		return fmt.Errorf("%s = %s/%s (%s), want %s/%s", typ, c.Status, c.Reason, c.Message, status, reason)
	case c.ObservedGeneration != p.Generation || p.Status.ObservedGeneration != p.Generation:
		return fmt.Errorf("%s observedGeneration %d (status %d), want %d", typ, c.ObservedGeneration, p.Status.ObservedGeneration, p.Generation)
	}
	return nil
}

func TestSamplesApplyAndPrintColumns(t *testing.T) {
	ns := newNamespace(t)
	paths, _ := filepath.Glob("../config/samples/idemcp_*.yaml")
	if len(paths) < 3 {
		t.Fatalf("found %d samples, want 3", len(paths))
	}
	for _, path := range paths {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var p v1alpha1.IdempotencyPolicy
		if err := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096).Decode(&p); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		p.Namespace = ns
		if err := k8s.Create(context.Background(), &p); err != nil {
			t.Errorf("%s does not apply: %v", path, err)
		}
	}
	kubectl := filepath.Join(assetsDir, "kubectl")
	if _, err := os.Stat(kubectl); err != nil {
		t.Fatalf("kubectl is not in KUBEBUILDER_ASSETS (hack/setup-envtest.sh builds it): %v", err)
	}
	kubeconfig := writeKubeconfig(t)
	out, err := exec.Command(kubectl, "--kubeconfig", kubeconfig, "-n", ns, "get", "idpol").CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl get idpol: %v\n%s", err, out)
	}
	header := strings.Fields(strings.SplitN(string(out), "\n", 2)[0])
	if strings.Join(header, " ") != "NAME STORE TTL READY AGE" {
		t.Errorf("kubectl get idpol columns = %v, want NAME STORE TTL READY AGE\n%s", header, out)
	}
	if !strings.Contains(string(out), "tickets") || !strings.Contains(string(out), "Memory") {
		t.Errorf("kubectl get idpol:\n%s", out)
	}
}

func writeKubeconfig(t *testing.T) string {
	t.Helper()
	user, err := testEnv.ControlPlane.AddUser(envtestAdmin(), nil)
	if err != nil {
		t.Fatal(err)
	}
	data, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestInvalidPoliciesAreRefused(t *testing.T) {
	ns := newNamespace(t)
	tests := []struct {
		name string
		spec string
		want []string // all must appear in the API server's message
	}{
		{"ttl too long", `{"ttl":"800h"}`, []string{"spec.ttl", "between 1s and 720h"}},
		{"ttl too short", `{"ttl":"100ms"}`, []string{"spec.ttl", "between 1s and 720h"}},
		{"store type", `{"store":{"type":"Postgres"}}`, []string{"spec.store.type", `"Memory", "Redis"`}},
		{"redis without config", `{"store":{"type":"Redis"}}`, []string{"spec.store", "exactly one of redis.managed or redis.external"}},
		{"redis with both", `{"store":{"type":"Redis","redis":{"managed":{},"external":{"addresses":["r:6379"]}}}}`, []string{"spec.store", "exactly one of"}},
		{"memory with redis", `{"store":{"type":"Memory","redis":{"managed":{}}}}`, []string{"spec.store", "type Memory takes no redis"}},
		{"external without addresses", `{"store":{"type":"Redis","redis":{"external":{"addresses":[]}}}}`, []string{"spec.store.redis.external.addresses"}},
		{"external bad address", `{"store":{"type":"Redis","redis":{"external":{"addresses":["redis.svc"]}}}}`, []string{"spec.store.redis.external.addresses[0]", "should match"}},
		{"onStoreUnavailable", `{"onStoreUnavailable":"Ignore"}`, []string{"spec.onStoreUnavailable", `"FailClosed", "FailOpen"`}},
		{"keyScope", `{"keyScope":"User"}`, []string{"spec.keyScope", `"Session", "Principal", "Global"`}},
		{"inFlight", `{"inFlight":"Queue"}`, []string{"spec.inFlight", `"Wait", "Reject"`}},
		{"onAbandoned", `{"onAbandoned":"Ignore"}`, []string{"spec.onAbandoned", `"Retry", "Error"`}},
		{"defaultMode", `{"defaultMode":"Cache"}`, []string{"spec.defaultMode", `"Auto", "Deduplicate", "Passthrough"`}},
		{"leaseDuration", `{"leaseDuration":"100ms"}`, []string{"spec.leaseDuration", "between 1s and 1h"}},
		{"waitTimeout", `{"waitTimeout":"2h"}`, []string{"spec.waitTimeout", "between 0s and 1h"}},
		{"maxResultBytes", `{"maxResultBytes":"0"}`, []string{"spec.maxResultBytes", "more than 0 and at most 64Mi"}},
		{"principalHeader", `{"principalHeader":"X User"}`, []string{"spec.principalHeader"}},
		{"tool mode", `{"tools":[{"name":"a","mode":"Always"}]}`, []string{"spec.tools[0].mode", `"Auto", "Deduplicate", "Passthrough"`}},
		{"tool name not a glob", `{"tools":[{"name":"charge card!"}]}`, []string{"spec.tools[0].name", "should match '^[A-Za-z0-9_./*?-]+$'"}},
		{"tool names unique", `{"tools":[{"name":"a"},{"name":"a"}]}`, []string{"spec.tools[1]", "Duplicate value"}},
		{"ignoreArguments pointer", `{"tools":[{"name":"a","ignoreArguments":["requestedAt"]}]}`, []string{"spec.tools[0].ignoreArguments[0]", "should match"}},
		{"tool ttl", `{"tools":[{"name":"a","ttl":"1000h"}]}`, []string{"spec.tools[0].ttl", "between 1s and 720h"}},
		{"tool keyScope", `{"tools":[{"name":"a","keyScope":"Team"}]}`, []string{"spec.tools[0].keyScope"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := &v1alpha1.IdempotencyPolicy{}
			if err := yaml.NewYAMLOrJSONDecoder(strings.NewReader(`{"spec":`+tt.spec+`}`), 1024).Decode(p); err != nil {
				t.Fatal(err)
			}
			p.Name, p.Namespace = "bad", ns
			err := k8s.Create(context.Background(), p)
			if err == nil {
				_ = k8s.Delete(context.Background(), p)
				t.Fatalf("the API server accepted %s", tt.spec)
			}
			if !apierrors.IsInvalid(err) {
				t.Fatalf("error is not a validation error: %v", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("message %q does not contain %q", err.Error(), w)
				}
			}
		})
	}
}

func TestDefaultsAreApplied(t *testing.T) {
	ns := newNamespace(t)
	p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "empty", Namespace: ns}}
	p.Spec.Tools = []v1alpha1.ToolRule{{Name: "charge_*"}}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	got := getPolicy(t, ns, "empty")
	s := got.Spec
	if s.TTL == nil || s.TTL.Duration.String() != "24h0m0s" || s.Store.Type != v1alpha1.StoreMemory || s.KeyScope != v1alpha1.ScopeSession ||
		s.DefaultMode != v1alpha1.ModeAuto || s.InFlight != v1alpha1.InFlightWait || s.OnStoreUnavailable != v1alpha1.FailClosed ||
		s.MaxResultBytes == nil || s.MaxResultBytes.String() != "1Mi" || s.Tools[0].Mode != v1alpha1.ModeDeduplicate {
		t.Errorf("defaults not applied: %+v", s)
	}
	eventually(t, "Ready", func() error {
		p := getPolicy(t, ns, "empty")
		if p.Status.PolicyHash == "" || p.Status.Store == nil || p.Status.Store.Endpoint != "memory" {
			return fmt.Errorf("status %+v", p.Status)
		}
		return condition(p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonReady)
	})
}

func managedPolicy(ns, name string) *v1alpha1.IdempotencyPolicy {
	return &v1alpha1.IdempotencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{
			Type:  v1alpha1.StoreRedis,
			Redis: &v1alpha1.RedisStoreSpec{Managed: &v1alpha1.ManagedRedis{}},
		}},
	}
}

func TestManagedRedis(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	p := managedPolicy(ns, "payments")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "payments-redis"}
	var secret corev1.Secret
	var dep appsv1.Deployment
	var svc corev1.Service
	eventually(t, "the Secret, Deployment and Service", func() error {
		return errors.Join(k8s.Get(ctx, key, &secret), k8s.Get(ctx, key, &dep), k8s.Get(ctx, key, &svc))
	})
	uid := getPolicy(t, ns, "payments").UID
	for _, o := range []client.Object{&secret, &dep, &svc} {
		if ref := metav1.GetControllerOf(o); ref == nil || ref.UID != uid || ref.Kind != "IdempotencyPolicy" {
			t.Errorf("%T %s is not owned by the policy: %v", o, o.GetName(), o.GetOwnerReferences())
		}
	}
	password := string(secret.Data["password"])
	if len(password) < 32 || !strings.Contains(string(secret.Data["redis.conf"]), "requirepass "+password) {
		t.Errorf("secret holds password %q and redis.conf %q", password, secret.Data["redis.conf"])
	}
	c := dep.Spec.Template.Spec.Containers[0]
	args := strings.Join(c.Args, " ")
	for _, want := range []string{"/etc/redis/redis.conf", "--appendonly yes", "--maxmemory-policy noeviction", "--maxmemory 201326592"} {
		if !strings.Contains(args, want) {
			t.Errorf("redis args %q lack %q", args, want)
		}
	}
	if c.Image != "redis:7.4-alpine" || *dep.Spec.Replicas != 1 || dep.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
		t.Errorf("deployment: image %s replicas %d strategy %s", c.Image, *dep.Spec.Replicas, dep.Spec.Strategy.Type)
	}
	if sc := c.SecurityContext; sc == nil || !*sc.RunAsNonRoot || !*sc.ReadOnlyRootFilesystem || *sc.AllowPrivilegeEscalation {
		t.Errorf("redis security context %+v", sc)
	}
	if svc.Spec.Ports[0].Port != 6379 || svc.Spec.Selector["app.kubernetes.io/instance"] != "payments-redis" {
		t.Errorf("service %+v", svc.Spec)
	}

	// Not available yet: StoreReady False.
	eventually(t, "StoreReady False while Redis is not available", func() error {
		return condition(getPolicy(t, ns, "payments"), v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonRedisProvisioning)
	})
	// envtest runs no kubelet: report the Deployment available by hand.
	dep.Status = appsv1.DeploymentStatus{Replicas: 1, ReadyReplicas: 1, AvailableReplicas: 1, ObservedGeneration: dep.Generation}
	if err := k8s.Status().Update(ctx, &dep); err != nil {
		t.Fatal(err)
	}
	eventually(t, "StoreReady True once Redis is available", func() error {
		p := getPolicy(t, ns, "payments")
		if p.Status.Store == nil || p.Status.Store.Endpoint != "payments-redis."+ns+".svc:6379" {
			return fmt.Errorf("endpoint %+v", p.Status.Store)
		}
		return errors.Join(condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable),
			condition(p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonReady))
	})

	// Someone edits the Deployment by hand: it is put back.
	dep.Spec.Template.Spec.Containers[0].Args = []string{"--maxmemory-policy", "allkeys-lru"}
	if err := k8s.Update(ctx, &dep); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the hand edit to be repaired", func() error {
		if err := k8s.Get(ctx, key, &dep); err != nil {
			return err
		}
		if a := strings.Join(dep.Spec.Template.Spec.Containers[0].Args, " "); !strings.Contains(a, "noeviction") {
			return fmt.Errorf("args still %q", a)
		}
		return nil
	})
	// Someone deletes it: it comes back.
	oldUID := dep.UID
	if err := k8s.Delete(ctx, &dep); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the deleted Deployment to be recreated", func() error {
		if err := k8s.Get(ctx, key, &dep); err != nil {
			return err
		}
		if dep.UID == oldUID {
			return errors.New("still the old one")
		}
		return nil
	})

	// A new image rolls the Deployment; the password never changes.
	p = getPolicy(t, ns, "payments")
	p.Spec.Store.Redis.Managed.Image = "redis:8.0-alpine"
	if err := k8s.Update(ctx, p); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the new image in the pod template", func() error {
		if err := k8s.Get(ctx, key, &dep); err != nil {
			return err
		}
		if img := dep.Spec.Template.Spec.Containers[0].Image; img != "redis:8.0-alpine" {
			return fmt.Errorf("image %s", img)
		}
		return nil
	})
	if err := k8s.Get(ctx, key, &secret); err != nil {
		t.Fatal(err)
	}
	if string(secret.Data["password"]) != password {
		t.Error("the Redis password changed across reconciles")
	}
	assertEvent(t, ns, "payments", "Created", "Created Deployment payments-redis")
}

func TestManagedRedisWithStorageUsesAStatefulSet(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	p := managedPolicy(ns, "orders")
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "orders-redis"}
	eventually(t, "the Deployment", func() error { return k8s.Get(ctx, key, &appsv1.Deployment{}) })
	p = getPolicy(t, ns, "orders")
	q := resource.MustParse("2Gi")
	p.Spec.Store.Redis.Managed.Storage = &q
	if err := k8s.Update(ctx, p); err != nil {
		t.Fatal(err)
	}
	var sts appsv1.StatefulSet
	eventually(t, "a StatefulSet with a volume claim, and no Deployment", func() error {
		if err := k8s.Get(ctx, key, &sts); err != nil {
			return err
		}
		if err := k8s.Get(ctx, key, &appsv1.Deployment{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("deployment still there: %w", err)
		}
		return nil
	})
	vct := sts.Spec.VolumeClaimTemplates
	if len(vct) != 1 || vct[0].Spec.Resources.Requests.Storage().String() != "2Gi" {
		t.Errorf("volume claim templates %+v", vct)
	}
}

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
		if msg := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady).Message; !strings.Contains(msg, ns+"/redis-auth") {
			return fmt.Errorf("message %q does not name the Secret", msg)
		}
		return condition(p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady)
	})
	assertEvent(t, ns, "msgs", v1alpha1.ReasonSecretNotFound, "redis-auth")
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "redis-auth", Namespace: ns}, StringData: map[string]string{"password": "s3cret"}}
	if err := k8s.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "recovery once the Secret exists", func() error {
		p := getPolicy(t, ns, "msgs")
		if p.Status.Store == nil || p.Status.Store.Endpoint != "redis.shared.svc:6379" {
			return fmt.Errorf("endpoint %+v", p.Status.Store)
		}
		return errors.Join(condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonExternalRedis),
			condition(p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonReady))
	})
}

func TestMemoryStoreSharedByPodsWarns(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "mem", Namespace: ns}}); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("mcp-%d", i), Namespace: ns, Labels: map[string]string{v1alpha1.LabelPolicy: "mem"}},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}}},
		}
		if err := k8s.Create(ctx, pod); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "the shared-memory warning", func() error {
		p := getPolicy(t, ns, "mem")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonMemoryStoreShared); err != nil {
			return err
		}
		if msg := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady).Message; !strings.Contains(msg, "2 pods") || !strings.Contains(msg, "Redis") {
			return fmt.Errorf("message %q", msg)
		}
		return nil
	})
	assertEvent(t, ns, "mem", v1alpha1.ReasonMemoryStoreShared, "2 pods")
}

func assertEvent(t *testing.T, ns, policy, reason, text string) {
	t.Helper()
	eventually(t, "event "+reason, func() error {
		var evs eventsv1.EventList
		if err := k8s.List(context.Background(), &evs, client.InNamespace(ns)); err != nil {
			return err
		}
		for _, e := range evs.Items {
			if e.Regarding.Name == policy && e.Reason == reason && strings.Contains(e.Note, text) {
				return nil
			}
		}
		return fmt.Errorf("no %s event with %q among %d", reason, text, len(evs.Items))
	})
}
