package install_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemcp/idemcp/test/testdeps"
)

// TestInstallersPassServerValidation: what users install, dist/install.yaml
// and the Helm chart, is accepted by a real API server (a server-side dry
// run validates every object against the API's schemas, CRDs included).
func TestInstallersPassServerValidation(t *testing.T) {
	kubectl := filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "kubectl")
	kc := adminKubeconfig(t)
	run := func(stdin []byte, name string, args ...string) []byte {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Stdin = bytes.NewReader(stdin)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", filepath.Base(name), strings.Join(args, " "), err, out)
		}
		return out
	}
	// A dry run creates nothing, so the namespace the objects go to must exist.
	ns := []byte("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: idemcp-system\n")
	run(ns, kubectl, "--kubeconfig", kc, "apply", "--server-side", "-f", "-")

	install, err := os.ReadFile("../../dist/install.yaml")
	if err != nil {
		t.Fatalf("dist/install.yaml (make build-installer writes it): %v", err)
	}
	out := run(install, kubectl, "--kubeconfig", kc, "apply", "--server-side", "--dry-run=server", "-f", "-")
	for _, want := range []string{"customresourcedefinition.apiextensions.k8s.io/idempotencypolicies.idemcp.io", "deployment.apps/idemcp-manager", "mutatingwebhookconfiguration.admissionregistration.k8s.io/"} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("dist/install.yaml dry run does not show %s:\n%s", want, out)
		}
	}

	helm := os.Getenv("HELM")
	if helm == "" {
		testdeps.Missing(t, "HELM is not set: run through make test, which installs helm into bin/")
	}
	chart := run(nil, helm, "template", "idemcp", "../../dist/chart", "--namespace", "idemcp-system", "--include-crds",
		"--set", "image.repository=registry.example.com/idemcp", "--set", "image.tag=v9.9.9", "--set", "replicas=3",
		"--set", "resources.limits.memory=2Gi")
	if !bytes.Contains(chart, []byte("image: \"registry.example.com/idemcp:v9.9.9\"")) || !bytes.Contains(chart, []byte("replicas: 3")) {
		t.Errorf("helm template did not apply the values image and replicas:\n%s", chart)
	}
	// A manager that serves more sidecars needs more memory than the
	// default limit: the value replaces it, and the request stays.
	if want := "resources:\n          limits:\n            memory: 2Gi\n          requests:\n            cpu: 50m\n            memory: 64Mi\n"; !bytes.Contains(chart, []byte(want)) {
		t.Errorf("helm template did not give the manager the resources value (want %q):\n%s", want, chart)
	}
	out = run(chart, kubectl, "--kubeconfig", kc, "apply", "--server-side", "--dry-run=server", "-f", "-")
	if !bytes.Contains(out, []byte("deployment.apps/idemcp-manager")) {
		t.Errorf("the chart's dry run does not show the manager:\n%s", out)
	}
}
