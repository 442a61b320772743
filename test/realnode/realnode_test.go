//go:build e2e

// Package realnode is idemcp's end-to-end suite on a real Kubernetes node:
// kubelet, the scheduler, kube-proxy and the garbage collector, which envtest
// does not run. `make test-e2e` runs it inside the network namespace of the
// single-node cluster hack/realnode/up.sh starts (IDEMCP_E2E_NODE=1). It
// runs unchanged against any cluster in KUBECONFIG where idemcp is
// installed and the test MCP server's image (IDEMCP_E2E_MCP_IMAGE) can be
// pulled; there, the steps that need the node's network (MCP calls to
// Service and pod addresses) skip.
package realnode

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/config"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/cli"
	"github.com/idemcp/idemcp/test/poll"
	"github.com/idemcp/idemcp/test/testdeps"
	"github.com/idemcp/idemcp/webhook"
)

const (
	policyName = "payments"
	appName    = "mcp"
	serverPort = 8080
	agentToken = "Bearer e2e-agent"
)

type suite struct {
	ctx     context.Context
	k8s     client.Client
	ns      string
	mgrNS   string
	node    bool // inside the cluster's network: Service and pod addresses are reachable
	kubectl string
	svcURL  string
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func TestRealNode(t *testing.T) {
	if os.Getenv("KUBECONFIG") == "" {
		testdeps.Missing(t, "KUBECONFIG is not set: run make test-e2e (a single-node cluster of its own) or point KUBECONFIG at a cluster with idemcp installed")
	}
	if os.Getenv("IDEMCP_E2E_DISRUPTIVE") != "1" {
		t.Fatal("this suite deletes idemcp's manager pods and scales the manager to 0 for a while (steps ManagerPodDeleted and PlainPodWithoutManager): " +
			"set IDEMCP_E2E_DISRUPTIVE=1 to run it against the cluster in KUBECONFIG (make test-e2e sets it for the cluster it builds)")
	}
	cfg, err := config.GetConfig()
	if err != nil {
		t.Fatalf("KUBECONFIG: %v", err)
	}
	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = v1alpha1.AddToScheme(scheme)
	k8s, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		testdeps.Missing(t, "kubectl is not on PATH")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 18*time.Minute)
	defer cancel()
	s := &suite{
		ctx: ctx, k8s: k8s, kubectl: kubectl,
		ns:    fmt.Sprintf("idemcp-e2e-%d", time.Now().Unix()%100000),
		mgrNS: env("IDEMCP_E2E_MANAGER_NAMESPACE", "idemcp-system"),
		node:  os.Getenv("IDEMCP_E2E_NODE") == "1",
	}
	t.Cleanup(func() {
		if t.Failed() {
			s.dump(t)
		}
		c, stop := context.WithTimeout(context.Background(), 2*time.Minute)
		defer stop()
		_ = k8s.Delete(c, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: s.ns}})
		s.scaleManager(t, c, 2, false)
	})
	steps := []struct {
		name string
		run  func(*testing.T)
	}{
		{"Setup", s.setup},
		{"NativeSidecarStartsFirst", s.nativeSidecar},
		{"ManagerMemoryLimit", s.managerMemoryLimit},
		{"DedupThroughService", s.dedupThroughService},
		{"PolicyStatus", s.policyStatus},
		{"AnalyzeServiceAndVersion", s.analyzeServiceAndVersion},
		{"LivePolicyChange", s.livePolicyChange},
		{"ManagerPodDeleted", s.managerPodDeleted},
		{"RedisPodDeleted", s.redisPodDeleted},
		{"InjectedPodDeletedMidCall", s.podDeletedMidCall},
		{"RemoteServerThroughIdempotentProxy", s.remoteProxy},
		{"PlainPodWithoutManager", s.plainPodWithoutManager},
		{"DeletePolicy", s.deletePolicy},
	}
	for _, st := range steps {
		start := time.Now()
		ok := t.Run(st.name, st.run)
		t.Logf("step %s: %s", st.name, time.Since(start).Round(100*time.Millisecond))
		if !ok {
			return
		}
	}
}

// needNode leaves out a step that sends traffic to cluster addresses
// when the suite runs against a cluster it cannot reach (KUBECONFIG only):
// skipped there, a failure under CI=true.
func (s *suite) needNode(t *testing.T) {
	t.Helper()
	if !s.node {
		testdeps.Missing(t, "needs the cluster's network (IDEMCP_E2E_NODE=1, as make test-e2e runs it)")
	}
}

