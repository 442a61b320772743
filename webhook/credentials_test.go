package webhook_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/credentials"
	"github.com/idemcp/idemcp/test/envtestutil"
	"github.com/idemcp/idemcp/webhook"
)

func createSecret(t *testing.T, ns, name string, labelled bool, data map[string]string) *corev1.Secret {
	t.Helper()
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, StringData: data}
	if labelled {
		s.Labels = map[string]string{v1alpha1.LabelCredentials: "true"}
	}
	if err := k8s.Create(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	return s
}

// assertPolicyEvent waits for an Event on the policy whose note has text.
func assertPolicyEvent(t *testing.T, ns, policy, reason, text string) {
	t.Helper()
	envtestutil.Eventually(t, "a "+reason+" Event", func() error {
		var list eventsv1.EventList
		if err := k8s.List(context.Background(), &list, client.InNamespace(ns)); err != nil {
			return err
		}
		for _, e := range list.Items {
			if e.Regarding.Kind == "IdempotencyPolicy" && e.Regarding.Name == policy && e.Reason == reason && strings.Contains(e.Note, text) {
				return nil
			}
		}
		return fmt.Errorf("%d events, none %s on %s with %q", len(list.Items), reason, policy, text)
	})
}

// TestSecretsNeedTheirOwnersConsent: for every Secret a policy can give a
// sidecar, an unlabelled one refuses the pod with a message naming the
// Secret and the label, and the same pod is admitted once the Secret's
// owner labels it (a Secret the policy names; the controller's own ones
// must also be the controller's). Before, the webhook injected a secretKeyRef to any
// Secret, and the sidecar sent it to whatever address the policy named.
func TestSecretsNeedTheirOwnersConsent(t *testing.T) {
	external := func(ref *v1alpha1.SecretKeyRef) v1alpha1.IdempotencyPolicySpec {
		return v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{
			Addresses: []string{"evil.example.com:6379"}, PasswordSecretRef: ref}}}}
	}
	for _, tc := range []struct {
		field  string
		spec   v1alpha1.IdempotencyPolicySpec
		secret string
		env    string
		data   map[string]string
	}{
		{"spec.store.redis.external.passwordSecretRef", external(&v1alpha1.SecretKeyRef{Name: "database", Key: "password"}), "database", "IDEMCP_REDIS_PASSWORD", map[string]string{"password": "hunter2"}},
		{"spec.store.postgres.urlSecretRef", v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StorePostgres,
			Postgres: &v1alpha1.PostgresStoreSpec{URLSecretRef: v1alpha1.SecretKeyRef{Name: "database", Key: "url"}}}}, "database", "IDEMCP_POSTGRES_URL", map[string]string{"url": "postgres://u:hunter2@db:5432/db"}},
		// A policy named after an existing Secret: its managed Redis's
		// password Secret would be that one.
		{"the managed Redis's password", managedSpec(), "payments-redis", "IDEMCP_REDIS_PASSWORD", map[string]string{"password": "hunter2"}},
		{"the seal keys", external(nil), "payments-seal", "IDEMCP_SEAL_KEYS", map[string]string{"keys": "c2VjcmV0"}},
	} {
		t.Run(tc.field, func(t *testing.T) {
			ctx := context.Background()
			ns := namespace(t, true)
			secret := createSecret(t, ns, tc.secret, false, tc.data)
			createPolicy(t, ns, "payments", tc.spec)
			err := k8s.Create(ctx, mcpPod(ns, "mcp-0", optIn))
			want := fmt.Sprintf(`Secret %s/%s (%s) lacks the label idemcp.io/credentials: "true"`, ns, tc.secret, tc.field)
			if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "kubectl -n "+ns+" label secret "+tc.secret+" idemcp.io/credentials=true") {
				t.Fatalf("creating the pod: %v\nwant a refusal with %q and the command that adds the label", err, want)
			}
			assertPolicyEvent(t, ns, "payments", "InjectionRefused", want)

			secret.Labels = map[string]string{credentials.Label: credentials.Value}
			if err := k8s.Update(ctx, secret); err != nil {
				t.Fatal(err)
			}
			pod := mcpPod(ns, "mcp-0", optIn)
			err = k8s.Create(ctx, pod)
			if strings.HasPrefix(tc.secret, "payments-") {
				// The controller's own Secrets: the label is not enough
				// (TestManagedSecretMadeBySomeoneElseIsRefused).
				if err == nil || !strings.Contains(err.Error(), "is not controlled by IdempotencyPolicy "+ns+"/payments") {
					t.Errorf("the pod once a managed Secret made by someone else is labelled: %v, want a refusal", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("the pod once the Secret is labelled: %v", err)
			}
			c, _ := sidecarOf(t, pod)
			if e := envValue(c, tc.env); e == nil || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil || e.ValueFrom.SecretKeyRef.Name != tc.secret {
				t.Errorf("%s = %+v, want a secretKeyRef to %s", tc.env, e, tc.secret)
			}
		})
	}
}

