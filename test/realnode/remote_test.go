//go:build e2e

package realnode

// The IdempotentProxy step: an HTTPS MCP server outside every pod (this
// test process, on the node, in the cluster's network namespace, with a
// CA of its own), reached through an IdempotentProxy with 2 replicas and
// the policy's managed Redis.

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/test/poll"
)

const (
	proxyName      = "remote"
	remoteHostName = "mcp.remote.test" // only in the certificate: the proxy's server name override
)

// remoteServer is the HTTPS MCP server on the node: it asks for a bearer
// token as a SaaS server does, and counts what its tools did.
type remoteServer struct {
	*mcpserver.Server
	url   string
	caPEM string
}

func (s *suite) startRemoteServer(t *testing.T) *remoteServer {
	t.Helper()
	var nodes corev1.NodeList
	if err := s.k8s.List(s.ctx, &nodes); err != nil || len(nodes.Items) == 0 {
		t.Fatalf("listing nodes: %v (%d)", err, len(nodes.Items))
	}
	var ip string
	for _, a := range nodes.Items[0].Status.Addresses {
		if a.Type == corev1.NodeInternalIP && ip == "" {
			ip = a.Address
		}
	}
	if ip == "" {
		t.Fatalf("node %s has no InternalIP", nodes.Items[0].Name)
	}
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "idemcp e2e remote CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	leafDER, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: remoteHostName},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		DNSNames: []string{remoteHostName}, KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}},
		ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatalf("listening on the node's address %s: %v", ip, err)
	}
	srv := &remoteServer{Server: mcpserver.New(), url: "https://" + ln.Addr().String(),
		caPEM: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}))}
	mcpH := srv.Handler(false)
	hs := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !strings.HasPrefix(r.Header.Get("Authorization"), "Bearer ") {
				w.Header().Set("WWW-Authenticate", `Bearer resource_metadata="`+srv.url+`/.well-known/oauth-protected-resource"`)
				w.WriteHeader(http.StatusUnauthorized)
				return
			}
			mcpH.ServeHTTP(w, r)
		}),
		TLSConfig:         &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{leafDER}, PrivateKey: key}}},
		ReadHeaderTimeout: 10 * time.Second,
	}
	go func() { _ = hs.ServeTLS(ln, "", "") }()
	t.Cleanup(func() { _ = hs.Close() })
	return srv
}

