package controllers_test

import (
	"context"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/test/poll"
	"github.com/idemcp/idemcp/webhook"
)

func newProxyPolicy(t *testing.T, ns, name string) *v1alpha1.IdempotencyPolicy {
	t.Helper()
	p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	return p
}

func newProxy(ns, name string, spec v1alpha1.IdempotentProxySpec) *v1alpha1.IdempotentProxy {
	return &v1alpha1.IdempotentProxy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: spec}
}

func proxyCondition(t *testing.T, ns, name, typ string) (*metav1.Condition, *v1alpha1.IdempotentProxy) {
	t.Helper()
	var px v1alpha1.IdempotentProxy
	if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, &px); err != nil {
		return nil, nil
	}
	return meta.FindStatusCondition(px.Status.Conditions, typ), &px
}

// waitProxyCondition waits until condition typ of the proxy has reason,
// and returns it.
func waitProxyCondition(t *testing.T, ns, name, typ, reason string) metav1.Condition {
	t.Helper()
	var got metav1.Condition
	eventually(t, fmt.Sprintf("IdempotentProxy %s condition %s reason %s", name, typ, reason), func() error {
		c, px := proxyCondition(t, ns, name, typ)
		if c == nil {
			return fmt.Errorf("no condition %s yet", typ)
		}
		if c.Reason != reason || c.ObservedGeneration != px.Generation {
			return fmt.Errorf("%s is %s/%s (generation %d of %d): %s", typ, c.Status, c.Reason, c.ObservedGeneration, px.Generation, c.Message)
		}
		got = *c
		return nil
	})
	return got
}

// tlsUpstream is an HTTPS server with its own CA that counts the requests
// it gets: the controller's check must send none.
func tlsUpstream(t *testing.T) (*httptest.Server, *atomic.Int32, string) {
	t.Helper()
	var requests atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		requests.Add(1)
		w.WriteHeader(http.StatusTeapot)
	}))
	// On a port freeport reserves for this process, so that a test that
	// closes the server can listen on its address again.
	ln, err := net.Listen("tcp", freeport.Loopback(t))
	if err != nil {
		t.Fatal(err)
	}
	_ = srv.Listener.Close()
	srv.Listener = ln
	srv.StartTLS()
	t.Cleanup(srv.Close)
	caPEM := string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}))
	return srv, &requests, caPEM
}