// TestMissingSecretIsRefusedUntilItExistsLabelled: a pod whose policy
// names a Secret that does not exist yet is refused, naming the Secret,
// the field and the label. Before, it was admitted with a secretKeyRef,
// and the kubelet handed the sidecar the Secret once someone created it,
// unlabelled, to send to whatever address the policy named. The same pod
// is refused while the Secret is unlabelled, and admitted once labelled.
func TestMissingSecretIsRefusedUntilItExistsLabelled(t *testing.T) {
	for _, tc := range []struct {
		field string
		spec  v1alpha1.IdempotencyPolicySpec
		data  map[string]string
	}{
		{"spec.store.redis.external.passwordSecretRef", v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{
			Addresses: []string{"evil.example.com:6379"}, PasswordSecretRef: &v1alpha1.SecretKeyRef{Name: "database", Key: "password"}}}}}, map[string]string{"password": "hunter2"}},
		{"spec.store.postgres.urlSecretRef", v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StorePostgres,
			Postgres: &v1alpha1.PostgresStoreSpec{URLSecretRef: v1alpha1.SecretKeyRef{Name: "database", Key: "url"}}}}, map[string]string{"url": "postgres://u:hunter2@db:5432/db"}},
	} {
		t.Run(tc.field, func(t *testing.T) {
			ctx := context.Background()
			ns := namespace(t, true)
			createPolicy(t, ns, "payments", tc.spec)
			err := k8s.Create(ctx, mcpPod(ns, "mcp-0", optIn))
			want := fmt.Sprintf(`Secret %s/database (%s) does not exist: idemcp gives the sidecar a Secret only once it exists and carries the label idemcp.io/credentials: "true"`, ns, tc.field)
			if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "kubectl -n "+ns+" label secret database idemcp.io/credentials=true") {
				t.Fatalf("creating the pod: %v\nwant a refusal with %q and the command that adds the label", err, want)
			}
			assertPolicyEvent(t, ns, "payments", "InjectionRefused", want)

			secret := createSecret(t, ns, "database", false, tc.data)
			err = k8s.Create(ctx, mcpPod(ns, "mcp-0", optIn))
			if want := "lacks the label idemcp.io/credentials"; err == nil || !strings.Contains(err.Error(), want) {
				t.Fatalf("once the Secret exists unlabelled: %v, want a refusal with %q", err, want)
			}
			secret.Labels = map[string]string{credentials.Label: credentials.Value}
			if err := k8s.Update(ctx, secret); err != nil {
				t.Fatal(err)
			}
			if err := k8s.Create(ctx, mcpPod(ns, "mcp-0", optIn)); err != nil {
				t.Fatalf("the pod once the Secret is labelled: %v", err)
			}
		})
	}
}

