package plugin_test

import (
	"encoding/json"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/plugin"
)

// grant gives user the namespace's read access that view has (no
// Secrets), plus what extra grants.
func grant(t *testing.T, ns, user string, extra ...rbacv1.PolicyRule) {
	t.Helper()
	rules := append([]rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods", "limitranges", "services"}, Verbs: []string{"get", "list"}},
		{APIGroups: []string{v1alpha1.GroupVersion.Group}, Resources: []string{"idempotencypolicies"}, Verbs: []string{"get", "list"}},
	}, extra...)
	create(t, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: user, Namespace: ns}, Rules: rules})
	create(t, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: user, Namespace: ns},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: user},
		Subjects: []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: "User", Name: user}}})
}

func checkInjectAs(t *testing.T, user, ns, pod string) plugin.Verdict {
	t.Helper()
	out, errOut, code := run(t, "--as", user, "check-inject", pod, "-n", ns, "-o", "json")
	if code != 0 {
		t.Fatalf("check-inject %s/%s as %s: exit %d: %s", ns, pod, user, code, errOut)
	}
	var vs []plugin.Verdict
	if err := json.Unmarshal([]byte(out), &vs); err != nil || len(vs) != 1 {
		t.Fatalf("check-inject -o json: %v: %s", err, out)
	}
	return vs[0]
}

// TestCheckInjectNeverReadsASecret: docs/plugin.md says the plugin never
// needs a Secret. A user of the view role (no Secrets) gets a verdict that
// says what it could not check, not "forbidden"; a user who may get
// Secrets has their labels checked from metadata alone, and whether they
// hold the key is said to be unchecked. Before, check-inject read whole
// Secrets with its user's credentials, and a view user's verdict was only
// "could not run the webhook's decision with your permissions".
func TestCheckInjectNeverReadsASecret(t *testing.T) {
	ns := newNamespace(t, "ci-secrets", true)
	spec := v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{
		Addresses: []string{"redis:6379"}, PasswordSecretRef: &v1alpha1.SecretKeyRef{Name: "redis-auth", Key: "password"}}}}}
	readyPolicy(t, ns, "payments", spec, 0)
	unlabelled := v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{
		Addresses: []string{"redis:6379"}, PasswordSecretRef: &v1alpha1.SecretKeyRef{Name: "database", Key: "password"}}}}}
	readyPolicy(t, ns, "other", unlabelled, 0)
	// Labelled, but without the key the policy names.
	create(t, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "redis-auth", Namespace: ns, Labels: map[string]string{v1alpha1.LabelCredentials: "true"}}, StringData: map[string]string{"pass": "x"}})
	create(t, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "database", Namespace: ns}, StringData: map[string]string{"password": "hunter2"}})
	create(t, mcpPod(ns, "mcp-0", "payments"))
	create(t, mcpPod(ns, "mcp-1", "other"))
	grant(t, ns, "viewer")
	grant(t, ns, "secret-getter", rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get"}})

	v := checkInjectAs(t, "viewer", ns, "mcp-0")
	text := strings.Join(v.Reasons, "\n")
	want := "not checked: whether Secret " + ns + `/redis-auth (spec.store.redis.external.passwordSecretRef) exists and carries the label idemcp.io/credentials: "true": reading its metadata needs get on secrets`
	if !v.WouldInject || !strings.Contains(text, want) || strings.Contains(text, "could not run the webhook's decision") {
		t.Errorf("as a view user: would inject %t, reasons:\n%s\nwant a verdict, and %q", v.WouldInject, text, want)
	}

	v = checkInjectAs(t, "secret-getter", ns, "mcp-0")
	text = strings.Join(v.Reasons, "\n")
	want = "not checked: whether Secret " + ns + `/redis-auth (spec.store.redis.external.passwordSecretRef) has the key "password": that needs the Secret's data, which kubectl idemcp never reads`
	if !v.WouldInject || !strings.Contains(text, want) {
		t.Errorf("as a user who may get Secrets: would inject %t, reasons:\n%s\nwant %q", v.WouldInject, text, want)
	}
	v = checkInjectAs(t, "secret-getter", ns, "mcp-1")
	if text := strings.Join(v.Reasons, "\n"); !v.Refused || !strings.Contains(text, "Secret "+ns+`/database (spec.store.redis.external.passwordSecretRef) lacks the label idemcp.io/credentials: "true"`) {
		t.Errorf("an unlabelled Secret, read as metadata: refused %t, reasons:\n%s", v.Refused, text)
	}
}
