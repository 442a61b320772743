package controllers_test

import (
	"context"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/cmd/manager"
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
	os.Exit(envtestutil.RunWithManager(m, manager.Options{
		RedisImage: "redis:7.4-alpine", SecretRecheck: time.Second, MissingPolicy: "deny",
		Sidecar: webhook.DefaultConfig("ghcr.io/idemcp/idemcp:test"), Namespace: "idemcp-system",
		ProxyUpstreamCheck: time.Second,
	}, func(c *envtestutil.Cluster) {
		cfg, k8s, testEnv = c.Config, c.Client, c.Env
		assetsDir = os.Getenv("KUBEBUILDER_ASSETS")
	}))
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