// TestManagedSecretMadeBySomeoneElseIsRefused: NAME-redis and NAME-seal
// are the controller's own. One made beforehand, labelled, by someone who
// may create Secrets (to choose the sidecars' password or seal keys) is
// refused, naming it, as the controller refuses it (RedisObjectConflict).
// Before, the label alone was enough for the webhook.
func TestManagedSecretMadeBySomeoneElseIsRefused(t *testing.T) {
	shared := v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{
		Addresses: []string{"redis:6379"}}}}}
	for _, tc := range []struct {
		field, secret string
		spec          v1alpha1.IdempotencyPolicySpec
		data          map[string]string
	}{
		{"the managed Redis's password", "payments-redis", managedSpec(), map[string]string{"password": "chosen", "redis.conf": "requirepass chosen\n"}},
		{"the seal keys", "payments-seal", shared, map[string]string{"keys": "k1:c2VjcmV0"}},
	} {
		t.Run(tc.field, func(t *testing.T) {
			ns := namespace(t, true)
			createSecret(t, ns, tc.secret, true, tc.data)
			createPolicy(t, ns, "payments", tc.spec)
			err := k8s.Create(context.Background(), mcpPod(ns, "mcp-0", optIn))
			want := fmt.Sprintf("Secret %s/%s (%s) is not controlled by IdempotencyPolicy %s/payments: idemcp makes this Secret itself and gives the sidecar only its own", ns, tc.secret, tc.field, ns)
			if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "RedisObjectConflict") {
				t.Fatalf("creating the pod: %v\nwant a refusal with %q", err, want)
			}
		})
	}
}

// TestManagedSecretsMayBeMissingAtAdmission: the Secrets the controller
// makes for a policy (NAME-redis, NAME-seal) are made labelled, so a pod
// admitted the moment its policy is created, before them, is injected.
func TestManagedSecretsMayBeMissingAtAdmission(t *testing.T) {
	s := runtime.NewScheme()
	if err := errors.Join(clientgoscheme.AddToScheme(s), v1alpha1.AddToScheme(s)); err != nil {
		t.Fatal(err)
	}
	p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "payments", Namespace: "shop"}, Spec: managedSpec()}
	inj := &webhook.Injector{Client: fake.NewClientBuilder().WithScheme(s).WithObjects(p).Build(), Config: sidecar, ManagerNamespace: "idemcp-system", MissingPolicy: webhook.MissingPolicyDeny}
	ctx := admission.NewContextWithRequest(context.Background(), admission.Request{AdmissionRequest: admissionv1.AdmissionRequest{Namespace: "shop", DryRun: ptr.To(true)}})
	pod := mcpPod("shop", "mcp-0", optIn)
	if _, err := inj.Decide(ctx, pod); err != nil || !webhook.Injected(pod) {
		t.Fatalf("a managed Redis policy's pod before its Secrets exist: err %v, injected %t", err, webhook.Injected(pod))
	}
}

// TestEverySecretOfTheSidecarIsChecked: the secretKeyRefs the webhook
// injects are exactly the ones credentials.Refs lists (and Check checks).
func TestEverySecretOfTheSidecarIsChecked(t *testing.T) {
	for _, spec := range []v1alpha1.IdempotencyPolicySpec{
		managedSpec(),
		maxPolicy(0),
		{Store: v1alpha1.StoreSpec{Type: v1alpha1.StorePostgres, Postgres: &v1alpha1.PostgresStoreSpec{URLSecretRef: v1alpha1.SecretKeyRef{Name: "db", Key: "url"}}}},
	} {
		p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "payments", Namespace: "shop"}, Spec: spec}
		pod := mcpPod("shop", "mcp-0", optIn)
		if err := webhook.Inject(pod, p, "hash", sidecar); err != nil {
			t.Fatal(err)
		}
		want := map[string]bool{}
		for _, r := range credentials.Refs(p) {
			want[r.Env+"="+r.Name+"/"+r.Key] = true
		}
		got := map[string]bool{}
		for _, c := range append(pod.Spec.InitContainers, pod.Spec.Containers...) {
			for _, e := range c.Env {
				if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
					got[e.Name+"="+e.ValueFrom.SecretKeyRef.Name+"/"+e.ValueFrom.SecretKeyRef.Key] = true
				}
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("store %s: the sidecar gets Secrets %v, credentials.Refs lists %v", spec.Store.Type, got, want)
		}
	}
}

