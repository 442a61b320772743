package certs_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/certwatcher"
	cwmetrics "sigs.k8s.io/controller-runtime/pkg/certwatcher/metrics"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/test/envtestutil"
	"github.com/idemcp/idemcp/webhook/certs"

	"github.com/idemcp/idemcp/test/testdeps"
)

const (
	serviceName = "webhook-svc"
	secretName  = "webhook-cert"
)

var (
	cfg *rest.Config
	k8s client.Client
)

// TestMain starts a real kube-apiserver and etcd (built by
// hack/setup-envtest.sh). Without them the unit tests still run and the
// tests that need the API server skip, except under CI, where that fails.
func TestMain(m *testing.M) {
	if !envtestutil.Available() {
		os.Exit(m.Run())
	}
	os.Exit(envtestutil.Run(&envtest.Environment{}, func(c *rest.Config) int {
		cfg = c
		var err error
		if k8s, err = client.New(cfg, client.Options{}); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		return m.Run()
	}))
}

// TestEnsureOnceCreatesSecretFilesAndCABundle: from nothing, one
// EnsureOnce leaves a Secret, the files the webhook server reads, and the
// CA in every webhook of the configuration.
func TestEnsureOnceCreatesSecretFilesAndCABundle(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace(t)
	o := testOptions(t, ns, newWebhookConfig(t, ns))
	m := certs.New(k8s, k8s, o)
	if err := m.ReadyCheck(nil); err == nil {
		t.Error("ReadyCheck passes before any certificate is written")
	}
	if err := m.EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}

	secret := getSecret(t, ns)
	if secret.Type != corev1.SecretTypeTLS {
		t.Errorf("Secret type %q, want %q", secret.Type, corev1.SecretTypeTLS)
	}
	for _, key := range []string{"tls.crt", "tls.key", "ca.crt", "ca.key"} {
		if block, _ := pem.Decode(secret.Data[key]); block == nil {
			t.Errorf("Secret key %s holds no PEM", key)
		}
	}
	leaf := verifyServing(t, ns, secret.Data)
	if want := []string{serviceName, serviceName + "." + ns, serviceName + "." + ns + ".svc", serviceName + "." + ns + ".svc.cluster.local"}; fmt.Sprint(leaf.DNSNames) != fmt.Sprint(want) {
		t.Errorf("DNS names %v, want %v", leaf.DNSNames, want)
	}
	if err := filesMatch(o.CertDir, secret.Data); err != nil {
		t.Error(err)
	}
	if err := caBundleIs(ctx, o.WebhookConfigName, secret.Data["ca.crt"]); err != nil {
		t.Error(err)
	}
	select {
	case <-m.Ready():
	default:
		t.Error("Ready is not closed")
	}
	if err := m.ReadyCheck(nil); err != nil {
		t.Errorf("ReadyCheck: %v", err)
	}
}

// TestEnsureOnceTwiceChangesNothing: a restart, or the next check, writes
// neither the Secret, nor the configuration, nor the files.
func TestEnsureOnceTwiceChangesNothing(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace(t)
	o := testOptions(t, ns, newWebhookConfig(t, ns))
	if err := certs.New(k8s, k8s, o).EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	secret := getSecret(t, ns)
	config := getWebhookConfig(t, o.WebhookConfigName)
	certFile, err := os.Stat(filepath.Join(o.CertDir, "tls.crt"))
	if err != nil {
		t.Fatal(err)
	}

	// A second replica, or the same one restarted, with its files.
	if err := certs.New(k8s, k8s, o).EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if after := getSecret(t, ns); after.ResourceVersion != secret.ResourceVersion {
		t.Errorf("the Secret was written again: resourceVersion %s, then %s", secret.ResourceVersion, after.ResourceVersion)
	}
	if after := getWebhookConfig(t, o.WebhookConfigName); after.ResourceVersion != config.ResourceVersion {
		t.Errorf("the MutatingWebhookConfiguration was written again: resourceVersion %s, then %s", config.ResourceVersion, after.ResourceVersion)
	}
	after, err := os.Stat(filepath.Join(o.CertDir, "tls.crt"))
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(certFile, after) {
		t.Error("tls.crt was written again")
	}
}