func (s *suite) run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.CommandContext(s.ctx, s.kubectl, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func (s *suite) dump(t *testing.T) {
	for _, args := range [][]string{
		{"get", "pods", "-A", "-o", "wide"},
		{"get", "idpol", "-A", "-o", "yaml"},
		{"get", "idpx", "-A", "-o", "yaml"},
		{"get", "events", "-A", "--sort-by=.lastTimestamp"},
		{"-n", s.mgrNS, "logs", "-l", "app.kubernetes.io/component=manager", "--prefix", "--tail=40"},
		{"-n", s.mgrNS, "get", "endpointslices", "-o", "wide"},
		{"-n", s.ns, "logs", "-l", "app=mcp", "-c", "idemcp-proxy", "--prefix", "--tail=30"},
	} {
		out, _ := exec.Command(s.kubectl, args...).CombinedOutput()
		t.Logf("kubectl %s:\n%s", strings.Join(args, " "), out)
	}
}

func (s *suite) policy() *v1alpha1.IdempotencyPolicy {
	return &v1alpha1.IdempotencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: policyName, Namespace: s.ns},
		Spec: v1alpha1.IdempotencyPolicySpec{
			TTL:                &metav1.Duration{Duration: time.Hour},
			Store:              v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{Managed: &v1alpha1.ManagedRedis{}}},
			OnStoreUnavailable: v1alpha1.FailClosed,
			KeyScope:           v1alpha1.ScopePrincipal,
			Tools: []v1alpha1.ToolRule{
				{Name: "charge_*", Mode: v1alpha1.ModeDeduplicate, OnAbandoned: v1alpha1.AbandonedError},
				{Name: "refund", Mode: v1alpha1.ModePassthrough},
			},
		},
	}
}

func restrictedContainer(c corev1.Container) corev1.Container {
	c.SecurityContext = &corev1.SecurityContext{
		AllowPrivilegeEscalation: ptr.To(false),
		ReadOnlyRootFilesystem:   ptr.To(true),
		RunAsNonRoot:             ptr.To(true),
		RunAsUser:                ptr.To[int64](65532),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
	return c
}

func (s *suite) mcpImage() string { return env("IDEMCP_E2E_MCP_IMAGE", "registry.local/mcpserver:e2e") }

func (s *suite) setup(t *testing.T) {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: s.ns, Labels: map[string]string{
		webhook.LabelInjection:               "enabled",
		"pod-security.kubernetes.io/enforce": "restricted",
	}}}
	if err := s.k8s.Create(s.ctx, ns); err != nil {
		t.Fatal(err)
	}
	if err := s.k8s.Create(s.ctx, s.policy()); err != nil {
		t.Fatal(err)
	}
	// The managed Redis first: the sidecars need it to start serving.
	poll.Within(t, 4*time.Minute, "StoreReady", func() error {
		return s.condition(v1alpha1.ConditionStoreReady, metav1.ConditionTrue)
	})
	labels := map[string]string{"app": appName}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: appName, Namespace: s.ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](2),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{
					Labels:      map[string]string{"app": appName, webhook.LabelInject: "true"},
					Annotations: map[string]string{webhook.AnnotationPolicy: policyName},
				},
				Spec: corev1.PodSpec{
					TerminationGracePeriodSeconds: ptr.To[int64](30),
					SecurityContext:               &corev1.PodSecurityContext{RunAsNonRoot: ptr.To(true), SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
					Containers: []corev1.Container{restrictedContainer(corev1.Container{
						Name:            "server",
						Image:           s.mcpImage(),
						ImagePullPolicy: corev1.PullIfNotPresent,
						Args:            []string{"-listen", fmt.Sprintf("0.0.0.0:%d", serverPort)},
						Ports:           []corev1.ContainerPort{{Name: "mcp", ContainerPort: serverPort}},
					})},
				},
			},
		},
	}
	if err := s.k8s.Create(s.ctx, dep); err != nil {
		t.Fatal(err)
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: appName, Namespace: s.ns},
		Spec: corev1.ServiceSpec{
			Selector: labels,
			Ports:    []corev1.ServicePort{{Name: "mcp", Port: 80, TargetPort: intstr.FromString("mcp")}},
		},
	}
	if err := s.k8s.Create(s.ctx, svc); err != nil {
		t.Fatal(err)
	}
	s.svcURL = fmt.Sprintf("http://%s/mcp", svc.Spec.ClusterIP)
	s.readyPods(t, 2)
}

// readyPods waits for n Ready pods of the Deployment (none terminating) and
// returns them.
func (s *suite) readyPods(t *testing.T, n int) []corev1.Pod {
	t.Helper()
	return s.readyPodsOf(t, "pods of "+appName, map[string]string{"app": appName}, n, 4*time.Minute)
}

