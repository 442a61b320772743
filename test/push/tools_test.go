package push

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/storeopen"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/test/poll"
)

// bearer adds a caller's Authorization header to every request.
type bearer struct{ token string }

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return http.DefaultTransport.RoundTrip(r)
}

// startPushedSidecar runs a real `idemcp sidecar` for pod mcp-0 of the
// policy, in front of server, taking its policy from the manager.
func startPushedSidecar(t *testing.T, mgr *replica, ns, name string, spec v1alpha1.IdempotencyPolicySpec, server *mcpserver.Server) (*sidecar.Sidecar, string) {
	t.Helper()
	_, token := createPod(t, ns, "mcp-0", name)
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	snapshot, _ := json.Marshal(v1alpha1.IdempotencyPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: v1alpha1.GroupVersion.String(), Kind: "IdempotencyPolicy"},
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: spec,
	})
	upstream := httptest.NewServer(server.Handler(false))
	t.Cleanup(upstream.Close)
	listen := freeAddr(t)
	sc, err := sidecar.New(sidecar.Options{
		Listen: listen, Upstream: upstream.URL, Policy: string(snapshot), LogLevel: "error", KeySpace: "Deployment/payments",
		Store:           storeopen.Options{MemoryMaxEntries: 1000},
		ShutdownTimeout: 5 * time.Second,
		Push:            sidecar.PushOptions{Endpoint: "https://" + mgr.addr, CABundle: string(caPEM), TokenFile: tokenFile},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sc.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Logf("sidecar: %v", err)
		}
	})
	return sc, listen
}

func toolOf(p *v1alpha1.IdempotencyPolicy, name string) *v1alpha1.ToolStatus {
	for i := range p.Status.Tools {
		if p.Status.Tools[i].Name == name {
			return &p.Status.Tools[i]
		}
	}
	return nil
}

