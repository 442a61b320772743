package webhook_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/controllers"
	"github.com/idemcp/idemcp/test/envtestutil"
	"github.com/idemcp/idemcp/webhook"
)

const testImage = "ghcr.io/idemcp/idemcp:test"

var (
	cfg     *rest.Config
	k8s     client.Client
	testEnv *envtest.Environment
	sidecar = webhook.DefaultConfig(testImage)
)

// TestMain runs a real kube-apiserver with the webhook configuration from
// config/webhook installed, and the manager serving it.
func TestMain(m *testing.M) {
	if !envtestutil.Available() {
		os.Exit(0)
	}
	testEnv = &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join("..", "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		WebhookInstallOptions: envtest.WebhookInstallOptions{Paths: []string{filepath.Join("..", "config", "webhook", "manifests.yaml")}},
	}
	os.Exit(envtestutil.Run(testEnv, func(c *rest.Config) int {
		cfg = c
		return run(m)
	}))
}

func run(m *testing.M) int {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wh := testEnv.WebhookInstallOptions
	mgr, err := controllers.NewManager(cfg, controllers.ManagerOptions{
		MetricsAddr: "0", ProbeAddr: "0", Namespace: "idemcp-system", MissingPolicy: "deny", Sidecar: sidecar,
		WebhookHost: wh.LocalServingHost, WebhookPort: wh.LocalServingPort, WebhookCertDir: wh.LocalServingCertDir,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	go func() {
		if err := mgr.Start(ctx); err != nil {
			fmt.Fprintf(os.Stderr, "manager: %v\n", err)
		}
	}()
	if k8s, err = client.New(cfg, client.Options{Scheme: controllers.NewScheme()}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	// Wait for the webhook server: a pod created before it listens fails
	// (failurePolicy Fail), as in a real cluster.
	deadline := time.Now().Add(20 * time.Second)
	for mgr.GetWebhookServer().StartedChecker()(nil) != nil {
		if time.Now().After(deadline) {
			fmt.Fprintln(os.Stderr, "webhook server did not start")
			return 1
		}
		time.Sleep(50 * time.Millisecond)
	}
	return m.Run()
}

// namespace makes a namespace, labelled for injection when enabled.
func namespace(t *testing.T, enabled bool) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "t-"}}
	if enabled {
		ns.Labels = map[string]string{webhook.LabelInjection: "enabled"}
	}
	if err := k8s.Create(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	return ns.Name
}
