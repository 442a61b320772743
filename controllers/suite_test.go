package controllers_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/controllers"
	"github.com/idemcp/idemcp/test/envtestutil"
	"github.com/idemcp/idemcp/webhook"
)

var (
	cfg       *rest.Config
	k8s       client.Client
	testEnv   *envtest.Environment
	assetsDir string
)

// TestMain starts a real kube-apiserver and etcd (built by
// hack/setup-envtest.sh) with the CRD and webhook installed, and the manager.
func TestMain(m *testing.M) {
	if !envtestutil.Available() {
		os.Exit(0)
	}
	assetsDir = os.Getenv("KUBEBUILDER_ASSETS")
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
		MetricsAddr: "0", ProbeAddr: "0", RedisImage: "redis:7.4-alpine", SecretRecheck: time.Second,
		WebhookHost: wh.LocalServingHost, WebhookPort: wh.LocalServingPort, WebhookCertDir: wh.LocalServingCertDir,
		MissingPolicy: "deny", Sidecar: webhook.DefaultConfig("ghcr.io/idemcp/idemcp:test"), Namespace: "idemcp-system",
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
	return m.Run()
}

// newNamespace makes a namespace for one test.
func newNamespace(t *testing.T) string {
	t.Helper()
	ns := &corev1.Namespace{}
	ns.GenerateName = "t-"
	if err := k8s.Create(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	return ns.Name
}

func eventually(t *testing.T, what string, cond func() error) {
	t.Helper()
	envtestutil.Eventually(t, what, cond)
}

func envtestAdmin() envtest.User {
	return envtest.User{Name: "admin", Groups: []string{"system:masters"}}
}