// TestLoopRotatesServingCertificateFromSameCA: a serving certificate close
// to its end is replaced by one from the same CA, so the caBundle the API
// server trusts stays valid.
func TestLoopRotatesServingCertificateFromSameCA(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace(t)
	o := testOptions(t, ns, newWebhookConfig(t, ns))
	o.CertValidity, o.RotateBefore = 3*time.Second, 2*time.Second
	m := certs.New(k8s, k8s, o)
	if err := m.EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	first := getSecret(t, ns)
	firstSerial := verifyServing(t, ns, first.Data).SerialNumber
	start(t, m)

	eventually(t, "a new serving certificate in the Secret and the files", func() error {
		secret := getSecret(t, ns)
		if serial := verifyServing(t, ns, secret.Data).SerialNumber; serial.Cmp(firstSerial) == 0 {
			return fmt.Errorf("serial still %s", serial)
		}
		if !bytes.Equal(secret.Data["ca.crt"], first.Data["ca.crt"]) || !bytes.Equal(secret.Data["ca.key"], first.Data["ca.key"]) {
			t.Fatal("the CA changed")
		}
		return filesMatch(o.CertDir, secret.Data)
	})
	if err := caBundleIs(ctx, o.WebhookConfigName, first.Data["ca.crt"]); err != nil {
		t.Error(err)
	}
}

// TestLoopRestoresCABundle: a caBundle reset, by a kubectl apply of the
// manifest for instance, is set again.
func TestLoopRestoresCABundle(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace(t)
	o := testOptions(t, ns, newWebhookConfig(t, ns))
	m := certs.New(k8s, k8s, o)
	if err := m.EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}
	start(t, m)

	config := getWebhookConfig(t, o.WebhookConfigName)
	for i := range config.Webhooks {
		config.Webhooks[i].ClientConfig.CABundle = nil
	}
	if err := k8s.Update(ctx, config); err != nil {
		t.Fatal(err)
	}
	ca := getSecret(t, ns).Data["ca.crt"]
	eventually(t, "the caBundle restored", func() error {
		return caBundleIs(ctx, o.WebhookConfigName, ca)
	})
}

// TestLoopSetsCABundleOfLateWebhookConfig: the configuration may be
// created after the manager starts; its caBundle is set when it appears.
func TestLoopSetsCABundleOfLateWebhookConfig(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace(t)
	o := testOptions(t, ns, "idemcp-test-late-"+ns)
	m := certs.New(k8s, k8s, o)
	if err := m.EnsureOnce(ctx); err != nil {
		t.Fatalf("EnsureOnce without the MutatingWebhookConfiguration: %v", err)
	}
	start(t, m)

	createWebhookConfig(t, ns, o.WebhookConfigName)
	ca := getSecret(t, ns).Data["ca.crt"]
	eventually(t, "the caBundle set", func() error {
		return caBundleIs(ctx, o.WebhookConfigName, ca)
	})
}

// TestReplicasRacingAgreeOnOneCA: replicas starting together on a fresh
// cluster all serve with the one CA of the one Secret.
func TestReplicasRacingAgreeOnOneCA(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace(t)
	config := newWebhookConfig(t, ns)
	const rounds, replicas = 5, 3
	for round := range rounds {
		name := fmt.Sprintf("%s-%d", secretName, round)
		opts := make([]certs.Options, replicas)
		errs := make([]error, replicas)
		var wg sync.WaitGroup
		begin := make(chan struct{})
		for i := range replicas {
			opts[i] = testOptions(t, ns, config)
			opts[i].SecretName = name
			m := certs.New(k8s, k8s, opts[i])
			wg.Go(func() {
				<-begin
				errs[i] = m.EnsureOnce(ctx)
			})
		}
		close(begin)
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}

		var secret corev1.Secret
		if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &secret); err != nil {
			t.Fatal(err)
		}
		verifyServing(t, ns, secret.Data)
		for i, o := range opts {
			if err := filesMatch(o.CertDir, secret.Data); err != nil {
				t.Errorf("round %d, replica %d: %v", round, i, err)
			}
		}
		if err := caBundleIs(ctx, config, secret.Data["ca.crt"]); err != nil {
			t.Errorf("round %d: %v", round, err)
		}
	}
}