// TestToolsTableAndLivePolicyChanges: a real sidecar in front of a real
// MCP server whose charge tools carry no annotations reports what it
// decided for each tool over the policy stream; the policy's status
// lists them, ToolsAnnotated is False naming the unannotated tools and
// the rule that would pass them through, a Warning event says so, and
// kubectl describe shows all of it. Then keyScope and the tool's
// ignoreArguments change live, and retries of the calls stored before
// each change are replayed: the tool never runs again.
func TestToolsTableAndLivePolicyChanges(t *testing.T) {
	const ns, name = "push-tools", "payments"
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t))
	spec := v1alpha1.IdempotencyPolicySpec{Tools: []v1alpha1.ToolRule{{Name: "refund", Mode: v1alpha1.ModePassthrough}}}
	createPolicy(t, ns, name, spec)
	server := mcpserver.New()
	sc, listen := startPushedSidecar(t, mgr, ns, name, spec, server)
	waitStatus(t, ns, name, 20*time.Second, synced(1, hashOf(t, spec)))

	want := map[string][2]string{
		"charge_card": {"Deduplicate", "noAnnotations"},
		"get_balance": {"Passthrough", "readOnlyHint"},
		"refund":      {"Passthrough", "rule"},
	}
	p := waitStatus(t, ns, name, 10*time.Second, func(p *v1alpha1.IdempotencyPolicy) error {
		for tool, w := range want {
			got := toolOf(p, tool)
			if got == nil || string(got.Mode) != w[0] || got.Reason != w[1] || got.Sidecars != 1 {
				return fmt.Errorf("status.tools[%s] = %+v, want mode %s, reason %s, 1 sidecar (tools %+v)", tool, got, w[0], w[1], p.Status.Tools)
			}
		}
		c := condition(p, v1alpha1.ConditionToolsAnnotated)
		if c == nil || c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonToolsUnannotated {
			return fmt.Errorf("ToolsAnnotated = %+v, want False/%s", c, v1alpha1.ReasonToolsUnannotated)
		}
		return nil
	})
	msg := condition(p, v1alpha1.ConditionToolsAnnotated).Message
	for _, part := range []string{"charge_card", "pod/mcp-0", `{name: "charge_card", mode: Passthrough}`} {
		if !regexp.MustCompile(regexp.QuoteMeta(part)).MatchString(msg) {
			t.Errorf("ToolsAnnotated message %q does not name %s", msg, part)
		}
	}
	if regexp.MustCompile(`get_balance|"refund"`).MatchString(msg) {
		t.Errorf("ToolsAnnotated message %q names a tool a rule or an annotation decides", msg)
	}

	user, err := env.ControlPlane.AddUser(envtest.User{Name: "tools-kubectl", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kubectl, err := user.Kubectl()
	if err != nil {
		t.Fatal(err)
	}
	var described string
	poll.Within(t, 15*time.Second, "kubectl describe idpol to show the tools, the condition and the Warning event", func() error {
		out, errOut, err := kubectl.Run("describe", "idempotencypolicy", name, "-n", ns)
		if err != nil {
			b, _ := io.ReadAll(errOut)
			return fmt.Errorf("kubectl describe: %w: %s", err, b)
		}
		b, _ := io.ReadAll(out)
		described = string(b)
		for _, re := range []string{
			`Tools:`,
			`Mode:\s+Deduplicate\s+Name:\s+charge_card\s+Reason:\s+noAnnotations`,
			`Mode:\s+Passthrough\s+Name:\s+get_balance\s+Reason:\s+readOnlyHint`,
			`Mode:\s+Passthrough\s+Name:\s+refund\s+Reason:\s+rule`,
			`Reason:\s+ToolsUnannotated`,
			`Type:\s+ToolsAnnotated`,
			`Warning\s+ToolsUnannotated\s+.*charge_card`,
		} {
			if !regexp.MustCompile(re).MatchString(described) {
				return fmt.Errorf("kubectl describe idempotencypolicy printed no %q:\n%s", re, described)
			}
		}
		return nil
	})

	// The live changes: calls stored under one policy, retried under the
	// next, never run again.
	cl := mcp.NewClient(&mcp.Implementation{Name: "push-tools", Version: "1"}, nil)
	cctx, ccancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer ccancel()
	cs, err := cl.Connect(cctx, &mcp.StreamableClientTransport{Endpoint: "http://" + listen, MaxRetries: -1,
		HTTPClient: &http.Client{Transport: bearer{"alice"}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.Close() })
	derived := &mcp.CallToolParams{Name: "charge_card", Arguments: map[string]any{"card": "c-1", "amount": 5, "requestedAt": "10:00"}}
	explicit := &mcp.CallToolParams{Name: "charge_card", Arguments: map[string]any{"card": "c-2", "amount": 7, "requestedAt": "10:00"},
		Meta: mcp.Meta{"idempotency-key": "order-7"}}
	call := func(what string, params *mcp.CallToolParams) bool {
		t.Helper()
		res, err := cs.CallTool(cctx, params)
		if err != nil || res.IsError {
			t.Fatalf("%s: %v %+v", what, err, res)
		}
		replayed, _ := res.Meta["idemcp.io/replayed"].(bool)
		return replayed
	}
	if call("first call", derived) || call("first call with a key", explicit) || server.Counts.Get("charge_card") != 2 {
		t.Fatalf("the first calls: %d charges, want 2, none replayed", server.Counts.Get("charge_card"))
	}
	for _, change := range []struct {
		what   string
		mutate func(*v1alpha1.IdempotencyPolicySpec)
	}{
		{"keyScope Session -> Principal", func(s *v1alpha1.IdempotencyPolicySpec) { s.KeyScope = v1alpha1.ScopePrincipal }},
		{"ignoreArguments [/requestedAt] on charge_card", func(s *v1alpha1.IdempotencyPolicySpec) {
			s.Tools = append([]v1alpha1.ToolRule{{Name: "charge_card", Mode: v1alpha1.ModeDeduplicate, IgnoreArguments: []string{"/requestedAt"}}}, s.Tools...)
		}},
	} {
		hash := updatePolicy(t, ns, name, change.mutate)
		poll.Within(t, 15*time.Second, "the sidecar to apply "+change.what, func() error {
			if got := sc.Engine().Policy().Hash; got != hash {
				return fmt.Errorf("the sidecar enforces %s, want %s", got, hash)
			}
			return nil
		})
		for _, params := range []*mcp.CallToolParams{derived, explicit} {
			if !call("a retry after "+change.what, params) {
				t.Errorf("a retry of %v after %s was not replayed", params.Arguments, change.what)
			}
		}
		if n := server.Counts.Get("charge_card"); n != 2 {
			t.Fatalf("after %s: %d charges, want still 2: a retry of a stored call ran again", change.what, n)
		}
	}
	waitStatus(t, ns, name, 10*time.Second, func(p *v1alpha1.IdempotencyPolicy) error {
		if got := toolOf(p, "charge_card"); got == nil || got.Reason != "rule" || got.Mode != v1alpha1.ModeDeduplicate {
			return fmt.Errorf("after the rule for charge_card: status.tools[charge_card] = %+v, want Deduplicate by rule", got)
		}
		return nil
	})
}
