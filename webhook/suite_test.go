package webhook_test

import (
	"context"
	"os"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/cmd/manager"
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
	os.Exit(envtestutil.RunWithManager(m, manager.Options{
		Namespace: "idemcp-system", MissingPolicy: "deny", Sidecar: sidecar,
	}, func(c *envtestutil.Cluster) {
		cfg, k8s, testEnv = c.Config, c.Client, c.Env
	}))
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