// readyPodsOf waits until exactly n pods carry labels, all of them Ready
// and none terminating, and returns them.
func (s *suite) readyPodsOf(t *testing.T, what string, labels map[string]string, n int, within time.Duration) []corev1.Pod {
	t.Helper()
	var pods []corev1.Pod
	poll.Within(t, within, fmt.Sprintf("%d Ready %s", n, what), func() error {
		var l corev1.PodList
		if err := s.k8s.List(s.ctx, &l, client.InNamespace(s.ns), client.MatchingLabels(labels)); err != nil {
			return err
		}
		pods = pods[:0]
		for _, p := range l.Items {
			if p.DeletionTimestamp == nil && podReady(&p) {
				pods = append(pods, p)
			}
		}
		if len(pods) != n || len(l.Items) != n {
			return fmt.Errorf("%d of %d %s Ready", len(pods), len(l.Items), what)
		}
		return nil
	})
	return pods
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func (s *suite) getPolicy() (*v1alpha1.IdempotencyPolicy, error) {
	var p v1alpha1.IdempotencyPolicy
	err := s.k8s.Get(s.ctx, client.ObjectKey{Namespace: s.ns, Name: policyName}, &p)
	return &p, err
}

func (s *suite) condition(typ string, want metav1.ConditionStatus) error {
	p, err := s.getPolicy()
	if err != nil {
		return err
	}
	for _, c := range p.Status.Conditions {
		if c.Type == typ {
			if c.Status != want {
				return fmt.Errorf("%s is %s (%s: %s)", typ, c.Status, c.Reason, c.Message)
			}
			return nil
		}
	}
	return fmt.Errorf("no %s condition", typ)
}

func (s *suite) nativeSidecar(t *testing.T) {
	for _, p := range s.readyPods(t, 2) {
		var side *corev1.Container
		for i := range p.Spec.InitContainers {
			if p.Spec.InitContainers[i].Name == webhook.ContainerName {
				side = &p.Spec.InitContainers[i]
			}
		}
		if side == nil || side.RestartPolicy == nil || *side.RestartPolicy != corev1.ContainerRestartPolicyAlways {
			t.Fatalf("pod %s: no native sidecar %s among its init containers", p.Name, webhook.ContainerName)
		}
		if side.StartupProbe == nil {
			t.Fatalf("pod %s: the sidecar has no startup probe, so kubelet would not wait for it", p.Name)
		}
		if side.SecurityContext == nil || !ptr.Deref(side.SecurityContext.ReadOnlyRootFilesystem, false) {
			t.Fatalf("pod %s: the sidecar does not run with a read-only root filesystem", p.Name)
		}
		var sideStarted, serverStarted time.Time
		for _, c := range p.Status.InitContainerStatuses {
			if c.Name == webhook.ContainerName && c.State.Running != nil && ptr.Deref(c.Started, false) && c.Ready {
				sideStarted = c.State.Running.StartedAt.Time
			}
		}
		for _, c := range p.Status.ContainerStatuses {
			if c.Name != webhook.ContainerName && c.State.Running != nil {
				serverStarted = c.State.Running.StartedAt.Time
			}
		}
		if sideStarted.IsZero() || serverStarted.IsZero() {
			t.Fatalf("pod %s: sidecar started %v, server started %v", p.Name, sideStarted, serverStarted)
		}
		if serverStarted.Before(sideStarted) {
			t.Fatalf("pod %s: the MCP server started at %s, before the sidecar (%s)", p.Name, serverStarted, sideStarted)
		}
		// kubelet starts the main containers only once the sidecar's
		// startup probe passed: the sidecar's own log says when it served.
		logs := s.run(t, "-n", s.ns, "logs", p.Name, "-c", webhook.ContainerName)
		t.Logf("pod %s: sidecar started %s, MCP server %s; sidecar log:\n%s", p.Name,
			sideStarted.Format(time.RFC3339), serverStarted.Format(time.RFC3339), firstLines(logs, 5))
	}
}

// managerMemoryLimit checks that each manager's Go runtime took its soft
// memory limit from its container's, as it read it from its cgroup under
// the real kubelet and runc: without one, the garbage of every sidecar
// reconnecting at once can reach the OOM killer.
func (s *suite) managerMemoryLimit(t *testing.T) {
	pods := s.managerPods(t)
	if len(pods) == 0 {
		t.Fatalf("no manager pods in %s", s.mgrNS)
	}
	for _, p := range pods {
		lim, ok := p.Spec.Containers[0].Resources.Limits[corev1.ResourceMemory]
		if !ok {
			t.Fatalf("manager pod %s has no memory limit", p.Name)
		}
		// The kernel keeps a limit in whole pages; the manager's own log
		// (zap's JSON, or its console encoder's "key": value) says it.
		page := int64(os.Getpagesize())
		want := cli.SoftMemoryLimit(lim.Value() / page * page)
		logs := s.run(t, "-n", s.mgrNS, "logs", p.Name, "-c", p.Spec.Containers[0].Name)
		if !regexp.MustCompile(fmt.Sprintf(`"GOMEMLIMIT": ?%d\b`, want)).MatchString(logs) {
			t.Fatalf("manager pod %s: its log does not say it set its Go memory limit to %d, %.0f%% of its container's %s:\n%s",
				p.Name, want, cli.MemoryLimitShare*100, lim.String(), firstLines(logs, 10))
		}
	}
}

func firstLines(s string, n int) string {
	l := strings.SplitN(s, "\n", n+1)
	if len(l) > n {
		l = l[:n]
	}
	return strings.Join(l, "\n")
}

// call is one attempt of an agent: a new connection and session, the
// agent's credentials, one tools/call.
func call(ctx context.Context, endpoint, tool string, args map[string]any) (*mcp.CallToolResult, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	hc := &http.Client{Transport: authTransport{}}
	c := mcp.NewClient(&mcp.Implementation{Name: "e2e-agent", Version: "1.0.0"}, nil)
	cs, err := c.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: endpoint, HTTPClient: hc, MaxRetries: -1}, nil)
	if err != nil {
		return nil, err
	}
	defer func() { _ = cs.Close() }()
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
	if err != nil {
		return nil, err
	}
	if res.IsError {
		return res, fmt.Errorf("%s answered an error: %v", tool, res.Content)
	}
	return res, nil
}

