package webhook_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/webhook"
)

func freePort(t *testing.T) int32 {
	t.Helper()
	return int32(freeport.LoopbackPort(t)) //nolint:gosec // a port fits
}

// TestInjectedSidecarEnforcesItsSnapshot runs `idemcp sidecar` with exactly
// the args and env the webhook injected, with no manager to ask, and checks
// that it enforces the policy it was given.
func TestInjectedSidecarEnforcesItsSnapshot(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	createPolicy(t, ns, "tickets", v1alpha1.IdempotencyPolicySpec{
		DefaultMode: v1alpha1.ModeDeduplicate,
		Tools:       []v1alpha1.ToolRule{{Name: "refund", Mode: v1alpha1.ModePassthrough}},
	})

	// The server listens only on the "pod IP", 127.0.0.2 (tests reach
	// loopback alone), so the sidecar reaches it only if it dials the
	// IPs the kubelet puts in IDEMCP_UPSTREAM_DIAL_IPS, not the
	// --upstream address 127.0.0.1.
	const podIP = "127.0.0.2"
	srv := mcpserver.New()
	upstream := httptest.NewUnstartedServer(srv.Handler(true))
	l, err := net.Listen("tcp", podIP+":0")
	if err != nil {
		t.Fatal(err)
	}
	upstream.Listener = l
	upstream.Start()
	defer upstream.Close()

	cfg := webhook.DefaultConfig(testImage)
	cfg.ProxyPort, cfg.AdminPort = freePort(t), freePort(t)
	pod := mcpPod(ns, "mcp-0", map[string]string{webhook.AnnotationPolicy: "tickets"})
	pod.Spec.Containers[0].Ports[0].ContainerPort = int32(l.Addr().(*net.TCPAddr).Port)
	inj := &webhook.Injector{Client: k8s, Config: cfg, MissingPolicy: webhook.MissingPolicyDeny, Recorder: recorder()}
	if err := inj.Default(ctx, pod); err != nil {
		t.Fatal(err)
	}
	c, _ := sidecarOf(t, pod)

	bin := filepath.Join(t.TempDir(), "idemcp")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/idemcp/idemcp").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, c.Args...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			cmd.Env = append(cmd.Env, e.Name+"="+e.Value)
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.podIPs":
			cmd.Env = append(cmd.Env, e.Name+"="+podIP) // as the kubelet resolves it
		}
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()

	admin := "http://127.0.0.1:" + portOf(t, c, webhook.PortNameAdmin)
	var ready string
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get(admin + "/readyz")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			ready = string(b)
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sidecar never got ready: %v %s", err, ready)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var status webhook.Status
	_ = json.Unmarshal([]byte(pod.Annotations[webhook.AnnotationStatus]), &status)
	if !strings.Contains(ready, "policy="+status.PolicyHash) {
		t.Errorf("/readyz says %q, want the injected policy %s", ready, status.PolicyHash)
	}

	client := mcp.NewClient(&mcp.Implementation{Name: "t", Version: "1"}, nil)
	// A stateless server has no sessions: the caller's Authorization scopes
	// its keys (an anonymous caller is not deduplicated).
	cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{
		Endpoint:   "http://127.0.0.1:" + portOf(t, c, "mcp"),
		HTTPClient: &http.Client{Transport: bearer("agent-1")},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cs.Close() }()
	args := map[string]any{"card": "4242", "amount": 3}
	for range 3 {
		for _, tool := range []string{"charge_card", "refund"} {
			if _, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args}); err != nil {
				t.Fatalf("%s: %v", tool, err)
			}
		}
	}
	if got := srv.Counts.Get("charge_card"); got != 1 {
		t.Errorf("charge_card ran %d times, want 1", got)
	}
	if got := srv.Counts.Get("refund"); got != 3 {
		t.Errorf("refund ran %d times, want 3: the snapshot's Passthrough rule was not enforced", got)
	}
}

func portOf(t *testing.T, c corev1.Container, name string) string {
	t.Helper()
	for _, p := range c.Ports {
		if p.Name == name {
			return itoa(p.ContainerPort)
		}
	}
	t.Fatalf("sidecar has no port %q: %+v", name, c.Ports)
	return ""
}

