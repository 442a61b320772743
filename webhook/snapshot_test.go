package webhook_test

import (
	"context"
	"encoding/json"
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

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/webhook"
)

func freePort(t *testing.T) int32 {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	return int32(l.Addr().(*net.TCPAddr).Port)
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

	srv := mcpserver.New()
	upstream := httptest.NewUnstartedServer(srv.Handler(true))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	upstream.Listener = l
	upstream.Start()
	defer upstream.Close()

	cfg := webhook.DefaultConfig(testImage)
	cfg.ProxyPort, cfg.AdminPort = freePort(t), freePort(t)
	pod := mcpPod(ns, "mcp-0", map[string]string{webhook.AnnotationInject: "true", webhook.AnnotationPolicy: "tickets"})
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
		if e.ValueFrom == nil {
			cmd.Env = append(cmd.Env, e.Name+"="+e.Value)
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
	cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: "http://127.0.0.1:" + portOf(t, c, "mcp")}, nil)
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