type authTransport struct{}

func (authTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", agentToken)
	return http.DefaultTransport.RoundTrip(r)
}

func rpcCode(err error) int64 {
	var we *jsonrpc.Error
	if errors.As(err, &we) {
		return we.Code
	}
	return 0
}

func replayed(res *mcp.CallToolResult) bool {
	return res != nil && res.Meta["idemcp.io/replayed"] == true
}

func httpGet(ctx context.Context, url string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(b), err
}

// runs is how many times tool ran in the MCP server of each of pods.
func (s *suite) runs(t *testing.T, pods []corev1.Pod, tool string) int {
	t.Helper()
	total := 0
	for _, p := range pods {
		out, err := httpGet(s.ctx, fmt.Sprintf("http://%s:%d/counts?name=%s", p.Status.PodIP, serverPort, tool))
		if err != nil {
			t.Fatalf("pod %s: %v", p.Name, err)
		}
		n, err := strconv.Atoi(strings.TrimSpace(out))
		if err != nil {
			t.Fatalf("pod %s: counts %q", p.Name, out)
		}
		total += n
	}
	return total
}

func sidecarStatus(t *testing.T, p *corev1.Pod) webhook.Status {
	t.Helper()
	var st webhook.Status
	if err := json.Unmarshal([]byte(p.Annotations[webhook.AnnotationStatus]), &st); err != nil {
		t.Fatalf("pod %s: %s: %v", p.Name, webhook.AnnotationStatus, err)
	}
	return st
}

// handled is how many tools/call the sidecar of p answered (executed or
// replayed), from its metrics.
func (s *suite) handled(t *testing.T, p *corev1.Pod) int {
	t.Helper()
	return s.metric(t, p, "executed", "replayed")
}

// metric sums idemcp_tool_calls_total of the given outcomes in p's sidecar.
func (s *suite) metric(t *testing.T, p *corev1.Pod, outcomes ...string) int {
	t.Helper()
	st := sidecarStatus(t, p)
	out, err := httpGet(s.ctx, fmt.Sprintf("http://%s:%d/metrics", p.Status.PodIP, st.AdminPort))
	if err != nil {
		t.Fatalf("pod %s: %v", p.Name, err)
	}
	n := 0
	for _, line := range strings.Split(out, "\n") {
		for _, o := range outcomes {
			if strings.HasPrefix(line, `idemcp_tool_calls_total{outcome="`+o+`"}`) {
				f := strings.Fields(line)
				v, _ := strconv.ParseFloat(f[len(f)-1], 64)
				n += int(v)
			}
		}
	}
	return n
}

// burst makes n identical calls at once and returns their results.
func (s *suite) burst(t *testing.T, n int, tool string, args map[string]any) []*mcp.CallToolResult {
	t.Helper()
	results := make([]*mcp.CallToolResult, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { results[i], errs[i] = call(s.ctx, s.svcURL, tool, args) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("call %d of %d: %v", i+1, n, err)
		}
	}
	return results
}

func (s *suite) dedupThroughService(t *testing.T) {
	s.needNode(t)
	pods := s.readyPods(t, 2)
	// kube-proxy routes to both pods once it has seen both endpoints:
	// Passthrough calls (refund, not deduplicated yet) until both answered.
	poll.Within(t, time.Minute, "the Service routes to both pods", func() error {
		if _, err := call(s.ctx, s.svcURL, "refund", map[string]any{"card": "1", "amount": 1}); err != nil {
			return err
		}
		for i := range pods {
			if s.metric(t, &pods[i], "passthrough") == 0 {
				return fmt.Errorf("pod %s has answered none yet", pods[i].Name)
			}
		}
		return nil
	})
	before := []int{s.handled(t, &pods[0]), s.handled(t, &pods[1])}
	res := s.burst(t, 30, "charge_card", map[string]any{"card": "4242", "amount": 30})
	after := []int{s.handled(t, &pods[0]), s.handled(t, &pods[1])}
	if got := s.runs(t, pods, "charge_card"); got != 1 {
		t.Fatalf("30 identical calls ran charge_card %d times, want 1", got)
	}
	nReplayed := 0
	for _, r := range res {
		if replayed(r) {
			nReplayed++
		}
	}
	if nReplayed != 29 {
		t.Fatalf("%d of 30 answers were replays, want 29", nReplayed)
	}
	for i, p := range pods {
		if after[i] == before[i] {
			t.Fatalf("pod %s answered none of the 30 calls: the Service did not spread them (%v -> %v)", p.Name, before, after)
		}
	}
	t.Logf("30 calls through the Service: pods answered %d and %d of them; charge_card ran once", after[0]-before[0], after[1]-before[1])
}

