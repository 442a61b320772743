package certs_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"gomodules.xyz/jsonpatch/v2"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	ctrlwebhook "sigs.k8s.io/controller-runtime/pkg/webhook"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/webhook/certs"
)

const calledAnnotation = "idemcp.io/certs-test-called"

// TestAPIServerCallsWebhookWithManagedCertificate: the kube-apiserver calls
// controller-runtime's webhook server, verifying it against the caBundle the
// Manager set, before and while the serving certificate rotates. With no
// kube-proxy here, the configuration calls https://localhost:PORT (a name
// the certificate also carries) instead of the Service; everything stays
// on loopback.
func TestAPIServerCallsWebhookWithManagedCertificate(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace(t)
	ip := "127.0.0.1"
	port := freePort(t, ip)

	o := testOptions(t, ns, "idemcp-test-e2e-"+ns)
	o.CertValidity, o.RotateBefore = 3*time.Second, 2*time.Second
	o.ExtraDNSNames = []string{"localhost"}
	// As installed: the configuration first, then the manager, which sets
	// the certificate up before its server starts.
	createConfigMapWebhook(t, ns, o.WebhookConfigName, fmt.Sprintf("https://localhost:%d/mutate", port))
	m := certs.New(k8s, k8s, o)
	if err := m.EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	serveWebhook(t, ip, port, o.CertDir)
	start(t, m)

	first := verifyServing(t, ns, getSecret(t, ns).Data).SerialNumber
	eventually(t, "the API server calling the webhook", func() error {
		return createMutated(ctx, ns)
	})
	eventually(t, "a rotated serving certificate", func() error {
		if serial := verifyServing(t, ns, getSecret(t, ns).Data).SerialNumber; serial.Cmp(first) == 0 {
			return errors.New("not rotated yet")
		}
		return nil
	})
	// failurePolicy Fail: any call the API server could not make fails
	// the create. Rotations keep happening every second meanwhile.
	for range 10 {
		if err := createMutated(ctx, ns); err != nil {
			t.Fatalf("during rotations: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// createMutated creates a ConfigMap the webhook must annotate.
func createMutated(ctx context.Context, ns string) error {
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{GenerateName: "cm-", Namespace: ns, Labels: map[string]string{"idemcp.io/certs-test": ns}}}
	if err := k8s.Create(ctx, cm); err != nil {
		return err
	}
	if cm.Annotations[calledAnnotation] != "true" {
		return errors.New("the ConfigMap was created unmutated")
	}
	return nil
}

// serveWebhook runs controller-runtime's webhook server on CertDir.
func serveWebhook(t *testing.T, ip string, port int, certDir string) {
	t.Helper()
	server := ctrlwebhook.NewServer(ctrlwebhook.Options{Host: ip, Port: port, CertDir: certDir})
	server.Register("/mutate", &admission.Webhook{Handler: admission.HandlerFunc(func(context.Context, admission.Request) admission.Response {
		return admission.Patched("", jsonpatch.JsonPatchOperation{Operation: "add", Path: "/metadata/annotations", Value: map[string]string{calledAnnotation: "true"}})
	})})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- server.Start(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("webhook server: %v", err)
		}
	})
	eventually(t, "the webhook server", func() error { return server.StartedChecker()(&http.Request{}) })
}

func createConfigMapWebhook(t *testing.T, ns, name, url string) {
	t.Helper()
	config := &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Webhooks: []admissionregistrationv1.MutatingWebhook{{
			Name: "configmaps.certs-test.idemcp.io",
			ClientConfig: admissionregistrationv1.WebhookClientConfig{
				URL: ptr.To(url),
			},
			Rules: []admissionregistrationv1.RuleWithOperations{{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
				Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"configmaps"}},
			}},
			ObjectSelector:          &metav1.LabelSelector{MatchLabels: map[string]string{"idemcp.io/certs-test": ns}},
			FailurePolicy:           ptr.To(admissionregistrationv1.Fail),
			SideEffects:             ptr.To(admissionregistrationv1.SideEffectClassNone),
			AdmissionReviewVersions: []string{"v1"},
			TimeoutSeconds:          ptr.To(int32(5)),
		}},
	}
	if err := k8s.Create(t.Context(), config); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), config) })
}

func freePort(t *testing.T, ip string) int {
	t.Helper()
	p, err := freeport.Port(ip)
	if err != nil {
		t.Fatal(err)
	}
	return p
}
