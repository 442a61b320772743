// Package push tests the live policy push end to end: a real API server
// and etcd (envtest), the real manager (one or two replicas with leader
// election) and sidecars as in-process policy sync clients with real
// engines, or a whole `idemcp sidecar` in front of a real MCP server.
package push

import (
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/controllers/policystream"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/sidecar/policysync"
	"github.com/idemcp/idemcp/test/envtestutil"
)

var (
	env       *envtest.Environment
	cfg       *rest.Config
	k8s       client.Client
	clientset *kubernetes.Clientset
	caPEM     []byte
)

func TestMain(m *testing.M) {
	if !envtestutil.Available() {
		os.Exit(0)
	}
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "..", "..")
	env = &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join(root, "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
	}
	os.Exit(envtestutil.Run(env, func(c *rest.Config) int {
		cfg = c
		var err error
		if k8s, err = client.New(cfg, client.Options{Scheme: manager.NewScheme()}); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if clientset, err = kubernetes.NewForConfig(cfg); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		caPEM = env.WebhookInstallOptions.LocalServingCAData
		return m.Run()
	}))
}

// freeAddr returns a loopback address nobody listens on.
func freeAddr(t testing.TB) string {
	t.Helper()
	return freeport.Loopback(t)
}

// replica is one running manager.
type replica struct {
	name   string
	stream *policystream.Server
	cancel context.CancelFunc
	done   chan struct{}
	elect  <-chan struct{}
	addr   string
}

func (r *replica) leading() bool {
	select {
	case <-r.done:
		return false
	default:
	}
	select {
	case <-r.elect:
		return true
	default:
		return false
	}
}

// stop stops the manager and waits until it let go of its lease and port.
func (r *replica) stop() {
	r.cancel()
	<-r.done
}

// startManager runs the real manager with leader election, its policy
// stream on streamAddr.
func startManager(t testing.TB, name, streamAddr string, tweaks ...func(*manager.Options)) *replica {
	t.Helper()
	wh := env.WebhookInstallOptions
	_, port, _ := net.SplitHostPort(freeAddr(t))
	var webhookPort int
	_, _ = fmt.Sscan(port, &webhookPort)
	r := &replica{name: name, done: make(chan struct{}), addr: streamAddr}
	o := manager.Options{
		MetricsAddr: "0", ProbeAddr: "0", SkipControllerNameValidation: true,
		LeaderElect: true, LeaderElectionNS: "default",
		LeaseDuration: 3 * time.Second, RenewDeadline: 2 * time.Second, RetryPeriod: 250 * time.Millisecond,
		WebhookHost: wh.LocalServingHost, WebhookPort: webhookPort, WebhookCertDir: wh.LocalServingCertDir,
		MissingPolicy: "deny", Namespace: "idemcp-system",
		PolicyStreamAddr: streamAddr, PolicyStreamService: policystream.DefaultServiceName,
		PolicyStreamCA:    func(context.Context) ([]byte, error) { return caPEM, nil },
		PolicyStreamFlush: 100 * time.Millisecond,
		OnPolicyStream:    func(s *policystream.Server) { r.stream = s },
	}
	o.Sidecar.Image = "idemcp:test"
	for _, tweak := range tweaks {
		tweak(&o)
	}
	mgr, err := manager.New(cfg, o)
	if err != nil {
		t.Fatalf("starting manager %s: %v", name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel, r.elect = cancel, mgr.Elected()
	go func() {
		defer close(r.done)
		if err := mgr.Start(ctx); err != nil {
			fmt.Fprintf(os.Stderr, "manager %s: %v\n", name, err)
		}
	}()
	t.Cleanup(r.stop)
	ctx2, cancel2 := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel2()
	if _, err := r.stream.Addr(ctx2); err != nil {
		t.Fatalf("manager %s: the policy stream does not listen: %v", name, err)
	}
	return r
}

// namespace creates a namespace with the service account MCP pods run as.
func namespace(t testing.TB, name string) {
	t.Helper()
	ctx := context.Background()
	if err := k8s.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: name, Name: "mcp"}}); err != nil {
		t.Fatal(err)
	}
}