// callAs is call with another bearer token.
func callAs(s *suite, token, endpoint, tool string, args map[string]any) (*mcp.CallToolResult, error) {
	hc := &http.Client{Transport: tokenTransport(token)}
	c := mcp.NewClient(&mcp.Implementation{Name: "e2e-agent", Version: "1.0.0"}, nil)
	cs, err := c.Connect(s.ctx, &mcp.StreamableClientTransport{Endpoint: endpoint, HTTPClient: hc, MaxRetries: -1}, nil)
	if err != nil {
		return nil, err
	}
	defer func() { _ = cs.Close() }()
	res, err := cs.CallTool(s.ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
	if err == nil && res.IsError {
		return res, fmt.Errorf("%s answered an error: %v", tool, res.Content)
	}
	return res, err
}

type tokenTransport string

func (tt tokenTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", string(tt))
	return http.DefaultTransport.RoundTrip(r)
}

func (s *suite) getProxy() (*v1alpha1.IdempotentProxy, error) {
	var px v1alpha1.IdempotentProxy
	err := s.k8s.Get(s.ctx, client.ObjectKey{Namespace: s.ns, Name: proxyName}, &px)
	return &px, err
}

func (s *suite) proxyPods(t *testing.T, n int) []corev1.Pod {
	t.Helper()
	return s.readyPodsOf(t, "proxy pods", map[string]string{v1alpha1.LabelProxy: proxyName}, n, 3*time.Minute)
}

func (s *suite) remoteProxy(t *testing.T) {
	s.needNode(t)
	remote := s.startRemoteServer(t)
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: s.ns, Name: "remote-ca"}, Data: map[string]string{"ca.crt": remote.caPEM}}
	if err := s.k8s.Create(s.ctx, cm); err != nil {
		t.Fatal(err)
	}
	px := &v1alpha1.IdempotentProxy{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.ns, Name: proxyName},
		Spec: v1alpha1.IdempotentProxySpec{
			Upstream: v1alpha1.ProxyUpstream{URL: remote.url, TLS: &v1alpha1.UpstreamTLS{
				CABundle:   &v1alpha1.CABundleSource{ConfigMapRef: &v1alpha1.ConfigMapKeyRef{Name: cm.Name, Key: "ca.crt"}},
				ServerName: remoteHostName,
			}},
			PolicyRef: v1alpha1.PolicyReference{Name: policyName},
			Replicas:  ptr.To[int32](2),
		},
	}
	if err := s.k8s.Create(s.ctx, px); err != nil {
		t.Fatal(err)
	}
	poll.Within(t, 4*time.Minute, "the IdempotentProxy Ready", func() error {
		px, err := s.getProxy()
		if err != nil {
			return err
		}
		c := meta.FindStatusCondition(px.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil || c.Status != metav1.ConditionTrue || c.ObservedGeneration != px.Generation {
			return fmt.Errorf("Ready %+v; ready %s synced %s", c, px.Status.Ready, px.Status.Synced)
		}
		return nil
	})
	t.Log(s.run(t, "-n", s.ns, "get", "idpx", proxyName))
	var svc corev1.Service
	if err := s.k8s.Get(s.ctx, client.ObjectKey{Namespace: s.ns, Name: proxyName}, &svc); err != nil {
		t.Fatal(err)
	}
	viaService := fmt.Sprintf("http://%s:%d/mcp", svc.Spec.ClusterIP, svc.Spec.Ports[0].Port)
	pods := s.proxyPods(t, 2)
	direct := func(p corev1.Pod) string {
		return fmt.Sprintf("http://%s:%d/mcp", p.Status.PodIP, p.Spec.Containers[0].Ports[0].ContainerPort)
	}

	// An agent's retries of one charge, across both replicas: one charge.
	args := map[string]any{"card": "4242", "amount": 12}
	first, err := callAs(s, agentToken, direct(pods[0]), "charge_card", args)
	if err != nil {
		t.Fatalf("the charge through proxy pod %s: %v", pods[0].Name, err)
	}
	retry, err := callAs(s, agentToken, direct(pods[1]), "charge_card", args)
	if err != nil || !replayed(retry) {
		t.Fatalf("the retry through the other proxy pod %s: replayed %v, %v", pods[1].Name, replayed(retry), err)
	}
	for range 5 {
		if res, err := callAs(s, agentToken, viaService, "charge_card", args); err != nil || !replayed(res) {
			t.Fatalf("a retry through the proxy's Service: replayed %v, %v", replayed(res), err)
		}
	}
	if n := remote.Counts.Get("charge_card"); n != 1 {
		t.Fatalf("7 attempts of one charge by one token ran it %d times on the remote server, want 1", n)
	}
	_ = first

	// Another token's identical call is another caller's: it runs.
	if _, err := callAs(s, "Bearer e2e-other-agent", viaService, "charge_card", args); err != nil {
		t.Fatal(err)
	}
	if n := remote.Counts.Get("charge_card"); n != 2 {
		t.Fatalf("another token's identical charge: the server ran %d charges in all, want 2", n)
	}

	// A policy change reaches the proxy pods live: Synced follows, no pod
	// restarts.
	p, err := s.getPolicy()
	if err != nil {
		t.Fatal(err)
	}
	patch := client.MergeFrom(p.DeepCopy())
	p.Spec.WaitTimeout = &metav1.Duration{Duration: 20 * time.Second}
	if err := s.k8s.Patch(s.ctx, p, patch); err != nil {
		t.Fatal(err)
	}
	poll.Within(t, time.Minute, "the proxy's Synced shows the new policy on both pods", func() error {
		p, err := s.getPolicy()
		if err != nil {
			return err
		}
		px, err := s.getProxy()
		if err != nil {
			return err
		}
		if p.Status.ObservedGeneration != p.Generation || px.Status.PolicyHash != p.Status.PolicyHash || px.Status.Synced != "2/2" {
			return fmt.Errorf("proxy synced %s at %s, policy %s (generation %d of %d)", px.Status.Synced, px.Status.PolicyHash, p.Status.PolicyHash, p.Status.ObservedGeneration, p.Generation)
		}
		return nil
	})
	now := s.proxyPods(t, 2)
	for _, p := range pods {
		if !slices.ContainsFunc(now, func(q corev1.Pod) bool { return q.UID == p.UID }) {
			t.Fatalf("proxy pod %s was replaced by the policy change; it should have come live", p.Name)
		}
	}

	// A proxy pod killed mid-call: the call is not run twice.
	before := remote.Counts.Get("charge_card")
	slow := map[string]any{"card": "4242", "amount": 51, "delayMs": 4000}
	ch := make(chan error, 1)
	go func() {
		_, err := callAs(s, agentToken, direct(pods[0]), "charge_card", slow)
		ch <- err
	}()
	time.Sleep(time.Second) // the call is on the remote server now (it takes 4s)
	s.run(t, "-n", s.ns, "delete", "pod", pods[0].Name, "--grace-period=30", "--wait=false")
	firstErr := <-ch
	s.proxyPods(t, 2)
	res, err := callAs(s, agentToken, viaService, "charge_card", slow)
	if got := remote.Counts.Get("charge_card") - before; got > 1 {
		t.Fatalf("a charge whose proxy pod was killed mid-call ran %d times (first attempt: %v; retry: %v)", got, firstErr, err)
	}
	t.Logf("killed proxy pod mid-call: first attempt %v; retry replayed %v, %v", firstErr, replayed(res), err)

	// Deleting the proxy takes its objects with it (the garbage collector).
	if err := s.k8s.Delete(s.ctx, px); err != nil {
		t.Fatal(err)
	}
	poll.Within(t, 2*time.Minute, "the proxy's Deployment, Service, PodDisruptionBudget and pods gone", func() error {
		var left []string
		for _, o := range []client.Object{&appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}} {
			if err := s.k8s.Get(s.ctx, client.ObjectKey{Namespace: s.ns, Name: proxyName}, o); !apierrors.IsNotFound(err) {
				left = append(left, fmt.Sprintf("%T", o))
			}
		}
		var l corev1.PodList
		if err := s.k8s.List(s.ctx, &l, client.InNamespace(s.ns), client.MatchingLabels{v1alpha1.LabelProxy: proxyName}); err != nil {
			return err
		}
		if len(l.Items) > 0 {
			left = append(left, fmt.Sprintf("%d pods", len(l.Items)))
		}
		if len(left) > 0 {
			return fmt.Errorf("left: %s", strings.Join(left, ", "))
		}
		return nil
	})
}