func TestIdempotentProxyObjects(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	newProxyPolicy(t, ns, "payments")
	px := newProxy(ns, "stripe", v1alpha1.IdempotentProxySpec{
		Upstream:  v1alpha1.ProxyUpstream{URL: "https://mcp.stripe.example/mcp"},
		PolicyRef: v1alpha1.PolicyReference{Name: "payments"},
	})
	if err := k8s.Create(ctx, px); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "stripe"}

	var dep appsv1.Deployment
	eventually(t, "the proxy's Deployment", func() error { return k8s.Get(ctx, key, &dep) })
	var svc corev1.Service
	eventually(t, "the proxy's Service", func() error { return k8s.Get(ctx, key, &svc) })
	var pdb policyv1.PodDisruptionBudget
	eventually(t, "the proxy's PodDisruptionBudget", func() error { return k8s.Get(ctx, key, &pdb) })
	if err := k8s.Get(ctx, key, px); err != nil {
		t.Fatal(err)
	}
	for _, o := range []client.Object{&dep, &svc, &pdb} {
		// What the garbage collector deletes with the proxy (envtest runs
		// none: the reference is what it follows).
		if !metav1.IsControlledBy(o, px) {
			t.Errorf("%T %s is not controlled by the proxy: %+v", o, o.GetName(), o.GetOwnerReferences())
		}
	}
	if got := ptr.Deref(dep.Spec.Replicas, 0); got != 2 {
		t.Errorf("Deployment replicas = %d, want the default 2", got)
	}
	pod := dep.Spec.Template
	if pod.Labels[v1alpha1.LabelPolicy] != "payments" || pod.Labels[v1alpha1.LabelInject] != "false" {
		t.Errorf("pod labels %v: want %s=payments (the policy stream admits the pod by it) and %s=false", pod.Labels, v1alpha1.LabelPolicy, v1alpha1.LabelInject)
	}
	if len(pod.Spec.Containers) != 1 {
		t.Fatalf("pod has %d containers, want the data plane alone", len(pod.Spec.Containers))
	}
	c := pod.Spec.Containers[0]
	if c.Image != "ghcr.io/idemcp/idemcp:test" || !slices.Equal(c.Command, []string{webhook.ProxyCommand}) {
		t.Errorf("container runs %s %v, want the sidecar image's data plane %s", c.Image, c.Command, webhook.ProxyCommand)
	}
	for _, want := range []string{"--upstream=https://mcp.stripe.example/mcp", "--upstream-host-header=upstream"} {
		if !slices.Contains(c.Args, want) {
			t.Errorf("args %v lack %s", c.Args, want)
		}
	}
	env := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		env[e.Name] = e
	}
	if !strings.Contains(env["IDEMCP_POLICY"].Value, `"name":"payments"`) {
		t.Errorf("IDEMCP_POLICY = %q, want the policy's snapshot", env["IDEMCP_POLICY"].Value)
	}
	if _, ok := env[webhook.EnvUpstreamDialIPs]; ok {
		t.Errorf("env has %s: a remote upstream must never be dialled at the pod's own IPs", webhook.EnvUpstreamDialIPs)
	}
	if c.ReadinessProbe == nil || c.LivenessProbe == nil || c.StartupProbe == nil {
		t.Errorf("probes missing: readiness %v liveness %v startup %v", c.ReadinessProbe, c.LivenessProbe, c.StartupProbe)
	}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != 8080 || svc.Spec.Ports[0].TargetPort.StrVal != webhook.PortNameMCP {
		t.Errorf("Service ports %+v, want 8080 to the container port %s", svc.Spec.Ports, webhook.PortNameMCP)
	}

	// A spec change reaches the objects. The controller patches the
	// status (the upstream check, every second here) between a Get and an
	// Update: retry on the conflict.
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8s.Get(ctx, key, px); err != nil {
			return err
		}
		px.Spec.Replicas, px.Spec.Port = ptr.To[int32](3), 9000
		px.Spec.Upstream.HostHeader = v1alpha1.HostClient
		return k8s.Update(ctx, px)
	}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the Deployment and Service follow the spec", func() error {
		if err := k8s.Get(ctx, key, &dep); err != nil {
			return err
		}
		if err := k8s.Get(ctx, key, &svc); err != nil {
			return err
		}
		switch {
		case ptr.Deref(dep.Spec.Replicas, 0) != 3:
			return fmt.Errorf("replicas %d", ptr.Deref(dep.Spec.Replicas, 0))
		case svc.Spec.Ports[0].Port != 9000:
			return fmt.Errorf("service port %d", svc.Spec.Ports[0].Port)
		case !slices.Contains(dep.Spec.Template.Spec.Containers[0].Args, "--upstream-host-header=client"):
			return fmt.Errorf("args %v", dep.Spec.Template.Spec.Containers[0].Args)
		}
		return nil
	})

	// A policy change that the stream brings live restarts nothing: the
	// template (and so every pod) stays as it is.
	before := dep.Spec.Template.DeepCopy()
	var oldHash string
	eventually(t, "the proxy's status names the policy version", func() error {
		_, px := proxyCondition(t, ns, "stripe", v1alpha1.ConditionConfigured)
		if px == nil || px.Status.PolicyHash == "" {
			return fmt.Errorf("no policy hash yet")
		}
		oldHash = px.Status.PolicyHash
		return nil
	})
	// The controller writes the policy's status meanwhile: the update
	// retries on a conflict.
	updatePolicy(t, ns, "payments", func(p *v1alpha1.IdempotencyPolicy) {
		p.Spec.TTL = &metav1.Duration{Duration: 3600e9}
	})
	eventually(t, "the proxy's status names the new policy version", func() error {
		_, px := proxyCondition(t, ns, "stripe", v1alpha1.ConditionConfigured)
		if px == nil || px.Status.PolicyHash == oldHash {
			return fmt.Errorf("still the old hash %s", oldHash)
		}
		return nil
	})
	if err := k8s.Get(ctx, key, &dep); err != nil {
		t.Fatal(err)
	}
	if !equalTemplates(before, &dep.Spec.Template) {
		t.Errorf("a ttl change rewrote the pod template (a rollout of every proxy pod); it should reach them on the policy stream")
	}

	// Ready replicas show as the Deployment reports them (envtest runs no
	// Deployment controller: the test writes its status).
	dep.Status.Replicas, dep.Status.ReadyReplicas, dep.Status.AvailableReplicas = 3, 3, 3
	if err := k8s.Status().Update(ctx, &dep); err != nil {
		t.Fatal(err)
	}
	waitProxyCondition(t, ns, "stripe", v1alpha1.ConditionAvailable, v1alpha1.ReasonReplicasReady)
	_, got := proxyCondition(t, ns, "stripe", v1alpha1.ConditionAvailable)
	if got.Status.Ready != "3/3" {
		t.Errorf("status.ready = %q, want 3/3", got.Status.Ready)
	}
}