func createPolicy(t testing.TB, ns, name string, spec v1alpha1.IdempotencyPolicySpec) *v1alpha1.IdempotencyPolicy {
	t.Helper()
	p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: spec}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	return p
}

// updatePolicy changes a policy's spec and returns the new hash.
func updatePolicy(t testing.TB, ns, name string, mutate func(*v1alpha1.IdempotencyPolicySpec)) string {
	t.Helper()
	var p v1alpha1.IdempotencyPolicy
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, &p); err != nil {
			return err
		}
		mutate(&p.Spec)
		return k8s.Update(context.Background(), &p)
	})
	if err != nil {
		t.Fatal(err)
	}
	return hashOf(t, p.Spec)
}

func hashOf(t testing.TB, spec v1alpha1.IdempotencyPolicySpec) string {
	t.Helper()
	c, err := policy.Compile(spec)
	if err != nil {
		t.Fatal(err)
	}
	return c.Hash
}

// createPod creates a pod that uses policy (the label the webhook sets)
// and returns it with a token bound to it, audience idemcp.
func createPod(t testing.TB, ns, name, policyLabel string) (*corev1.Pod, string) {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{v1alpha1.LabelPolicy: policyLabel}},
		Spec:       corev1.PodSpec{ServiceAccountName: "mcp", Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}}},
	}
	if err := k8s.Create(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	return pod, podToken(t, pod, policywire.TokenAudience)
}

func podToken(t testing.TB, pod *corev1.Pod, audience string) string {
	t.Helper()
	tr, err := clientset.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(context.Background(), "mcp", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences: []string{audience}, ExpirationSeconds: ptr.To[int64](3600),
		BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("requesting a token for pod %s: %v", pod.Name, err)
	}
	return tr.Status.Token
}

// sidecarClient is an in-process sidecar: a real engine and the real sync
// client, without the HTTP proxy in front.
type sidecarClient struct {
	pod    string
	engine *engine.Engine
	client *policysync.Client
	cancel context.CancelFunc
	done   chan struct{}
}

func startSidecarClient(t testing.TB, endpoint, ns, policyName, podName, token string, start *policy.Policy) *sidecarClient {
	t.Helper()
	return startSidecarClientWithCA(t, caPEM, endpoint, ns, policyName, podName, token, start)
}