func (s *suite) policyStatus(t *testing.T) {
	poll.Within(t, 2*time.Minute, "Synced 2/2 and Ready", func() error {
		p, err := s.getPolicy()
		if err != nil {
			return err
		}
		if err := s.condition(v1alpha1.ConditionStoreReady, metav1.ConditionTrue); err != nil {
			return err
		}
		if err := s.condition(v1alpha1.ConditionReady, metav1.ConditionTrue); err != nil {
			return err
		}
		if sc := p.Status.Sidecars; sc == nil || sc.Ratio != "2/2" {
			return fmt.Errorf("sidecars %+v", sc)
		}
		return nil
	})
	out := s.run(t, "-n", s.ns, "get", "idpol", policyName)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 {
		t.Fatalf("kubectl get idpol:\n%s", out)
	}
	// kubectl aligns the columns and leaves a cell blank when its field is
	// unset (RETRY-WINDOW, without spec.retryWindow): read each cell at its
	// header's offset, not by counting words.
	header, row := lines[0], lines[1]
	col := func(name string) string {
		at := strings.Index(header, name)
		if at < 0 || at >= len(row) {
			return ""
		}
		if f := strings.Fields(row[at:]); len(f) > 0 && !strings.HasPrefix(row[at:], " ") {
			return f[0]
		}
		return ""
	}
	if col("SYNCED") != "2/2" || col("READY") != "True" || col("STORE") != "Redis" {
		t.Fatalf("kubectl get idpol, want SYNCED 2/2, READY True, STORE Redis:\n%s", out)
	}
	t.Logf("kubectl get idpol:\n%s", out)
}

func (s *suite) livePolicyChange(t *testing.T) {
	p, err := s.getPolicy()
	if err != nil {
		t.Fatal(err)
	}
	patch := client.MergeFrom(p.DeepCopy())
	p.Spec.Tools[1].Mode = v1alpha1.ModeDeduplicate
	changed := time.Now()
	if err := s.k8s.Patch(s.ctx, p, patch); err != nil {
		t.Fatal(err)
	}
	var took time.Duration
	poll.Within(t, time.Minute, "both sidecars acknowledge the change", func() error {
		p, err := s.getPolicy()
		if err != nil {
			return err
		}
		sc := ptr.Deref(p.Status.Sidecars, v1alpha1.SidecarsStatus{})
		if p.Status.ObservedGeneration != p.Generation || sc.SyncedHash != p.Status.PolicyHash || sc.Synced != 2 {
			return fmt.Errorf("observedGeneration %d of %d, %d sidecars synced to %s (policy %s)", p.Status.ObservedGeneration, p.Generation, sc.Synced, sc.SyncedHash, p.Status.PolicyHash)
		}
		took = time.Since(changed)
		return nil
	})
	t.Logf("both sidecars applied and acknowledged the change %s after the patch", took.Round(time.Millisecond))
	if took > time.Second {
		t.Fatalf("the change reached both sidecars after %s, want within 1s", took)
	}
	if !s.node {
		return
	}
	pods := s.readyPods(t, 2)
	before := s.runs(t, pods, "refund")
	s.burst(t, 10, "refund", map[string]any{"card": "4242", "amount": 7})
	if got := s.runs(t, pods, "refund") - before; got != 1 {
		t.Fatalf("refund is now Deduplicate, yet 10 identical calls ran it %d times", got)
	}
}

func (s *suite) managerPods(t *testing.T) []corev1.Pod {
	t.Helper()
	var l corev1.PodList
	if err := s.k8s.List(s.ctx, &l, client.InNamespace(s.mgrNS), client.MatchingLabels{"app.kubernetes.io/component": "manager"}); err != nil {
		t.Fatal(err)
	}
	return l.Items
}