// maxPolicy is as large as the CRD lets a policy's tool rules and Redis
// addresses be, written with the characters JSON escapes longest (U+2028
// and '<' become six bytes each).
func maxPolicy(pointerChars int) v1alpha1.IdempotencyPolicySpec {
	spec := v1alpha1.IdempotencyPolicySpec{
		Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{
			SentinelMaster:    "mymaster",
			PasswordSecretRef: &v1alpha1.SecretKeyRef{Name: "redis", Key: "password"},
		}}},
	}
	for i := range 32 {
		spec.Store.Redis.External.Addresses = append(spec.Store.Redis.External.Addresses, strings.Repeat("<", 251)+fmt.Sprintf("%03d:6379", i))
	}
	ttl := metav1.Duration{Duration: 719*time.Hour + 59*time.Minute + 59*time.Second}
	for i := range 64 {
		spec.Tools = append(spec.Tools, v1alpha1.ToolRule{
			Name: fmt.Sprintf("%03d", i) + strings.Repeat("x", 125), Mode: v1alpha1.ModePassthrough, TTL: &ttl,
			KeyScope: v1alpha1.ScopePrincipal, OnAbandoned: v1alpha1.AbandonedError, CacheToolErrors: true,
		})
	}
	for i := 0; pointerChars > 0; i++ {
		n := min(pointerChars, 256)
		pointerChars -= n
		rule := &spec.Tools[i/32]
		rule.IgnoreArguments = append(rule.IgnoreArguments, "/"+strings.Repeat("\u2028", n-1))
	}
	return spec
}

// TestLargestPolicyFitsItsEnvironmentVariable: the CRD's bounds keep every
// policy's snapshot under Linux's 128 KiB for one environment string, and
// the API server refuses a policy past them with a message that says why.
func TestLargestPolicyFitsItsEnvironmentVariable(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	createSecret(t, ns, "redis", true, map[string]string{"password": "x"})
	createPolicy(t, ns, "payments", maxPolicy(8192))
	pod := mcpPod(ns, "largest", optIn)
	if err := k8s.Create(ctx, pod); err != nil {
		t.Fatalf("a pod using the largest valid policy: %v", err)
	}
	c, _ := sidecarOf(t, pod)
	snap := envValue(c, "IDEMCP_POLICY").Value
	t.Logf("the largest valid policy's snapshot is %d bytes of %d", len(snap), webhook.MaxPolicySnapshotBytes)
	if len(snap) > webhook.MaxPolicySnapshotBytes || len(snap) < 100<<10 {
		t.Errorf("snapshot of %d bytes: want at most %d, and the test policy at least 100 KiB to mean something", len(snap), webhook.MaxPolicySnapshotBytes)
	}

	over := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "over", Namespace: ns}, Spec: maxPolicy(8193)}
	err := k8s.Create(ctx, over)
	if err == nil || !strings.Contains(err.Error(), "the ignoreArguments pointers of all tools may have at most 8192 characters together") {
		t.Errorf("a policy past the bound: %v", err)
	}
}

// TestOversizedSnapshotIsRefused: a policy the CRD did not bound (written
// before the bounds, or through fields they leave open) is refused with
// the reason, instead of a sidecar that fails with E2BIG.
func TestOversizedSnapshotIsRefused(t *testing.T) {
	p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "huge", Namespace: "shop"}, Spec: maxPolicy(8192)}
	p.Spec.Store.Redis.External.SentinelMaster = strings.Repeat("m", 64<<10)
	pod := mcpPod("shop", "mcp-0", map[string]string{webhook.AnnotationPolicy: "huge"})
	before := pod.DeepCopy()
	err := webhook.Inject(pod, p, "hash", sidecar)
	var r *webhook.Refusal
	if !errors.As(err, &r) || r.Reason != webhook.DenyPolicyTooLarge || !strings.Contains(err.Error(), "more than the 131057 that fit in the sidecar's IDEMCP_POLICY environment variable") {
		t.Fatalf("Inject: %v, want a policy_too_large refusal", err)
	}
	if !equality.Semantic.DeepEqual(before, pod) {
		t.Error("a refused Inject changed the pod")
	}
}

// bearer sends Authorization: Bearer token with every request.
type bearer string

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+string(b))
	return http.DefaultTransport.RoundTrip(r)
}
