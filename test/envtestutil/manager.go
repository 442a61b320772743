package envtestutil

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/cmd/manager"
)

// Cluster is a real API server with idemcp's CRD and webhook installed and
// the manager running, as a test suite sees it.
type Cluster struct {
	Env    *envtest.Environment
	Config *rest.Config
	Client client.Client
}

// repoRoot is the checkout this file is in.
func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// RunWithManager is a TestMain body: it starts the API server with the CRD
// and config/webhook installed, the manager with o (its webhook serving
// fields filled in), waits until the webhook answers, hands the cluster to
// use, and runs the tests.
func RunWithManager(m *testing.M, o manager.Options, use func(*Cluster)) int {
	if !Available() {
		return 0
	}
	root := repoRoot()
	env := &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join(root, "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		WebhookInstallOptions: envtest.WebhookInstallOptions{Paths: []string{filepath.Join(root, "config", "webhook", "manifests.yaml")}},
	}
	return Run(env, func(cfg *rest.Config) int {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		wh := env.WebhookInstallOptions
		o.WebhookHost, o.WebhookPort, o.WebhookCertDir = wh.LocalServingHost, wh.LocalServingPort, wh.LocalServingCertDir
		if o.MetricsAddr == "" {
			o.MetricsAddr = "0"
		}
		if o.ProbeAddr == "" {
			o.ProbeAddr = "0"
		}
		mgr, err := manager.New(cfg, o)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		go func() {
			if err := mgr.Start(ctx); err != nil {
				fmt.Fprintf(os.Stderr, "manager: %v\n", err)
			}
		}()
		c, err := client.New(cfg, client.Options{Scheme: manager.NewScheme()})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		// A pod created before the webhook listens is refused
		// (failurePolicy Fail), as in a real cluster: wait for it.
		deadline := time.Now().Add(20 * time.Second)
		for mgr.GetWebhookServer().StartedChecker()(nil) != nil {
			if time.Now().After(deadline) {
				fmt.Fprintln(os.Stderr, "webhook server did not start")
				return 1
			}
			time.Sleep(50 * time.Millisecond)
		}
		use(&Cluster{Env: env, Config: cfg, Client: c})
		return m.Run()
	})
}