func equalTemplates(a, b *corev1.PodTemplateSpec) bool {
	ea, eb := a.Spec.Containers[0].Env, b.Spec.Containers[0].Env
	return slices.EqualFunc(ea, eb, func(x, y corev1.EnvVar) bool { return x.Name == y.Name && x.Value == y.Value }) &&
		a.Annotations[webhook.AnnotationStatus] == b.Annotations[webhook.AnnotationStatus]
}

func TestIdempotentProxyRefusesBadSpecs(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	ref := v1alpha1.PolicyReference{Name: "p"}
	for _, tt := range []struct {
		name string
		spec v1alpha1.IdempotentProxySpec
		want string
	}{
		{"no upstream", v1alpha1.IdempotentProxySpec{PolicyRef: ref}, "spec.upstream needs exactly one of url"},
		{"url and service", v1alpha1.IdempotentProxySpec{PolicyRef: ref, Upstream: v1alpha1.ProxyUpstream{URL: "https://a.example", Service: &v1alpha1.ServiceUpstream{Name: "s", Port: 80}}}, "spec.upstream needs exactly one of url"},
		{"ftp scheme", v1alpha1.IdempotentProxySpec{PolicyRef: ref, Upstream: v1alpha1.ProxyUpstream{URL: "ftp://a.example/mcp"}}, "spec.upstream.url must start with https:// or http://"},
		{"no host", v1alpha1.IdempotentProxySpec{PolicyRef: ref, Upstream: v1alpha1.ProxyUpstream{URL: "https://"}}, "spec.upstream.url must be an absolute URL with a host"},
		{"credentials in url", v1alpha1.IdempotentProxySpec{PolicyRef: ref, Upstream: v1alpha1.ProxyUpstream{URL: "https://u:p@a.example"}}, "spec.upstream.url must not carry credentials"},
		{"tls over http", v1alpha1.IdempotentProxySpec{PolicyRef: ref, Upstream: v1alpha1.ProxyUpstream{URL: "http://a.example", TLS: &v1alpha1.UpstreamTLS{ServerName: "a.example"}}}, "spec.upstream.tls applies only to an https:// upstream"},
		{"two ca sources", v1alpha1.IdempotentProxySpec{PolicyRef: ref, Upstream: v1alpha1.ProxyUpstream{URL: "https://a.example", TLS: &v1alpha1.UpstreamTLS{CABundle: &v1alpha1.CABundleSource{
			SecretRef: &v1alpha1.SecretKeyRef{Name: "s", Key: "ca.crt"}, ConfigMapRef: &v1alpha1.ConfigMapKeyRef{Name: "c", Key: "ca.crt"},
		}}}}, "spec.upstream.tls.caBundle needs exactly one of secretRef or configMapRef"},
		{"service is itself", v1alpha1.IdempotentProxySpec{PolicyRef: ref, Upstream: v1alpha1.ProxyUpstream{Service: &v1alpha1.ServiceUpstream{Name: "bad", Port: 80}}}, "spec.upstream.service.name must differ from metadata.name"},
		{"no policy name", v1alpha1.IdempotentProxySpec{Upstream: v1alpha1.ProxyUpstream{URL: "https://a.example"}}, "spec.policyRef.name"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := k8s.Create(ctx, newProxy(ns, "bad", tt.spec))
			if err == nil {
				_ = k8s.Delete(ctx, newProxy(ns, "bad", tt.spec))
				t.Fatalf("created; want it refused with %q", tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("refused with %v\nwant a message with %q", err, tt.want)
			}
		})
	}
}