func (s *suite) managerPodDeleted(t *testing.T) {
	old := s.managerPods(t)
	if len(old) == 0 {
		t.Fatalf("no manager pods in %s", s.mgrNS)
	}
	for i := range old {
		if err := s.k8s.Delete(s.ctx, &old[i], client.GracePeriodSeconds(0)); err != nil {
			t.Fatal(err)
		}
	}
	if s.node {
		// No manager now: the sidecars keep deduplicating on their own.
		pods := s.readyPods(t, 2)
		res := s.burst(t, 10, "charge_card", map[string]any{"card": "4242", "amount": 31})
		if got := s.runs(t, pods, "charge_card"); got != 2 {
			t.Fatalf("with the manager's pods deleted, charge_card ran %d times in all, want 2 (one per distinct call)", got)
		}
		if n := countReplayed(res); n != 9 {
			t.Fatalf("%d of 10 answers were replays, want 9", n)
		}
	}
	poll.Within(t, 3*time.Minute, "a new manager Ready and the sidecars resynced", func() error {
		var d appsv1.Deployment
		if err := s.k8s.Get(s.ctx, client.ObjectKey{Namespace: s.mgrNS, Name: "idemcp-manager"}, &d); err != nil {
			return err
		}
		if d.Status.ReadyReplicas < 1 {
			return fmt.Errorf("%d manager replicas ready", d.Status.ReadyReplicas)
		}
		for _, p := range s.managerPods(t) {
			for _, o := range old {
				if p.UID == o.UID {
					return fmt.Errorf("old manager pod %s still there", p.Name)
				}
			}
		}
		p, err := s.getPolicy()
		if err != nil {
			return err
		}
		sc := ptr.Deref(p.Status.Sidecars, v1alpha1.SidecarsStatus{})
		if sc.Connected != 2 || sc.Synced != 2 || sc.SyncedHash != p.Status.PolicyHash {
			return fmt.Errorf("sidecars %+v", sc)
		}
		return nil
	})
	// The status above may still be the old manager's: only a change that
	// both sidecars acknowledge shows they are connected to the new one.
	p, err := s.getPolicy()
	if err != nil {
		t.Fatal(err)
	}
	patch := client.MergeFrom(p.DeepCopy())
	p.Spec.TTL = &metav1.Duration{Duration: ptr.Deref(p.Spec.TTL, metav1.Duration{Duration: time.Hour}).Duration + time.Minute}
	changed := time.Now()
	if err := s.k8s.Patch(s.ctx, p, patch); err != nil {
		t.Fatal(err)
	}
	poll.Within(t, 2*time.Minute, "both sidecars acknowledge a change through the new manager", func() error {
		p, err := s.getPolicy()
		if err != nil {
			return err
		}
		sc := ptr.Deref(p.Status.Sidecars, v1alpha1.SidecarsStatus{})
		if p.Status.ObservedGeneration != p.Generation || sc.SyncedHash != p.Status.PolicyHash || sc.Synced != 2 {
			return fmt.Errorf("observedGeneration %d of %d, %d sidecars synced to %s (policy %s)", p.Status.ObservedGeneration, p.Generation, sc.Synced, sc.SyncedHash, p.Status.PolicyHash)
		}
		return nil
	})
	t.Logf("through the new manager, both sidecars acknowledged a change %s after the patch", time.Since(changed).Round(time.Millisecond))
}

func countReplayed(res []*mcp.CallToolResult) int {
	n := 0
	for _, r := range res {
		if replayed(r) {
			n++
		}
	}
	return n
}

func (s *suite) redisPod() (*corev1.Pod, error) {
	var p corev1.Pod
	err := s.k8s.Get(s.ctx, client.ObjectKey{Namespace: s.ns, Name: policyName + "-redis-0"}, &p)
	return &p, err
}