// startSidecarClientWithCA starts a sidecar whose injected bundle is ca.
func startSidecarClientWithCA(t testing.TB, ca []byte, endpoint, ns, policyName, podName, token string, start *policy.Policy) *sidecarClient {
	t.Helper()
	eng := engine.New(engine.Options{Policy: start})
	c, err := policysync.New(policysync.Options{
		Endpoint: endpoint, Namespace: ns, Name: policyName,
		Token:    func() (string, error) { return token, nil },
		CABundle: ca, Engine: eng, StoreIdentity: policywire.StoreIdentity(start.Spec.Store),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &sidecarClient{pod: podName, engine: eng, client: c, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		_ = c.Run(ctx)
	}()
	t.Cleanup(func() { cancel(); <-s.done })
	return s
}

func compiled(t testing.TB, ns, name string, spec v1alpha1.IdempotencyPolicySpec) *policy.Policy {
	t.Helper()
	p, err := policy.Compile(spec)
	if err != nil {
		t.Fatal(err)
	}
	p.Namespace, p.Name = ns, name
	return p
}

// waitStatus polls the policy until cond accepts it.
func waitStatus(t testing.TB, ns, name string, within time.Duration, cond func(p *v1alpha1.IdempotencyPolicy) error) *v1alpha1.IdempotencyPolicy {
	t.Helper()
	deadline := time.Now().Add(within)
	var last error
	for {
		var p v1alpha1.IdempotencyPolicy
		err := k8s.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, &p)
		if err == nil {
			if err = cond(&p); err == nil {
				return &p
			}
		}
		last = err
		if time.Now().After(deadline) {
			t.Fatalf("policy %s/%s: %v", ns, name, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func condition(p *v1alpha1.IdempotencyPolicy, typ string) *metav1.Condition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == typ {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

// synced accepts a status that shows n of n sidecars on hash, with
// SidecarsSynced and Ready true.
func synced(n int, hash string) func(p *v1alpha1.IdempotencyPolicy) error {
	return func(p *v1alpha1.IdempotencyPolicy) error {
		s := p.Status.Sidecars
		want := fmt.Sprintf("%d/%d", n, n)
		if s == nil || s.Ratio != want || s.SyncedHash != hash || s.Connected != int32(n) {
			return fmt.Errorf("status.sidecars = %+v, want %s connected and synced on %s", s, want, hash)
		}
		if c := condition(p, v1alpha1.ConditionSidecarsSynced); c == nil || c.Status != metav1.ConditionTrue || c.Reason != v1alpha1.ReasonAllSynced {
			return fmt.Errorf("SidecarsSynced = %+v, want True/%s", c, v1alpha1.ReasonAllSynced)
		}
		if c := condition(p, v1alpha1.ConditionReady); c == nil || c.Status != metav1.ConditionTrue {
			return fmt.Errorf("Ready = %+v, want True", c)
		}
		return nil
	}
}

// waitApplied waits until every sidecar enforces hash, and returns how
// long the slowest took since start.
func waitApplied(t testing.TB, sidecars []*sidecarClient, hash string, start time.Time, within time.Duration) time.Duration {
	t.Helper()
	for _, s := range sidecars {
		for s.engine.Policy().Hash != hash {
			if time.Since(start) > within {
				t.Fatalf("sidecar of pod %s enforces %s after %s, want %s", s.pod, s.engine.Policy().Hash, within, hash)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	return time.Since(start)
}

// rawStream opens the stream with token (none if empty) and returns the
// status and everything the manager sent within a short while.
func rawStream(t testing.TB, endpoint, ns, name, token string) (int, string) {
	t.Helper()
	code, body, _ := rawStreamWith(t, endpoint, ns, name, token, nil)
	return code, body
}

// rawStreamWith is rawStream with extra request headers; it returns the
// response's headers too.
func rawStreamWith(t testing.TB, endpoint, ns, name, token string, header http.Header) (int, string, http.Header) {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: tlsConfig(pool), ForceAttemptHTTP2: true}, Timeout: 2 * time.Second}
	pr, pw := io.Pipe()
	defer func() { _ = pw.Close() }()
	// Over HTTP/2 the client's timeout does not end a response while the
	// request body is open; ending the body ends the stream.
	stop := time.AfterFunc(2*time.Second, func() { _ = pw.Close() })
	defer stop.Stop()
	req, _ := http.NewRequest(http.MethodPost, endpoint+policywire.StreamPath(ns, name), pr)
	for k, v := range header {
		req.Header[k] = v
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("opening the stream: %v", err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body) // ends at the client timeout for a 200
	return resp.StatusCode, string(b), resp.Header
}

// resign returns token with its expiry moved to exp and signed again with
// the API server's service account key: the same token in every other
// respect, so a refusal is about the expiry alone.
func resign(t testing.TB, token string, exp time.Time) string {
	t.Helper()
	parts := strings.Split(token, ".")
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		t.Fatal(err)
	}
	var claims map[string]any
	if err := json.Unmarshal(payload, &claims); err != nil {
		t.Fatal(err)
	}
	claims["exp"] = exp.Unix()
	claims["iat"] = exp.Add(-time.Hour).Unix()
	claims["nbf"] = exp.Add(-time.Hour).Unix()
	payload, _ = json.Marshal(claims)
	signing := parts[0] + "." + base64.RawURLEncoding.EncodeToString(payload)
	keyPEM, err := os.ReadFile(filepath.Join(env.ControlPlane.APIServer.CertDir, "sa-signer.key"))
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(keyPEM)
	k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	key, ok := k.(*ecdsa.PrivateKey)
	if !ok {
		t.Fatalf("the service account key is a %T, not ECDSA", k)
	}
	sum := sha256.Sum256([]byte(signing))
	r, s, err := ecdsa.Sign(rand.Reader, key, sum[:])
	if err != nil {
		t.Fatal(err)
	}
	size := (key.Curve.Params().BitSize + 7) / 8
	sig := make([]byte, 2*size)
	r.FillBytes(sig[:size])
	s.FillBytes(sig[size:])
	return signing + "." + base64.RawURLEncoding.EncodeToString(sig)
}

func tlsConfig(pool *x509.CertPool) *tls.Config {
	return &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
}
