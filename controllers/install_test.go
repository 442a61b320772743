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
	for _, want := range []string{"namespace/idemcp-system", "customresourcedefinition.apiextensions.k8s.io/idempotencypolicies.idemcp.io", "deployment.apps/idemcp-manager", "clusterrole.rbac.authorization.k8s.io/idemcp-manager-role"} {
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
		{"create", "deployments.apps", true},
		{"create", "secrets", true},
		{"get", "secrets", true},
		{"list", "secrets", false},
		{"watch", "secrets", false},
		{"delete", "secrets", false},
		{"create", "events.events.k8s.io", true},
		{"delete", "pods", false},
	}
	for _, tt := range tests {
		args := append([]string{"--kubeconfig", kubeconfig, "auth", "can-i", tt.verb}, strings.Fields(tt.resource)...)
		out, _ := exec.Command(kubectl, append(args, "--as", sa, "-n", "shop")...).CombinedOutput()
		got := strings.TrimSpace(string(out))
		want := map[bool]string{true: "yes", false: "no"}[tt.allowed]
		if !strings.HasPrefix(got, want) {
			t.Errorf("can the manager %s %s? %q, want %s", tt.verb, tt.resource, got, want)
		}
	}
}