func TestIdempotentProxyReportsMissingPolicyAndSecret(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	px := newProxy(ns, "remote", v1alpha1.IdempotentProxySpec{
		Upstream: v1alpha1.ProxyUpstream{URL: "https://127.0.0.1:1/mcp", TLS: &v1alpha1.UpstreamTLS{
			ClientCertSecretRef: &v1alpha1.LocalName{Name: "client-cert"},
		}},
		PolicyRef: v1alpha1.PolicyReference{Name: "absent"},
	})
	if err := k8s.Create(ctx, px); err != nil {
		t.Fatal(err)
	}
	c := waitProxyCondition(t, ns, "remote", v1alpha1.ConditionConfigured, v1alpha1.ReasonPolicyNotFound)
	if c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "spec.policyRef.name") || !strings.Contains(c.Message, ns+"/absent") {
		t.Errorf("Configured = %s: %s; want False naming spec.policyRef.name and the policy", c.Status, c.Message)
	}
	waitProxyCondition(t, ns, "remote", v1alpha1.ConditionReady, v1alpha1.ReasonNotConfigured)
	var dep appsv1.Deployment
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "remote"}, &dep); err == nil {
		t.Errorf("a Deployment was made without its policy")
	}

	newProxyPolicy(t, ns, "absent")
	c = waitProxyCondition(t, ns, "remote", v1alpha1.ConditionConfigured, v1alpha1.ReasonSecretNotFound)
	if !strings.Contains(c.Message, "spec.upstream.tls.clientCertSecretRef.name") || !strings.Contains(c.Message, "client-cert") {
		t.Errorf("Configured: %s; want the field spec.upstream.tls.clientCertSecretRef.name and the Secret named", c.Message)
	}

	// The Secret exists without idemcp's label: its owner did not consent.
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "client-cert"}, Type: corev1.SecretTypeTLS,
		Data: map[string][]byte{corev1.TLSCertKey: []byte("x"), corev1.TLSPrivateKeyKey: []byte("y")}}
	if err := k8s.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}
	c = waitProxyCondition(t, ns, "remote", v1alpha1.ConditionConfigured, v1alpha1.ReasonSecretNotLabelled)
	if !strings.Contains(c.Message, "idemcp.io/credentials") {
		t.Errorf("Configured: %s; want the label to add", c.Message)
	}
}

func TestIdempotentProxyUpstreamReachability(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	newProxyPolicy(t, ns, "p")
	srv, requests, caPEM := tlsUpstream(t)

	// Without the server's CA the handshake fails, and says what to set.
	px := newProxy(ns, "remote", v1alpha1.IdempotentProxySpec{
		Upstream:  v1alpha1.ProxyUpstream{URL: srv.URL + "/mcp"},
		PolicyRef: v1alpha1.PolicyReference{Name: "p"},
	})
	if err := k8s.Create(ctx, px); err != nil {
		t.Fatal(err)
	}
	c := waitProxyCondition(t, ns, "remote", v1alpha1.ConditionUpstreamReachable, v1alpha1.ReasonTLSHandshakeFailed)
	if c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "spec.upstream.tls.caBundle") {
		t.Errorf("UpstreamReachable = %s: %s; want False naming spec.upstream.tls.caBundle", c.Status, c.Message)
	}

	// With its CA from a ConfigMap, it is reachable.
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "upstream-ca"}, Data: map[string]string{"ca.crt": caPEM}}
	if err := k8s.Create(ctx, cm); err != nil {
		t.Fatal(err)
	}
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8s.Get(ctx, client.ObjectKeyFromObject(px), px); err != nil {
			return err
		}
		px.Spec.Upstream.TLS = &v1alpha1.UpstreamTLS{CABundle: &v1alpha1.CABundleSource{ConfigMapRef: &v1alpha1.ConfigMapKeyRef{Name: "upstream-ca", Key: "ca.crt"}}, ServerName: "example.com"}
		return k8s.Update(ctx, px)
	}); err != nil {
		t.Fatal(err)
	}
	c = waitProxyCondition(t, ns, "remote", v1alpha1.ConditionUpstreamReachable, v1alpha1.ReasonReachable)
	if c.Status != metav1.ConditionTrue || !strings.Contains(c.Message, "TLS handshake") {
		t.Errorf("UpstreamReachable = %s: %s; want True after a TLS handshake", c.Status, c.Message)
	}
	var dep appsv1.Deployment
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(px), &dep); err != nil {
		t.Fatal(err)
	}
	args := dep.Spec.Template.Spec.Containers[0].Args
	if !slices.Contains(args, "--upstream-ca-file=/etc/idemcp/upstream-ca/ca.crt") || !slices.Contains(args, "--upstream-server-name=example.com") {
		t.Errorf("args %v: want the CA file and the server name", args)
	}

	// The server goes away: the status follows.
	srv.Close()
	c = waitProxyCondition(t, ns, "remote", v1alpha1.ConditionUpstreamReachable, v1alpha1.ReasonUnreachable)
	if c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, strings.TrimPrefix(srv.URL, "https://")) {
		t.Errorf("UpstreamReachable = %s: %s; want False naming the address", c.Status, c.Message)
	}
	if c, _ := proxyCondition(t, ns, "remote", v1alpha1.ConditionReady); c == nil || c.Status != metav1.ConditionFalse {
		t.Errorf("Ready = %+v with the upstream down, want False", c)
	}

	// And back.
	ln, err := net.Listen("tcp", strings.TrimPrefix(srv.URL, "https://"))
	if err != nil {
		t.Fatalf("listening again on the server's address (freeport reserved it for this process): %v", err)
	}
	back := httptest.NewUnstartedServer(srv.Config.Handler)
	_ = back.Listener.Close()
	back.Listener = ln
	back.TLS = srv.TLS
	back.StartTLS()
	t.Cleanup(back.Close)
	waitProxyCondition(t, ns, "remote", v1alpha1.ConditionUpstreamReachable, v1alpha1.ReasonReachable)
	if n := requests.Load(); n != 0 {
		t.Errorf("the upstream got %d HTTP requests from the check; it must only dial", n)
	}
}

