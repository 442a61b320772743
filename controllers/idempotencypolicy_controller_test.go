package controllers_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
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
	if strings.Join(header, " ") != "NAME STORE TTL RETRY-WINDOW SYNCED READY AGE" {
		t.Errorf("kubectl get idpol columns = %v, want NAME STORE TTL RETRY-WINDOW SYNCED READY AGE\n%s", header, out)
	}
	if !strings.Contains(string(out), "10m") {
		t.Errorf("kubectl get idpol shows no retry window (default 10m):\n%s", out)
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
		{"store type", `{"store":{"type":"Mongo"}}`, []string{"spec.store.type", `"Memory", "Redis", "Postgres"`}},
		{"postgres without config", `{"store":{"type":"Postgres"}}`, []string{"spec.store", "type Postgres needs store.postgres.urlSecretRef"}},
		{"postgres config on memory", `{"store":{"type":"Memory","postgres":{"urlSecretRef":{"name":"pg","key":"url"}}}}`, []string{"spec.store", "store.postgres goes with type Postgres"}},
		{"postgres without secret key", `{"store":{"type":"Postgres","postgres":{"urlSecretRef":{"name":"pg","key":""}}}}`, []string{"spec.store.postgres.urlSecretRef.key"}},
		{"redis without config", `{"store":{"type":"Redis"}}`, []string{"spec.store", "exactly one of redis.managed or redis.external"}},
		{"redis with both", `{"store":{"type":"Redis","redis":{"managed":{},"external":{"addresses":["r:6379"]}}}}`, []string{"spec.store", "exactly one of"}},
		{"memory with redis", `{"store":{"type":"Memory","redis":{"managed":{}}}}`, []string{"spec.store", "type Memory takes no redis"}},
		{"external without addresses", `{"store":{"type":"Redis","redis":{"external":{"addresses":[]}}}}`, []string{"spec.store.redis.external.addresses"}},
		{"external bad address", `{"store":{"type":"Redis","redis":{"external":{"addresses":["redis.svc"]}}}}`, []string{"spec.store.redis.external.addresses[0]", "should match"}},
		{"minReplicas negative", `{"store":{"type":"Redis","redis":{"external":{"addresses":["r:6379"],"minReplicas":-1}}}}`, []string{"spec.store.redis.external.minReplicas", "greater than or equal to 0"}},
		{"minReplicas too many", `{"store":{"type":"Redis","redis":{"external":{"addresses":["r:6379"],"minReplicas":17}}}}`, []string{"spec.store.redis.external.minReplicas", "less than or equal to 16"}},
		{"minReplicasTimeout without minReplicas", `{"store":{"type":"Redis","redis":{"external":{"addresses":["r:6379"],"minReplicasTimeout":"1s"}}}}`, []string{"spec.store.redis.external", "set minReplicas above 0"}},
		{"minReplicasTimeout too long", `{"store":{"type":"Redis","redis":{"external":{"addresses":["r:6379"],"minReplicas":1,"minReplicasTimeout":"1m"}}}}`, []string{"spec.store.redis.external.minReplicasTimeout", "between 10ms and 30s"}},
		{"onStoreUnavailable", `{"onStoreUnavailable":"Ignore"}`, []string{"spec.onStoreUnavailable", `"FailClosed", "FailOpen"`}},
		{"keyScope", `{"keyScope":"User"}`, []string{"spec.keyScope", `"Session", "Principal", "Global"`}},
		{"inFlight", `{"inFlight":"Queue"}`, []string{"spec.inFlight", `"Wait", "Reject"`}},
		{"onAbandoned", `{"onAbandoned":"Ignore"}`, []string{"spec.onAbandoned", `"Retry", "Error"`}},
		{"defaultMode", `{"defaultMode":"Cache"}`, []string{"spec.defaultMode", `"Auto", "Deduplicate", "Passthrough"`}},
		{"leaseDuration", `{"leaseDuration":"100ms"}`, []string{"spec.leaseDuration", "between 1s and 1h"}},
		{"waitTimeout", `{"waitTimeout":"2h"}`, []string{"spec.waitTimeout", "between 0s and 1h"}},
		{"maxResultBytes", `{"maxResultBytes":"0"}`, []string{"spec.maxResultBytes", "more than 0 and at most 64Mi"}},
		{"maxResultBytes over 64Mi", `{"maxResultBytes":"65537Ki"}`, []string{"spec.maxResultBytes", "more than 0 and at most 64Mi"}},
		{"storage zero", `{"store":{"type":"Redis","redis":{"managed":{"storage":"0"}}}}`, []string{"spec.store.redis.managed.storage", "more than 0"}},
		{"storage negative", `{"store":{"type":"Redis","redis":{"managed":{"storage":"-1Gi"}}}}`, []string{"spec.store.redis.managed.storage", "more than 0"}},
		{"ephemeral with storage", `{"store":{"type":"Redis","redis":{"managed":{"storage":"1Gi","ephemeral":true}}}}`, []string{"spec.store.redis.managed", "ephemeral and storage exclude each other"}},
		{"managed image", `{"store":{"type":"Redis","redis":{"managed":{"image":"redis; rm -rf /"}}}}`, []string{"spec.store.redis.managed.image", "should match"}},
		{"principalHeader", `{"principalHeader":"X User"}`, []string{"spec.principalHeader"}},
		{"tool mode", `{"tools":[{"name":"a","mode":"Always"}]}`, []string{"spec.tools[0].mode", `"Auto", "Deduplicate", "Passthrough"`}},
		{"tool name not a glob", `{"tools":[{"name":"charge card!"}]}`, []string{"spec.tools[0].name", "should match '^[A-Za-z0-9_./*?-]+$'"}},
		{"tool names unique", `{"tools":[{"name":"a"},{"name":"b"},{"name":"a"}]}`, []string{"spec.tools", "tool rule names must be unique"}},
		{"ignoreArguments pointer", `{"tools":[{"name":"a","ignoreArguments":["requestedAt"]}]}`, []string{"spec.tools[0].ignoreArguments[0]", "should match"}},
		{"tool ttl", `{"tools":[{"name":"a","ttl":"1000h"}]}`, []string{"spec.tools[0].ttl", "between 1s and 720h"}},
		{"tool keyScope", `{"tools":[{"name":"a","keyScope":"Team"}]}`, []string{"spec.tools[0].keyScope"}},
		{"retryWindow too short", `{"retryWindow":"100ms"}`, []string{"spec.retryWindow", "between 1s and 720h"}},
		{"retryWindow over ttl", `{"ttl":"1h","retryWindow":"2h"}`, []string{"spec.retryWindow must be at most spec.ttl"}},
		{"tool retryWindow over its ttl", `{"tools":[{"name":"a","ttl":"1m","retryWindow":"2m"}]}`, []string{"spec.tools[].retryWindow must be at most the tool's ttl"}},
		{"tool retryWindow over spec ttl", `{"ttl":"1h","retryWindow":"1m","tools":[{"name":"a","retryWindow":"2h"}]}`, []string{"spec.tools[].retryWindow must be at most the tool's ttl"}},
		{"tool retryWindow too long", `{"tools":[{"name":"a","retryWindow":"1000h"}]}`, []string{"spec.tools[0].retryWindow", "between 1s and 720h"}},
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

// TestShortTTLNeedsNoRetryWindow: a policy with a ttl under the default
// window of 10m, valid before retryWindow existed, is still accepted, and
// so is a rule with a short ttl under an explicit spec.retryWindow: a window
// nobody wrote is capped at the ttl beside it.
func TestShortTTLNeedsNoRetryWindow(t *testing.T) {
	ns := newNamespace(t)
	for i, spec := range []string{
		`{"ttl":"5m"}`,
		`{"ttl":"5m","tools":[{"name":"a","ttl":"1m"}]}`,
		`{"ttl":"1h","retryWindow":"30m","tools":[{"name":"a","ttl":"1m"}]}`,
	} {
		p := &v1alpha1.IdempotencyPolicy{}
		if err := yaml.NewYAMLOrJSONDecoder(strings.NewReader(`{"spec":`+spec+`}`), 1024).Decode(p); err != nil {
			t.Fatal(err)
		}
		p.Name, p.Namespace = fmt.Sprintf("short-%d", i), ns
		if err := k8s.Create(context.Background(), p); err != nil {
			t.Errorf("the API server refused %s: %v", spec, err)
		}
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
	if s.TTL == nil || s.TTL.Duration.String() != "24h0m0s" || s.RetryWindow != nil || s.Store.Type != v1alpha1.StoreMemory || s.KeyScope != v1alpha1.ScopeSession ||
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
