// Package install_test runs the manager as installed by config/default
// against a real API server: no certificates anywhere at the start.
package install_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/test/envtestutil"
	"github.com/idemcp/idemcp/webhook"
)

var (
	cfg     *rest.Config
	testEnv *envtest.Environment
)

func TestMain(m *testing.M) {
	if !envtestutil.Available() {
		os.Exit(0)
	}
	testEnv = &envtest.Environment{}
	os.Exit(envtestutil.Run(testEnv, func(c *rest.Config) int {
		cfg = c
		return m.Run()
	}))
}

// adminKubeconfig writes a kubeconfig of a cluster admin for kubectl.
func adminKubeconfig(t *testing.T) string {
	t.Helper()
	user, err := testEnv.ControlPlane.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	kcPath := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kcPath, kubeconfig, 0o600); err != nil {
		t.Fatal(err)
	}
	return kcPath
}

// TestManagerIssuesItsWebhookCertificate: kubectl apply -k config/default,
// then the manager starts with no Secret; it creates one, serves the
// webhook with it, and the caBundle the API server uses matches.
func TestManagerIssuesItsWebhookCertificate(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	kcPath := adminKubeconfig(t)
	kubectl := filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "kubectl")
	if out, err := exec.Command(kubectl, "--kubeconfig", kcPath, "apply", "--server-side", "-k", "../../config/default").CombinedOutput(); err != nil {
		t.Fatalf("kubectl apply -k config/default: %v\n%s", err, out)
	}

	k8s, err := client.New(cfg, client.Options{Scheme: manager.NewScheme()})
	if err != nil {
		t.Fatal(err)
	}
	secretKey := client.ObjectKey{Namespace: "idemcp-system", Name: "idemcp-webhook-server-cert"}
	if err := k8s.Get(ctx, secretKey, &corev1.Secret{}); err == nil {
		t.Fatal("a webhook Secret exists before the manager ran")
	}

	port := freeport.LoopbackPort(t)
	certDir := t.TempDir()
	mgr, err := manager.New(cfg, manager.Options{
		MetricsAddr: "0", ProbeAddr: "0", Namespace: "idemcp-system", MissingPolicy: "deny",
		Sidecar:     webhook.DefaultConfig("ghcr.io/idemcp/idemcp:test"),
		WebhookHost: "127.0.0.1", WebhookPort: port, WebhookCertDir: certDir,
		WebhookCertManagement: "self",
	})
	if err != nil {
		t.Fatalf("starting the manager with no certificate: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
	}()

	var secret corev1.Secret
	if err := k8s.Get(ctx, secretKey, &secret); err != nil {
		t.Fatalf("the manager did not create its Secret: %v", err)
	}
	var mwc admissionregistrationv1.MutatingWebhookConfiguration
	envtestutil.Eventually(t, "the caBundle to match the Secret", func() error {
		if err := k8s.Get(ctx, client.ObjectKey{Name: "idemcp-mutating-webhook-configuration"}, &mwc); err != nil {
			return err
		}
		if got := string(mwc.Webhooks[0].ClientConfig.CABundle); got != string(secret.Data["ca.crt"]) || got == "" {
			return fmt.Errorf("caBundle %q", got)
		}
		return nil
	})

	// The installed namespaceSelector leaves out the namespace the manager
	// was installed into, so labelling it by mistake cannot lock it out.
	if sel := mwc.Webhooks[0].NamespaceSelector; sel == nil || len(sel.MatchExpressions) != 1 ||
		strings.Join(sel.MatchExpressions[0].Values, ",") != "kube-system,idemcp-system" {
		t.Errorf("namespaceSelector %+v, want kubernetes.io/metadata.name NotIn [kube-system idemcp-system]", sel)
	}

	// The webhook answers TLS with a certificate the caBundle verifies
	// under the Service's name, as the API server checks it.
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(mwc.Webhooks[0].ClientConfig.CABundle) {
		t.Fatal("caBundle holds no certificate")
	}
	envtestutil.Eventually(t, "a verified TLS handshake with the webhook", func() error {
		conn, err := tls.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port), &tls.Config{
			RootCAs: roots, ServerName: "idemcp-webhook-service.idemcp-system.svc", MinVersion: tls.VersionTLS12,
		})
		if err != nil {
			return err
		}
		return conn.Close()
	})
}
