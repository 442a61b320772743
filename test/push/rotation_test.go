package push

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/controllers/policystream"
	"github.com/idemcp/idemcp/test/poll"
	"github.com/idemcp/idemcp/webhook/certs"
)

// TestOldBundleSidecarReconnectsAcrossCARotation: a sidecar injected with
// the bundle of the old CA alone holds its stream while the next CA is
// published, gets it on the stream, and after the switch (while the
// manager was away) reconnects to a manager serving from the new CA.
func TestOldBundleSidecarReconnectsAcrossCARotation(t *testing.T) {
	const ns, name, certNS = "push-ca-rotation", "payments", "push-ca-certs"
	ctx := context.Background()
	namespace(t, ns)
	if err := k8s.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: certNS}}); err != nil {
		t.Fatal(err)
	}
	certDir := t.TempDir()
	co := certs.Options{
		Namespace: certNS, SecretName: "stream-cert", ServiceName: "stream", WebhookConfigName: "absent",
		CertDir: certDir, ExtraDNSNames: []string{"localhost"},
		CAValidity: time.Minute, CertValidity: time.Minute, RotateBefore: 55 * time.Second, CAOverlap: 3 * time.Second, CheckInterval: time.Second,
	}
	cm := certs.New(k8s, k8s, co)
	if err := cm.EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	created := time.Now()
	secret := func() *corev1.Secret {
		var s corev1.Secret
		if err := k8s.Get(ctx, client.ObjectKey{Namespace: certNS, Name: "stream-cert"}, &s); err != nil {
			t.Fatal(err)
		}
		return &s
	}
	oldBundle := secret().Data["ca.crt"] // what the webhook injected

	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	endpoint := "https://localhost:" + port
	tweak := func(o *manager.Options) {
		o.WebhookCertDir = certDir
		o.PolicyStreamCA = policystream.CABundleFromSecret(k8s, certNS, "stream-cert", 100*time.Millisecond)
		o.PolicyStreamCARefresh = 200 * time.Millisecond
	}
	mgr := startManager(t, "a", addr, tweak)
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	pod, token := createPod(t, ns, "mcp-0", name)
	s := startSidecarClientWithCA(t, oldBundle, endpoint, ns, name, pod.Name, token, compiled(t, ns, name, spec))
	poll.Within(t, 15*time.Second, "the sidecar to connect", func() error {
		if !s.client.Connected() {
			return errors.New("not connected")
		}
		return nil
	})

	// The CA nears its end: the next one is published, not yet served.
	time.Sleep(time.Until(created.Add(6 * time.Second)))
	select {
	case <-s.client.Applied():
	default:
	}
	if err := cm.EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	published := secret()
	if len(published.Data["next-ca.crt"]) == 0 || bytes.Equal(published.Data["ca.crt"], oldBundle) {
		t.Fatal("the next CA was not published")
	}
	// The stream sends the new bundle (the policy is unchanged).
	select {
	case <-s.client.Applied():
	case <-time.After(10 * time.Second):
		t.Fatal("the sidecar got no snapshot with the new CA bundle")
	}

	// The manager is away while the next CA takes over.
	mgr.stop()
	time.Sleep(co.CAOverlap)
	if err := cm.EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(secret().Data["ca.key"], published.Data["next-ca.key"]) {
		t.Fatal("the next CA does not sign after the overlap")
	}
	startManager(t, "b", addr, tweak)

	// The control: what is served now does not verify with the old bundle.
	old := x509.NewCertPool()
	old.AppendCertsFromPEM(oldBundle)
	conn, err := tls.Dial("tcp", "localhost:"+port, &tls.Config{RootCAs: old, MinVersion: tls.VersionTLS12})
	var unknown x509.UnknownAuthorityError
	if err == nil {
		_ = conn.Close()
		t.Fatal("the certificate served after the switch verifies with the old bundle: nothing was rotated")
	} else if !errors.As(err, &unknown) {
		t.Fatalf("dialling with the old bundle: %v, want an unknown authority", err)
	}

	poll.Within(t, 15*time.Second, "the sidecar to reconnect", func() error {
		if !s.client.Connected() || s.client.Sessions() < 2 {
			return fmt.Errorf("connected %v after %d streams", s.client.Connected(), s.client.Sessions())
		}
		return nil
	})
	hash := updatePolicy(t, ns, name, func(s *v1alpha1.IdempotencyPolicySpec) { s.DefaultMode = v1alpha1.ModeDeduplicate })
	waitApplied(t, []*sidecarClient{s}, hash, time.Now(), 10*time.Second)
}
