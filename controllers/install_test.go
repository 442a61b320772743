package controllers_test

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestInstallManifests applies what README's install step applies and
// checks that the manager's RBAC is least privilege: enough to reconcile,
// no list or watch on Secrets.
func TestInstallManifests(t *testing.T) {
	kubectl := filepath.Join(assetsDir, "kubectl")
	kubeconfig := writeKubeconfig(t)
	out, err := exec.Command(kubectl, "--kubeconfig", kubeconfig, "apply", "--server-side", "-k", "../config/default").CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl apply -k config/default: %v\n%s", err, out)
	}
	for _, want := range []string{"namespace/idemcp-system", "poddisruptionbudget.policy/idemcp-manager",
		"clusterrole.rbac.authorization.k8s.io/idemcp-idempotencypolicy-editor-role", "clusterrole.rbac.authorization.k8s.io/idemcp-idempotencypolicy-viewer-role",
		"clusterrole.rbac.authorization.k8s.io/idemcp-metrics-reader", "customresourcedefinition.apiextensions.k8s.io/idempotencypolicies.idemcp.io", "deployment.apps/idemcp-manager", "clusterrole.rbac.authorization.k8s.io/idemcp-manager-role"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("apply output lacks %s:\n%s", want, out)
		}
	}
	sa := "system:serviceaccount:idemcp-system:idemcp-manager"
	tests := []struct {
		verb, resource string
		allowed        bool
	}{
		{"watch", "idempotencypolicies.idemcp.io", true},
		{"patch", "idempotencypolicies.idemcp.io --subresource=status", true},
		{"update", "idempotencypolicies.idemcp.io", false}, // the spec is the user's
		{"patch", "idempotencypolicies.idemcp.io", true},   // its finalizer
		// blockOwnerDeletion under OwnerReferencesPermissionEnforcement
		{"update", "idempotencypolicies.idemcp.io --subresource=finalizers", true},
		{"create", "statefulsets.apps", true},
		{"create", "poddisruptionbudgets.policy", true},
		{"create", "networkpolicies.networking.k8s.io", true},
		// An IdempotentProxy's data plane; and an earlier idemcp's Redis
		// Deployment is deleted.
		{"create", "deployments.apps", true},
		{"watch", "idempotentproxies.idemcp.io", true},
		{"patch", "idempotentproxies.idemcp.io --subresource=status", true},
		{"update", "idempotentproxies.idemcp.io", false}, // the spec is the user's
		{"update", "idempotentproxies.idemcp.io --subresource=finalizers", true},
		{"get", "configmaps", true}, // a proxy's CA bundle
		{"list", "configmaps", false},
		{"create", "secrets", true},
		{"get", "secrets", true},
		// The metadata watch of Secrets labelled idemcp.io/credentials
		// needs list and watch; RBAC cannot narrow them by label.
		{"list", "secrets", true},
		{"watch", "secrets", true},
		{"update", "secrets", false},
		{"delete", "secrets", false},
		{"create", "tokenreviews.authentication.k8s.io", true},
		{"create", "events.events.k8s.io", true},
		{"delete", "pods", false},
	}
	for _, tt := range tests {
		args := append([]string{"--kubeconfig", kubeconfig, "auth", "can-i", tt.verb}, strings.Fields(tt.resource)...)
		out, _ := exec.Command(kubectl, append(args, "--as", sa, "-n", "shop")...).CombinedOutput()
		lines := strings.Split(strings.TrimSpace(string(out)), "\n") // after any warning
		got := strings.TrimSpace(lines[len(lines)-1])
		want := map[bool]string{true: "yes", false: "no"}[tt.allowed]
		if !strings.HasPrefix(got, want) {
			t.Errorf("can the manager %s %s? %q, want %s", tt.verb, tt.resource, got, want)
		}
	}
}

// TestPolicyRolesAggregate: namespace editors and viewers get policies
// through the built-in edit, admin and view roles.
func TestPolicyRolesAggregate(t *testing.T) {
	kubectl := filepath.Join(assetsDir, "kubectl")
	kubeconfig := writeKubeconfig(t)
	if out, err := exec.Command(kubectl, "--kubeconfig", kubeconfig, "apply", "--server-side", "-k", "../config/default").CombinedOutput(); err != nil {
		t.Fatalf("kubectl apply -k config/default: %v\n%s", err, out)
	}
	for role, want := range map[string]string{
		"idemcp-idempotencypolicy-editor-role": "aggregate-to-edit",
		"idemcp-idempotencypolicy-viewer-role": "aggregate-to-view",
		"idemcp-idempotentproxy-editor-role":   "aggregate-to-edit",
		"idemcp-idempotentproxy-viewer-role":   "aggregate-to-view",
	} {
		out, err := exec.Command(kubectl, "--kubeconfig", kubeconfig, "get", "clusterrole", role, "-o", "jsonpath={.metadata.labels}").CombinedOutput()
		if err != nil || !strings.Contains(string(out), want) {
			t.Errorf("clusterrole %s labels %s (%v), want %s", role, out, err, want)
		}
	}
}