// TestTLSHandshakeWithCertWatcher: a server loading CertDir the way
// controller-runtime's webhook server does is trusted by a client that
// trusts only ca.crt, under the name the API server dials, before and
// after the serving certificate rotates.
func TestTLSHandshakeWithCertWatcher(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace(t)
	o := testOptions(t, ns, newWebhookConfig(t, ns))
	o.CertValidity, o.RotateBefore = 3*time.Second, 2*time.Second
	m := certs.New(k8s, k8s, o)
	if err := m.EnsureOnce(ctx); err != nil {
		t.Fatal(err)
	}

	watcher, err := certwatcher.New(filepath.Join(o.CertDir, "tls.crt"), filepath.Join(o.CertDir, "tls.key"))
	if err != nil {
		t.Fatal(err)
	}
	watcherCtx, stopWatcher := context.WithCancel(ctx)
	watcherDone := make(chan error, 1)
	go func() { watcherDone <- watcher.Start(watcherCtx) }()
	t.Cleanup(func() {
		stopWatcher()
		if err := <-watcherDone; err != nil {
			t.Errorf("certwatcher: %v", err)
		}
	})
	server := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok"))
	}))
	server.TLS = &tls.Config{GetCertificate: watcher.GetCertificate, MinVersion: tls.VersionTLS12}
	server.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshake below
	server.StartTLS()
	t.Cleanup(server.Close)

	ca := getSecret(t, ns).Data["ca.crt"]
	first, err := handshake(ctx, server.URL, ca, serviceName+"."+ns+".svc")
	if err != nil {
		t.Fatalf("handshake: %v", err)
	}
	if _, err := handshake(ctx, server.URL, ca, "elsewhere.example"); err == nil {
		t.Error("the handshake succeeded under a name the certificate does not hold")
	}

	readsBefore, errorsBefore := count(t, cwmetrics.ReadCertificateTotal), count(t, cwmetrics.ReadCertificateErrors)
	start(t, m)
	eventually(t, "the server presenting a rotated certificate", func() error {
		serial, err := handshake(ctx, server.URL, ca, serviceName+"."+ns+".svc")
		if err != nil {
			return err
		}
		if serial.Cmp(first) == 0 {
			return fmt.Errorf("serial still %s", serial)
		}
		return nil
	})
	// The webhook server never sees a certificate without its key.
	if reads, errs := count(t, cwmetrics.ReadCertificateTotal)-readsBefore, count(t, cwmetrics.ReadCertificateErrors)-errorsBefore; errs != 0 {
		t.Errorf("certwatcher failed %v of its %v reads during the rotation", errs, reads)
	}
}

// handshake GETs url trusting only caPEM, and returns the serial of the
// certificate the server presented.
func handshake(ctx context.Context, url string, caPEM []byte, serverName string) (*big.Int, error) {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return nil, errors.New("ca.crt holds no certificate")
	}
	transport := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: serverName, MinVersion: tls.VersionTLS12}}
	defer transport.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := (&http.Client{Transport: transport, Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("status %s", resp.Status)
	}
	return resp.TLS.PeerCertificates[0].SerialNumber, nil
}

func testOptions(t *testing.T, ns, webhookConfig string) certs.Options {
	return certs.Options{
		Namespace:         ns,
		SecretName:        secretName,
		ServiceName:       serviceName,
		WebhookConfigName: webhookConfig,
		CertDir:           t.TempDir(),
		CheckInterval:     500 * time.Millisecond,
	}
}

// start runs m's loop until the test ends.
func start(t *testing.T, m *certs.Manager) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- m.Start(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Start: %v", err)
		}
	})
}

func newNamespace(t *testing.T) string {
	t.Helper()
	if k8s == nil {
		testdeps.Missing(t, "no API server: export KUBEBUILDER_ASSETS=$(hack/setup-envtest.sh)")
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "certs-"}}
	if err := k8s.Create(t.Context(), ns); err != nil {
		t.Fatal(err)
	}
	return ns.Name
}

