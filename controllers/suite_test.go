package controllers_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"github.com/idemcp/idemcp/controllers"
	"github.com/idemcp/idemcp/webhook"
)

var (
	cfg       *rest.Config
	k8s       client.Client
	testEnv   *envtest.Environment
	assetsDir string
)

// TestMain starts a real kube-apiserver and etcd (built by
// hack/setup-envtest.sh) with the CRD installed, and the reconciler.
func TestMain(m *testing.M) {
	assetsDir = os.Getenv("KUBEBUILDER_ASSETS")
	if assetsDir == "" {
		if os.Getenv("CI") == "true" {
			fmt.Fprintln(os.Stderr, "KUBEBUILDER_ASSETS is not set: run through make test, or export KUBEBUILDER_ASSETS=$(hack/setup-envtest.sh)")
			os.Exit(1)
		}
		fmt.Fprintln(os.Stderr, "skipping the controller tests: export KUBEBUILDER_ASSETS=$(hack/setup-envtest.sh) (make test does)")
		os.Exit(0)
	}
	level := zapcore.ErrorLevel
	if os.Getenv("ENVTEST_VERBOSE") != "" {
		level = zapcore.DebugLevel
	}
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr), zap.Level(level)))
	testEnv = &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join("..", "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		WebhookInstallOptions: envtest.WebhookInstallOptions{Paths: []string{filepath.Join("..", "config", "webhook", "manifests.yaml")}},
	}
	var err error
	if cfg, err = testEnv.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "starting envtest: %v\n", err)
		os.Exit(1)
	}
	code := run(m)
	_ = testEnv.Stop()
	os.Exit(code)
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

// eventually polls cond until it returns nil, or fails with its last error.
func eventually(t *testing.T, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	var err error
	for time.Now().Before(deadline) {
		if err = cond(); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s: %v", what, err)
}

func envtestAdmin() envtest.User {
	return envtest.User{Name: "admin", Groups: []string{"system:masters"}}
}