// TestSecretWithoutItsKeyIsRefused: a pod whose sidecar would get a key
// its Secret lacks could never start; it is refused, saying so.
func TestSecretWithoutItsKeyIsRefused(t *testing.T) {
	ns := namespace(t, true)
	createSecret(t, ns, "redis-auth", true, map[string]string{"pass": "x"})
	createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{
		Addresses: []string{"redis:6379"}, PasswordSecretRef: &v1alpha1.SecretKeyRef{Name: "redis-auth", Key: "password"}}}}})
	err := k8s.Create(context.Background(), mcpPod(ns, "mcp-0", optIn))
	want := fmt.Sprintf(`Secret %s/redis-auth (spec.store.redis.external.passwordSecretRef) has no key "password", which the sidecar's IDEMCP_REDIS_PASSWORD needs: the pod could not start`, ns)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("creating the pod: %v\nwant %q", err, want)
	}
}

// TestPlainSidecarInAPodMeantToCompleteIsRefused: with the plain-container
// fallback a Job's pod would never complete (the sidecar never exits), so
// it is refused with what to do; a native sidecar is fine.
func TestPlainSidecarInAPodMeantToCompleteIsRefused(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{})
	for _, rp := range []corev1.RestartPolicy{corev1.RestartPolicyNever, corev1.RestartPolicyOnFailure} {
		pod := mcpPod(ns, "job-"+strings.ToLower(string(rp)), map[string]string{webhook.AnnotationPolicy: "payments", webhook.AnnotationNativeSidecar: "false"})
		pod.Spec.RestartPolicy = rp
		err := k8s.Create(ctx, pod)
		want := fmt.Sprintf(`the pod's restartPolicy is %s (a Job's pod, or one meant to complete), and idemcp.io/native-sidecar: "false" makes the idemcp sidecar a plain container, which never exits, so the pod would never complete`, rp)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("restartPolicy %s: %v\nwant %q", rp, err, want)
		}
	}
	native := mcpPod(ns, "job-native", optIn)
	native.Spec.RestartPolicy = corev1.RestartPolicyNever
	if err := k8s.Create(ctx, native); err != nil {
		t.Fatalf("a Job's pod with a native sidecar: %v", err)
	}
	plain := mcpPod(ns, "plain", map[string]string{webhook.AnnotationPolicy: "payments", webhook.AnnotationNativeSidecar: "false"})
	if err := k8s.Create(ctx, plain); err != nil {
		t.Fatalf("a pod of restartPolicy Always with a plain sidecar: %v", err)
	}
}

// TestInjectedEventNamesAGeneratedPodByItsWorkload: a pod from
// generateName has no name at admission; the Injected Event says whose
// pod it is instead of "mcp-<generated>".
func TestInjectedEventNamesAGeneratedPodByItsWorkload(t *testing.T) {
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{})
	pod := mcpPod(ns, "", optIn)
	pod.GenerateName = "mcp-5d8f-"
	pod.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "mcp-5d8f", UID: "0b5a3f0e-1111-4222-8333-944455556667", Controller: ptr.To(true)}}
	if err := k8s.Create(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	assertPolicyEvent(t, ns, "payments", "Injected", "Injected the idemcp sidecar into a new pod of ReplicaSet mcp-5d8f")
}

// TestTwoHundredReplicasWithCheckedSecrets: 200 pods of a managed Redis
// policy admitted 50 at a time, each with its Secrets read and checked,
// are all injected (the outside run's 200-replica case, with the checks
// this round added).
func TestTwoHundredReplicasWithCheckedSecrets(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", managedSpec())
	envtestutil.Eventually(t, "the managed Secrets", func() error {
		return errors.Join(k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "payments-redis"}, &corev1.Secret{}),
			k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "payments-seal"}, &corev1.Secret{}))
	})
	const n, parallel = 200, 50
	errs := make(chan error, n)
	sem := make(chan struct{}, parallel)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			pod := mcpPod(ns, fmt.Sprintf("mcp-%03d", i), optIn)
			if err := k8s.Create(ctx, pod); err != nil {
				errs <- err
				return
			}
			if !webhook.Injected(pod) {
				errs <- fmt.Errorf("pod %s was not injected", pod.Name)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d pods admitted, %d at a time, in %s", n, parallel, time.Since(start))
}