// newWebhookConfig creates a MutatingWebhookConfiguration with two
// webhooks and no caBundle, and returns its name.
func newWebhookConfig(t *testing.T, ns string) string {
	t.Helper()
	name := "idemcp-test-" + ns
	createWebhookConfig(t, ns, name)
	return name
}

func createWebhookConfig(t *testing.T, ns, name string) {
	t.Helper()
	webhook := func(name string) admissionregistrationv1.MutatingWebhook {
		return admissionregistrationv1.MutatingWebhook{
			Name: name,
			ClientConfig: admissionregistrationv1.WebhookClientConfig{
				Service: &admissionregistrationv1.ServiceReference{Namespace: ns, Name: serviceName, Path: ptr.To("/mutate-v1-pod")},
			},
			Rules: []admissionregistrationv1.RuleWithOperations{{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
				Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"pods"}},
			}},
			// Nothing serves the webhook: it must never be called.
			ObjectSelector:          &metav1.LabelSelector{MatchLabels: map[string]string{"idemcp.io/certs-test": "never"}},
			FailurePolicy:           ptr.To(admissionregistrationv1.Ignore),
			SideEffects:             ptr.To(admissionregistrationv1.SideEffectClassNone),
			AdmissionReviewVersions: []string{"v1"},
		}
	}
	config := &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Webhooks:   []admissionregistrationv1.MutatingWebhook{webhook("inject.idemcp.io"), webhook("other.idemcp.io")},
	}
	if err := k8s.Create(t.Context(), config); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), config) })
}

func getSecret(t *testing.T, ns string) *corev1.Secret {
	t.Helper()
	var secret corev1.Secret
	if err := k8s.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: secretName}, &secret); err != nil {
		t.Fatal(err)
	}
	return &secret
}

func getWebhookConfig(t *testing.T, name string) *admissionregistrationv1.MutatingWebhookConfiguration {
	t.Helper()
	var config admissionregistrationv1.MutatingWebhookConfiguration
	if err := k8s.Get(t.Context(), client.ObjectKey{Name: name}, &config); err != nil {
		t.Fatal(err)
	}
	return &config
}

// verifyServing checks that tls.crt verifies against ca.crt for the name
// the API server dials, and that tls.key is its key.
func verifyServing(t *testing.T, ns string, data map[string][]byte) *x509.Certificate {
	t.Helper()
	pair, err := tls.X509KeyPair(data["tls.crt"], data["tls.key"])
	if err != nil {
		t.Fatalf("tls.crt and tls.key: %v", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(data["ca.crt"]) {
		t.Fatal("ca.crt holds no certificate")
	}
	dnsName := serviceName + "." + ns + ".svc"
	if _, err := pair.Leaf.Verify(x509.VerifyOptions{DNSName: dnsName, Roots: roots}); err != nil {
		t.Fatalf("tls.crt does not verify against ca.crt for %s: %v", dnsName, err)
	}
	return pair.Leaf
}

func filesMatch(dir string, data map[string][]byte) error {
	for _, key := range []string{"tls.crt", "tls.key"} {
		got, err := os.ReadFile(filepath.Join(dir, key))
		if err != nil {
			return err
		}
		if !bytes.Equal(got, data[key]) {
			return fmt.Errorf("%s in %s differs from the Secret", key, dir)
		}
	}
	return nil
}

func caBundleIs(ctx context.Context, name string, ca []byte) error {
	var config admissionregistrationv1.MutatingWebhookConfiguration
	if err := k8s.Get(ctx, client.ObjectKey{Name: name}, &config); err != nil {
		return err
	}
	for _, w := range config.Webhooks {
		if !bytes.Equal(w.ClientConfig.CABundle, ca) {
			return fmt.Errorf("webhook %s has caBundle %q, want ca.crt", w.Name, w.ClientConfig.CABundle)
		}
	}
	return nil
}

func count(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func eventually(t *testing.T, what string, cond func() error) {
	t.Helper()
	envtestutil.Eventually(t, what, cond)
}
