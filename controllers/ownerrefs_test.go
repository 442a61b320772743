package controllers_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/webhook"
)

// TestOwnerReferencesPermissionEnforcement runs the manager as the service
// account config/default installs, against a second API server with the
// OwnerReferencesPermissionEnforcement admission plugin (on by default in
// OpenShift): setting blockOwnerDeletion on the managed Redis's objects
// needs update on idempotencypolicies/finalizers, which the shipped role
// must grant.
func TestOwnerReferencesPermissionEnforcement(t *testing.T) {
	env := &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join("..", "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		WebhookInstallOptions: envtest.WebhookInstallOptions{Paths: []string{filepath.Join("..", "config", "webhook", "manifests.yaml")}},
	}
	env.ControlPlane.GetAPIServer().Configure().Set("enable-admission-plugins", "OwnerReferencesPermissionEnforcement")
	admin, err := env.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.Stop() })

	user, err := env.ControlPlane.AddUser(envtestAdmin(), nil)
	if err != nil {
		t.Fatal(err)
	}
	kc, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, kc, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(filepath.Join(assetsDir, "kubectl"), "--kubeconfig", kubeconfig, "apply", "--server-side", "-k", "../config/default").CombinedOutput(); err != nil {
		t.Fatalf("kubectl apply -k config/default: %v\n%s", err, out)
	}

	asManager := rest.CopyConfig(admin)
	asManager.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:idemcp-system:idemcp-manager"}
	wh := env.WebhookInstallOptions
	mgr, err := manager.New(asManager, manager.Options{
		MetricsAddr: "0", ProbeAddr: "0", MissingPolicy: "deny", Namespace: "idemcp-system",
		WebhookHost: wh.LocalServingHost, WebhookPort: wh.LocalServingPort, WebhookCertDir: wh.LocalServingCertDir,
		Sidecar: webhook.DefaultConfig("ghcr.io/idemcp/idemcp:test"), SecondManager: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := mgr.Start(ctx); err != nil {
			t.Errorf("manager: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })

	c, err := client.New(admin, client.Options{Scheme: manager.NewScheme()})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Create(ctx, managedPolicy("shop", "payments")); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: "shop", Name: "payments-redis"}
	var sts appsv1.StatefulSet
	eventually(t, "the managed Redis created by the manager's service account", func() error {
		return c.Get(ctx, key, &sts)
	})
	if ref := metav1.GetControllerOf(&sts); ref == nil || ref.BlockOwnerDeletion == nil || !*ref.BlockOwnerDeletion {
		t.Errorf("owner reference %+v lacks blockOwnerDeletion", ref)
	}
	eventually(t, "RedisProvisioning, not ProvisioningFailed", func() error {
		var p v1alpha1.IdempotencyPolicy
		if err := c.Get(ctx, client.ObjectKey{Namespace: "shop", Name: "payments"}, &p); err != nil {
			return err
		}
		return condition(&p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonRedisProvisioning)
	})
}