// TestProxySharesNoKeySpace: a proxy under a workload's Redis policy keeps
// its records under its own prefix, so the policy does not report the two
// as sharing one key space.
func TestProxySharesNoKeySpace(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	p := &v1alpha1.IdempotencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "shared", Namespace: ns},
		Spec: v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{
			External: &v1alpha1.ExternalRedis{Addresses: []string{"redis.shared.svc:6379"}},
		}}},
	}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	a := newDeployment(t, ns, "billing", "1111")
	injectedPod(t, ns, "billing-1111-x", "shared", a["1111"], true)
	b := newDeployment(t, ns, "remote", "2222")
	proxyPod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "remote-2222-x", Namespace: ns,
			Labels:          map[string]string{v1alpha1.LabelPolicy: "shared", v1alpha1.LabelInject: "false", v1alpha1.LabelProxy: "remote"},
			Annotations:     map[string]string{v1alpha1.AnnotationStatus: `{"policy":"shared"}`},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: b["2222"].Name, UID: b["2222"].UID, Controller: ptr.To(true)}}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "idemcp-proxy", Image: "idemcp:1"}}},
	}
	if err := k8s.Create(ctx, proxyPod); err != nil {
		t.Fatal(err)
	}
	setPodReady(t, proxyPod)
	eventually(t, "ExternalRedisConfigured with a workload and a proxy", func() error {
		return condition(getPolicy(t, ns, "shared"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonExternalRedis)
	})
	// It stays so while the reconciles the pods caused run (no signal says
	// they are done: look for 2s).
	poll.Throughout(t, 2*time.Second, "ExternalRedisConfigured", func() error {
		return condition(getPolicy(t, ns, "shared"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonExternalRedis)
	})
}

// TestIdempotentProxyNeverAdopts: a Service of the proxy's name that
// someone else made is left alone, and the status says what to do.
func TestIdempotentProxyNeverAdopts(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	newProxyPolicy(t, ns, "p")
	theirs := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "remote"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Port: 80}}, Selector: map[string]string{"app": "theirs"}}}
	if err := k8s.Create(ctx, theirs); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Create(ctx, newProxy(ns, "remote", v1alpha1.IdempotentProxySpec{
		Upstream: v1alpha1.ProxyUpstream{URL: "http://127.0.0.1:1"}, PolicyRef: v1alpha1.PolicyReference{Name: "p"},
	})); err != nil {
		t.Fatal(err)
	}
	c := waitProxyCondition(t, ns, "remote", v1alpha1.ConditionConfigured, v1alpha1.ReasonObjectConflict)
	if !strings.Contains(c.Message, "metadata.name") || !strings.Contains(c.Message, "Service") {
		t.Errorf("Configured: %s; want the Service and metadata.name named", c.Message)
	}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(theirs), theirs); err != nil {
		t.Fatal(err)
	}
	if len(theirs.OwnerReferences) != 0 || theirs.Spec.Selector["app"] != "theirs" {
		t.Errorf("their Service was changed: owners %v, selector %v", theirs.OwnerReferences, theirs.Spec.Selector)
	}
	// An unreachable plain-HTTP upstream is reported as such.
	c = waitProxyCondition(t, ns, "remote", v1alpha1.ConditionUpstreamReachable, v1alpha1.ReasonUnreachable)
	if !strings.Contains(c.Message, "127.0.0.1:1") {
		t.Errorf("UpstreamReachable: %s; want the address", c.Message)
	}
}
