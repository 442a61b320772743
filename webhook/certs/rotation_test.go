package certs_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/idemcp/idemcp/webhook/certs"
)

// TestNextCAIsTrustedForTheOverlapBeforeItIsServed: when the CA nears its
// end, the next CA joins ca.crt and the caBundle first, while the old CA
// keeps signing what is served; only after CAOverlap does the next CA sign
// the served certificate, and that certificate verifies against the bundle
// published before the switch. While the caBundle cannot be set, nothing
// new is served.
func TestNextCAIsTrustedForTheOverlapBeforeItIsServed(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace(t)
	o := testOptions(t, ns, newWebhookConfig(t, ns))
	o.CAValidity, o.CertValidity, o.RotateBefore, o.CAOverlap = 8*time.Second, 8*time.Second, 7*time.Second, 2*time.Second
	if err := certs.New(k8s, k8s, o).EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	first := getSecret(t, ns)
	time.Sleep(1500 * time.Millisecond) // the CA is now within RotateBefore of its end

	withWatch, err := client.NewWithWatch(cfg, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	refused := errors.New("caBundle patch refused")
	failing := interceptor.NewClient(withWatch, interceptor.Funcs{
		Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
			if _, ok := obj.(*admissionregistrationv1.MutatingWebhookConfiguration); ok {
				return refused
			}
			return c.Patch(ctx, obj, patch, opts...)
		},
	})
	if err := certs.New(failing, k8s, o).EnsureOnce(ctx); !errors.Is(err, refused) {
		t.Fatalf("EnsureOnce with the caBundle refused: %v", err)
	}
	published := getSecret(t, ns)
	if !bytes.Equal(published.Data["ca.key"], first.Data["ca.key"]) {
		t.Fatal("the CA was replaced at once, with no overlap")
	}
	if len(published.Data["next-ca.crt"]) == 0 || !bytes.Contains(published.Data["ca.crt"], published.Data["next-ca.crt"]) {
		t.Fatal("the next CA is not published in ca.crt")
	}
	if err := filesMatch(o.CertDir, first.Data); err != nil {
		t.Fatalf("publishing the next CA changed what is served: %v", err)
	}

	// The caBundle gets the bundle with the next CA; the old CA still signs.
	if err := certs.New(k8s, k8s, o).EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if err := caBundleIs(ctx, o.WebhookConfigName, published.Data["ca.crt"]); err != nil {
		t.Fatal(err)
	}
	if err := filesMatch(o.CertDir, first.Data); err != nil {
		t.Fatalf("the next CA signs what is served before the overlap ended: %v", err)
	}

	// After the overlap, the next CA signs; the bundle taken before the
	// switch verifies what is served.
	time.Sleep(2 * time.Second)
	if err := certs.New(k8s, k8s, o).EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	switched := getSecret(t, ns)
	if !bytes.Equal(switched.Data["ca.key"], published.Data["next-ca.key"]) {
		t.Fatal("after the overlap the serving certificate is not signed by the published next CA")
	}
	if err := filesMatch(o.CertDir, switched.Data); err != nil {
		t.Fatal(err)
	}
	if err := caBundleIs(ctx, o.WebhookConfigName, switched.Data["ca.crt"]); err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(switched.Data["tls.crt"])
	leaf, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	before := x509.NewCertPool()
	before.AppendCertsFromPEM(published.Data["ca.crt"])
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: before}); err != nil {
		t.Fatalf("the bundle published before the switch does not verify the certificate served after it: %v", err)
	}
}