func (s *suite) redisPodDeleted(t *testing.T) {
	s.needNode(t)
	pods := s.readyPods(t, 2)
	done := map[string]any{"card": "4242", "amount": 40}
	first, err := call(s.ctx, s.svcURL, "charge_card", done)
	if err != nil || replayed(first) {
		t.Fatalf("a new call: %v (replayed %v)", err, replayed(first))
	}
	before := s.runs(t, pods, "charge_card")
	// While Redis is gone, FailClosed answers -32013 and runs nothing. A
	// Redis pod can be back within a second or two, before any call meets
	// the gap: then delete it again, up to 3 times.
	var old *corev1.Pod
	sawClosed := false
	for attempt, i := 1, 0; !sawClosed; attempt++ {
		if attempt > 3 {
			t.Fatal("3 times Redis came back before any call saw it gone")
		}
		if old, err = s.redisPod(); err != nil {
			t.Fatal(err)
		}
		if err := s.k8s.Delete(s.ctx, old); err != nil {
			t.Fatal(err)
		}
	calls:
		for ; !sawClosed; i++ {
			_, err := call(s.ctx, s.svcURL, "charge_card", map[string]any{"card": "4242", "amount": 1000 + i})
			switch code := rpcCode(err); {
			case code == -32013:
				sawClosed = true
			case err != nil:
				t.Fatalf("while Redis is gone: %v (code %d), want -32013", err, code)
			default:
				p, gerr := s.redisPod()
				if gerr == nil && p.UID != old.UID && podReady(p) {
					t.Logf("Redis came back before any call saw it gone (attempt %d)", attempt)
					break calls
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	ran := s.runs(t, pods, "charge_card")
	// Back means back for every sidecar: each one's Redis client holds
	// its own dial backoff (go-redis fails a dial at once, after enough
	// failed ones, until a probe a second apart gets through), so one
	// sidecar answering says nothing of the other, and the retry below
	// goes through the Service to either.
	direct := make([]string, len(pods))
	for i := range pods {
		direct[i] = fmt.Sprintf("http://%s:%d/mcp", pods[i].Status.PodIP, sidecarStatus(t, &pods[i]).ProxyPort)
	}
	poll.Within(t, 3*time.Minute, "Redis back for every sidecar", func() error {
		p, err := s.redisPod()
		if err != nil {
			return err
		}
		if p.UID == old.UID || !podReady(p) {
			return errors.New("not Ready yet")
		}
		// A charge with new arguments runs only if the store answers
		// (counted in settled, not in the check below).
		for i, url := range direct {
			if _, err := call(s.ctx, url, "charge_card", map[string]any{"card": "4242", "amount": time.Now().UnixNano()}); err != nil {
				return fmt.Errorf("pod %s: %w", pods[i].Name, err)
			}
		}
		return nil
	})
	settled := s.runs(t, pods, "charge_card")
	res, err := call(s.ctx, s.svcURL, "charge_card", done)
	if err != nil {
		t.Fatalf("the retry after Redis returned: %v", err)
	}
	if !replayed(res) {
		t.Fatal("a call completed before Redis restarted ran again after it (the durable store lost it)")
	}
	if got := s.runs(t, pods, "charge_card"); got != settled {
		t.Fatalf("charge_card ran %d more times after Redis returned, want 0", got-settled)
	}
	t.Logf("Redis deleted: calls answered -32013 (charge_card runs %d -> %d while it was away, from calls before the deletion reached it); after its return the earlier call was replayed", before, ran)
}

func (s *suite) podDeletedMidCall(t *testing.T) {
	s.needNode(t)
	pods := s.readyPods(t, 2)
	victim := pods[0]
	st := sidecarStatus(t, &victim)
	direct := fmt.Sprintf("http://%s:%d/mcp", victim.Status.PodIP, st.ProxyPort)
	args := map[string]any{"card": "4242", "amount": 50, "delayMs": 4000}
	type outcome struct {
		res *mcp.CallToolResult
		err error
	}
	ch := make(chan outcome, 1)
	go func() {
		r, err := call(s.ctx, direct, "charge_card", args)
		ch <- outcome{r, err}
	}()
	time.Sleep(time.Second) // the call is in the MCP server now (it takes 4s)
	s.run(t, "-n", s.ns, "delete", "pod", victim.Name, "--grace-period=30", "--wait=false")
	first := <-ch
	// The Deployment replaces the pod; the retry goes to whichever pod.
	s.readyPods(t, 2)
	res, err := call(s.ctx, s.svcURL, "charge_card", args)
	if first.err == nil {
		if err != nil || !replayed(res) {
			t.Fatalf("the call finished while its pod was deleted, yet a retry was not replayed: %v", err)
		}
		t.Log("the call in flight finished during the pod's graceful shutdown; its retry was replayed")
		return
	}
	if err == nil && !replayed(res) {
		t.Fatalf("the call in flight failed (%v) and its retry ran the tool again", first.err)
	}
	t.Logf("the call in flight failed (%v); its retry: %v (onAbandoned: Error)", first.err, err)
}

func (s *suite) scaleManager(t *testing.T, ctx context.Context, n int32, wait bool) {
	var d appsv1.Deployment
	key := client.ObjectKey{Namespace: s.mgrNS, Name: "idemcp-manager"}
	if err := s.k8s.Get(ctx, key, &d); err != nil {
		t.Logf("manager Deployment: %v", err)
		return
	}
	if ptr.Deref(d.Spec.Replicas, 1) != n {
		patch := client.MergeFrom(d.DeepCopy())
		d.Spec.Replicas = ptr.To(n)
		if err := s.k8s.Patch(ctx, &d, patch); err != nil {
			t.Fatalf("scaling the manager to %d: %v", n, err)
		}
	}
	if !wait {
		return
	}
	poll.Within(t, 3*time.Minute, fmt.Sprintf("manager scaled to %d", n), func() error {
		if err := s.k8s.Get(ctx, key, &d); err != nil {
			return err
		}
		var l corev1.PodList
		if err := s.k8s.List(ctx, &l, client.InNamespace(s.mgrNS), client.MatchingLabels{"app.kubernetes.io/component": "manager"}); err != nil {
			return err
		}
		if int(n) == 0 && len(l.Items) != 0 || d.Status.ReadyReplicas != n {
			return fmt.Errorf("%d pods, %d ready", len(l.Items), d.Status.ReadyReplicas)
		}
		return nil
	})
}

func (s *suite) plainPodWithoutManager(t *testing.T) {
	s.scaleManager(t, s.ctx, 0, true)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "plain", Namespace: s.ns, Labels: map[string]string{"app": "plain"}},
		Spec: corev1.PodSpec{
			SecurityContext: &corev1.PodSecurityContext{RunAsNonRoot: ptr.To(true), SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
			Containers: []corev1.Container{restrictedContainer(corev1.Container{
				Name: "server", Image: s.mcpImage(), ImagePullPolicy: corev1.PullIfNotPresent,
				Args: []string{"-listen", fmt.Sprintf("0.0.0.0:%d", serverPort)},
			})},
		},
	}
	if err := s.k8s.Create(s.ctx, pod); err != nil {
		t.Fatalf("a pod that did not opt in, with the manager at 0 replicas: %v", err)
	}
	poll.Within(t, 2*time.Minute, "the plain pod Ready", func() error {
		if err := s.k8s.Get(s.ctx, client.ObjectKeyFromObject(pod), pod); err != nil {
			return err
		}
		if !podReady(pod) {
			return fmt.Errorf("phase %s", pod.Status.Phase)
		}
		return nil
	})
	if len(pod.Spec.InitContainers) != 0 || len(pod.Spec.Containers) != 1 {
		t.Fatalf("the plain pod was changed: %d init containers, %d containers", len(pod.Spec.InitContainers), len(pod.Spec.Containers))
	}
	s.scaleManager(t, s.ctx, 2, true)
}

func (s *suite) deletePolicy(t *testing.T) {
	s.run(t, "-n", s.ns, "delete", "idpol", policyName, "--wait=false")
	// In use by the two pods: the policy stays (terminating), and so does
	// its Redis.
	poll.Within(t, time.Minute, "the policy marked for deletion", func() error {
		p, err := s.getPolicy()
		if err != nil {
			return err
		}
		if p.DeletionTimestamp == nil {
			return errors.New("no deletionTimestamp")
		}
		return nil
	})
	time.Sleep(3 * time.Second) // what the controller would do, it has had time to
	p, err := s.getPolicy()
	if err != nil {
		t.Fatalf("the policy went away while pods still used it: %v", err)
	}
	found := false
	for _, f := range p.Finalizers {
		found = found || f == v1alpha1.FinalizerInUse
	}
	if !found {
		t.Fatalf("the policy in use has finalizers %v, want %s", p.Finalizers, v1alpha1.FinalizerInUse)
	}
	var sts appsv1.StatefulSet
	if err := s.k8s.Get(s.ctx, client.ObjectKey{Namespace: s.ns, Name: policyName + "-redis"}, &sts); err != nil {
		t.Fatalf("the managed Redis went away while pods still used it: %v", err)
	}
	if s.node {
		if _, err := call(s.ctx, s.svcURL, "charge_card", map[string]any{"card": "4242", "amount": 60}); err != nil {
			t.Fatalf("a call while the policy is being deleted: %v", err)
		}
	}
	// The pods go; then the policy and its Redis do.
	if err := s.k8s.Delete(s.ctx, &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: s.ns, Name: appName}}); err != nil {
		t.Fatal(err)
	}
	out := s.run(t, "-n", s.ns, "wait", "--for=delete", "idpol/"+policyName, "--timeout=180s")
	t.Log(strings.TrimSpace(out))
	poll.Within(t, 2*time.Minute, "the managed Redis cleaned up", func() error {
		var left []string
		for _, o := range []client.Object{&appsv1.StatefulSet{}, &corev1.Service{}, &corev1.Secret{}} {
			if err := s.k8s.Get(s.ctx, client.ObjectKey{Namespace: s.ns, Name: policyName + "-redis"}, o); !apierrors.IsNotFound(err) {
				left = append(left, fmt.Sprintf("%T (%v)", o, err))
			}
		}
		var pvc corev1.PersistentVolumeClaim
		if err := s.k8s.Get(s.ctx, client.ObjectKey{Namespace: s.ns, Name: "data-" + policyName + "-redis-0"}, &pvc); !apierrors.IsNotFound(err) {
			left = append(left, "PersistentVolumeClaim")
		}
		var pods corev1.PodList
		if err := s.k8s.List(s.ctx, &pods, client.InNamespace(s.ns), client.MatchingLabels{v1alpha1.LabelPolicy: policyName}); err != nil {
			return err
		}
		if len(pods.Items) > 0 {
			left = append(left, fmt.Sprintf("%d pods", len(pods.Items)))
		}
		if len(left) > 0 {
			return fmt.Errorf("left: %s", strings.Join(left, ", "))
		}
		return nil
	})
}
