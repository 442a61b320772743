package plugin_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/internal/plugin"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/test/envtestutil"
	"github.com/idemcp/idemcp/webhook"
)

const (
	managerNS    = "idemcp-system"
	managerImage = "ghcr.io/idemcp/idemcp:v0.3.0"
	webhookName  = "idemcp-mutating-webhook-configuration"
)

var (
	k8s        client.Client
	kubeconfig string
)

func TestMain(m *testing.M) {
	if !envtestutil.Available() {
		os.Exit(0)
	}
	env := &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join("..", "..", "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
	}
	os.Exit(envtestutil.Run(env, func(cfg *rest.Config) int {
		var err error
		if k8s, err = client.New(cfg, client.Options{Scheme: manager.NewScheme()}); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		dir, err := os.MkdirTemp("", "kubectl-idemcp")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer func() { _ = os.RemoveAll(dir) }()
		kubeconfig = filepath.Join(dir, "kubeconfig")
		if err := writeKubeconfig(cfg, kubeconfig); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if err := seedInstall(context.Background()); err != nil {
			fmt.Fprintln(os.Stderr, "seeding the install:", err)
			return 1
		}
		return m.Run()
	}))
}

// writeKubeconfig writes the envtest admin's kubeconfig, which the plugin
// reads as a user's.
func writeKubeconfig(cfg *rest.Config, path string) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["envtest"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData, Token: cfg.BearerToken}
	kc.Contexts["envtest"] = &clientcmdapi.Context{Cluster: "envtest", AuthInfo: "admin", Namespace: "default"}
	kc.CurrentContext = "envtest"
	return clientcmd.WriteToFile(*kc, path)
}

// run runs kubectl-idemcp with args against envtest.
func run(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = plugin.Main(append([]string{"--kubeconfig", kubeconfig}, args...), &out, &errOut)
	return out.String(), errOut.String(), code
}

// analyze runs analyze -o json and returns its report and exit code.
func analyze(t *testing.T, args ...string) (*plugin.Report, int) {
	t.Helper()
	out, errOut, code := run(t, append([]string{"analyze", "-o", "json"}, args...)...)
	var r plugin.Report
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("analyze output is not a report (%v): %s\nstderr: %s", err, out, errOut)
	}
	return &r, code
}

func selfSigned(notAfter time.Time) ([]byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: "idemcp-webhook-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: notAfter, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), nil
}

// seedInstall creates what a healthy idemcp installation shows the API
// server: the manager's Deployment (2 ready replicas) and
// PodDisruptionBudget, and the webhook configuration of config/webhook with
// a CA valid for a year. Its rules never match, so the API server calls no
// webhook: the plugin only reads the selectors and the CA.
func seedInstall(ctx context.Context) error {
	if err := k8s.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: managerNS}}); err != nil {
		return err
	}
	lbls := map[string]string{"app.kubernetes.io/name": "idemcp", "app.kubernetes.io/component": "manager"}
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "idemcp-manager", Namespace: managerNS, Labels: lbls},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](2),
			Selector: &metav1.LabelSelector{MatchLabels: lbls},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: lbls},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{
					Name: "manager", Image: managerImage,
					Args: []string{"manager", "--leader-elect", "--webhook-port=9443", "--policy-stream-bind-address=:9444"},
				}}},
			},
		},
	}
	if err := k8s.Create(ctx, d); err != nil {
		return err
	}
	if err := setManagerReady(ctx, 2); err != nil {
		return err
	}
	pdb := &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Name: "idemcp-manager", Namespace: managerNS, Labels: lbls},
		Spec:       policyv1.PodDisruptionBudgetSpec{MaxUnavailable: ptr.To(intstr.FromInt32(1)), Selector: &metav1.LabelSelector{MatchLabels: lbls}},
	}
	if err := k8s.Create(ctx, pdb); err != nil {
		return err
	}
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "webhook", "manifests.yaml"))
	if err != nil {
		return err
	}
	var wh admissionv1.MutatingWebhookConfiguration
	if err := yaml.Unmarshal(raw, &wh); err != nil {
		return err
	}
	ca, err := selfSigned(time.Now().Add(365 * 24 * time.Hour))
	if err != nil {
		return err
	}
	wh.Name = webhookName
	wh.Webhooks[0].Rules[0].Operations = []admissionv1.OperationType{admissionv1.Connect}
	wh.Webhooks[0].ClientConfig = admissionv1.WebhookClientConfig{URL: ptr.To("https://127.0.0.1:1/mutate-v1-pod"), CABundle: ca}
	return k8s.Create(ctx, &wh)
}

func setManagerReady(ctx context.Context, ready int32) error {
	var d appsv1.Deployment
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: managerNS, Name: "idemcp-manager"}, &d); err != nil {
		return err
	}
	d.Status.Replicas, d.Status.ReadyReplicas, d.Status.AvailableReplicas = 2, ready, ready
	return k8s.Status().Update(ctx, &d)
}

// newNamespace creates a namespace for one test, labelled for injection
// when enabled.
func newNamespace(t *testing.T, name string, enabled bool) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if enabled {
		ns.Labels = map[string]string{webhook.LabelInjection: "enabled"}
	}
	if err := k8s.Create(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	return name
}

func memorySpec() v1alpha1.IdempotencyPolicySpec {
	return v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreMemory}}
}

func condition(typ string, status metav1.ConditionStatus, reason, msg string, gen int64) metav1.Condition {
	return metav1.Condition{Type: typ, Status: status, Reason: reason, Message: msg, ObservedGeneration: gen, LastTransitionTime: metav1.Now()}
}

// readyPolicy creates a policy whose status says what a healthy one's
// does: Ready, every sidecar synced.
func readyPolicy(t *testing.T, ns, name string, spec v1alpha1.IdempotencyPolicySpec, sidecars int32) *v1alpha1.IdempotencyPolicy {
	t.Helper()
	p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: spec}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	compiled, err := policy.Compile(p.Spec)
	if err != nil {
		t.Fatal(err)
	}
	p.Status = v1alpha1.IdempotencyPolicyStatus{
		ObservedGeneration: p.Generation,
		PolicyHash:         compiled.Hash,
		Sidecars:           &v1alpha1.SidecarsStatus{Injected: sidecars, Connected: sidecars, Synced: sidecars, Ratio: fmt.Sprintf("%d/%d", sidecars, sidecars), SyncedHash: compiled.Hash},
		Conditions: []metav1.Condition{
			condition(v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonMemoryStore, "each sidecar keeps its own records", p.Generation),
			condition(v1alpha1.ConditionSidecarsSynced, metav1.ConditionTrue, v1alpha1.ReasonAllSynced, "all synced", p.Generation),
			condition(v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonReady, "ready", p.Generation),
		},
	}
	if err := k8s.Status().Update(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	return p
}

// mcpPod is an MCP server pod that opts in to policy.
func mcpPod(ns, name, policyName string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
			Labels:      map[string]string{webhook.LabelInject: "true", "app": "mcp"},
			Annotations: map[string]string{webhook.AnnotationPolicy: policyName}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "server", Image: "example.com/mcp-server:1",
			Ports: []corev1.ContainerPort{{Name: "mcp", ContainerPort: 8080}},
		}}},
	}
}

// injectedPod creates pod as the webhook would have injected it, with
// the webhook's own Inject and a sidecar of image.
func injectedPod(t *testing.T, pod *corev1.Pod, p *v1alpha1.IdempotencyPolicy, image string) *corev1.Pod {
	t.Helper()
	compiled, err := policy.Compile(p.Spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := webhook.Inject(pod, p, compiled.Hash, webhook.DefaultConfig(image)); err != nil {
		t.Fatal(err)
	}
	create(t, pod)
	return pod
}

func create(t *testing.T, obj client.Object) {
	t.Helper()
	if err := k8s.Create(context.Background(), obj); err != nil {
		t.Fatal(err)
	}
}

func mcpService(ns string, target intstr.IntOrString) *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "mcp", Namespace: ns},
		Spec:       corev1.ServiceSpec{Selector: map[string]string{"app": "mcp"}, Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: target}}},
	}
}

// codes lists the findings' codes, and fails on a finding without a
// message that names its object or without its docs link.
func codes(t *testing.T, r *plugin.Report) []string {
	t.Helper()
	var out []string
	for _, f := range r.Findings {
		out = append(out, f.Code)
		if f.Object == "" || f.Message == "" || f.Docs != plugin.DocsBase+"#"+strings.ToLower(f.Code) {
			t.Errorf("finding %+v lacks its object, message or docs link", f)
		}
	}
	return out
}

func wantOnly(t *testing.T, r *plugin.Report, code string, severity plugin.Severity, object string, words ...string) {
	t.Helper()
	got := codes(t, r)
	if len(got) == 0 {
		t.Fatalf("analyze found nothing, want %s", code)
	}
	for _, f := range r.Findings {
		if f.Code != code {
			t.Errorf("unexpected finding %s %s: %s", f.Code, f.Object, f.Message)
			continue
		}
		if f.Severity != severity || f.Object != object {
			t.Errorf("%s is %s about %s, want %s about %s", code, f.Severity, f.Object, severity, object)
		}
		for _, w := range words {
			if !strings.Contains(f.Message, w) {
				t.Errorf("%s message %q does not say %q", code, f.Message, w)
			}
		}
	}
}

func TestAnalyzeCleanInstallReportsNothing(t *testing.T) {
	ns := newNamespace(t, "clean", true)
	p := readyPolicy(t, ns, "payments", memorySpec(), 1)
	injectedPod(t, mcpPod(ns, "mcp-0", p.Name), p, managerImage)
	create(t, mcpService(ns, intstr.FromString("mcp")))
	// It runs first: the other tests' namespaces do not exist yet, so -A
	// sees the clean install alone.
	for _, scope := range [][]string{{"-n", ns}, {"-A"}} {
		r, code := analyze(t, scope...)
		if code != 0 || len(r.Findings) != 0 {
			t.Fatalf("a clean install, analyze %s: exit %d, findings %+v", scope, code, r.Findings)
		}
	}
	out, _, code := run(t, "analyze", "-n", ns)
	if code != 0 || !strings.Contains(out, "No problems found.") {
		t.Errorf("text output (exit %d): %q", code, out)
	}
}

func TestAnalyzeFindings(t *testing.T) {
	ctx := context.Background()
	t.Run("IDM001 labelled pod not injected", func(t *testing.T) {
		ns := newNamespace(t, "idm001", false)
		readyPolicy(t, ns, "payments", memorySpec(), 0)
		create(t, mcpPod(ns, "mcp-0", "payments"))
		r, code := analyze(t, "-n", ns)
		wantOnly(t, r, plugin.CodePodNotInjected, plugin.SeverityError, "pod/idm001/mcp-0", "not enabled for injection", "kubectl label namespace idm001 idemcp.io/injection=enabled")
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
	})
	t.Run("IDM002 policy not found", func(t *testing.T) {
		ns := newNamespace(t, "idm002", true)
		gone := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "gone", Namespace: ns}, Spec: memorySpec()}
		injectedPod(t, mcpPod(ns, "mcp-0", "gone"), gone, managerImage)
		r, code := analyze(t, "-n", ns)
		wantOnly(t, r, plugin.CodePolicyNotFound, plugin.SeverityError, "pod/idm002/mcp-0", "IdempotencyPolicy idm002/gone does not exist")
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
	})
	t.Run("IDM003 Service around the sidecar", func(t *testing.T) {
		for _, target := range []intstr.IntOrString{intstr.FromString(webhook.PortNameRenamed), intstr.FromInt32(8080)} {
			ns := newNamespace(t, "idm003-"+strings.ToLower(target.String()), true)
			p := readyPolicy(t, ns, "payments", memorySpec(), 1)
			injectedPod(t, mcpPod(ns, "mcp-0", p.Name), p, managerImage)
			create(t, mcpService(ns, target))
			r, code := analyze(t, "-n", ns)
			wantOnly(t, r, plugin.CodeServiceBypass, plugin.SeverityError, "service/"+ns+"/mcp", "targetPort "+target.String(), "port 8080 on pod mcp-0", "set targetPort: mcp")
			if code != 1 {
				t.Errorf("exit %d, want 1", code)
			}
		}
	})
	t.Run("IDM004 sidecar older than the manager", func(t *testing.T) {
		ns := newNamespace(t, "idm004", true)
		p := readyPolicy(t, ns, "payments", memorySpec(), 1)
		injectedPod(t, mcpPod(ns, "mcp-0", p.Name), p, "ghcr.io/idemcp/idemcp:v0.2.1")
		r, code := analyze(t, "-n", ns)
		wantOnly(t, r, plugin.CodeSidecarVersion, plugin.SeverityWarning, "pod/idm004/mcp-0", "v0.2.1, older than the manager's "+managerImage, "rollout restart")
		if code != 0 {
			t.Errorf("exit %d for a warning, want 0", code)
		}
	})
	t.Run("IDM005 policy not Ready", func(t *testing.T) {
		ns := newNamespace(t, "idm005", true)
		p := readyPolicy(t, ns, "payments", memorySpec(), 0)
		p.Status.Conditions = []metav1.Condition{
			condition(v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonSecretNotFound, "Secret idm005/redis-auth not found: create it", p.Generation),
			condition(v1alpha1.ConditionSidecarsSynced, metav1.ConditionTrue, v1alpha1.ReasonNoInjectedPods, "none", p.Generation),
			condition(v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady, "the store is not ready", p.Generation),
		}
		if err := k8s.Status().Update(ctx, p); err != nil {
			t.Fatal(err)
		}
		r, code := analyze(t, "-n", ns)
		wantOnly(t, r, plugin.CodePolicyNotReady, plugin.SeverityError, "idempotencypolicy/idm005/payments", "StoreNotReady", "SecretNotFound: Secret idm005/redis-auth not found")
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
	})
	t.Run("IDM006 policy not synced", func(t *testing.T) {
		ns := newNamespace(t, "idm006", true)
		p := readyPolicy(t, ns, "payments", memorySpec(), 0)
		meta := condition(v1alpha1.ConditionSidecarsSynced, metav1.ConditionFalse, v1alpha1.ReasonSyncing, "1 of 2 connected sidecars applied policy abc", p.Generation)
		p.Status.Conditions[1] = meta
		if err := k8s.Status().Update(ctx, p); err != nil {
			t.Fatal(err)
		}
		r, code := analyze(t, "-n", ns)
		wantOnly(t, r, plugin.CodePolicyNotSynced, plugin.SeverityWarning, "idempotencypolicy/idm006/payments", "Syncing", "1 of 2 connected sidecars")
		if code != 0 {
			t.Errorf("exit %d for a warning, want 0", code)
		}
	})
	t.Run("IDM007 namespace enabled, pods never opted in", func(t *testing.T) {
		ns := newNamespace(t, "idm007", true)
		create(t, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web-0", Namespace: ns}, Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Image: "nginx"}}}})
		r, _ := analyze(t, "-n", ns)
		wantOnly(t, r, plugin.CodeNamespaceNotOptedIn, plugin.SeverityWarning, "namespace/idm007", "pod web-0 never opted in", `idemcp.io/inject: "true"`)
	})
	t.Run("IDM008 Memory store with several replicas", func(t *testing.T) {
		ns := newNamespace(t, "idm008", true)
		p := readyPolicy(t, ns, "payments", memorySpec(), 2)
		injectedPod(t, mcpPod(ns, "mcp-0", p.Name), p, managerImage)
		injectedPod(t, mcpPod(ns, "mcp-1", p.Name), p, managerImage)
		r, code := analyze(t, "-n", ns)
		wantOnly(t, r, plugin.CodeMemoryStoreReplicas, plugin.SeverityWarning, "idempotencypolicy/idm008/payments", "pods mcp-0, mcp-1 use it", "store type Redis")
		if code != 0 {
			t.Errorf("exit %d for a warning, want 0", code)
		}
		// Before any pod runs: a workload of several replicas that opts in.
		ns = newNamespace(t, "idm008-workload", true)
		readyPolicy(t, ns, "payments", memorySpec(), 0)
		tmpl := mcpPod(ns, "", "payments")
		create(t, &appsv1.StatefulSet{
			ObjectMeta: metav1.ObjectMeta{Name: "mcp", Namespace: ns},
			Spec: appsv1.StatefulSetSpec{
				Replicas: ptr.To[int32](3), Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "mcp"}},
				Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: tmpl.Labels, Annotations: tmpl.Annotations}, Spec: tmpl.Spec},
			},
		})
		r, _ = analyze(t, "-n", ns)
		wantOnly(t, r, plugin.CodeMemoryStoreReplicas, plugin.SeverityWarning, "idempotencypolicy/idm008-workload/payments", "statefulset/mcp (3 replicas)")
	})
	t.Run("IDM009 skipped without a tools table", func(t *testing.T) {
		r, _ := analyze(t, "-n", "clean")
		found := false
		for _, n := range r.Notes {
			found = found || strings.Contains(n, "IDM009")
		}
		if !found {
			t.Errorf("no note says IDM009 was not checked: %q", r.Notes)
		}
	})
	t.Run("IDM010 webhook CA close to expiry", func(t *testing.T) {
		var wh admissionv1.MutatingWebhookConfiguration
		if err := k8s.Get(ctx, client.ObjectKey{Name: webhookName}, &wh); err != nil {
			t.Fatal(err)
		}
		good := wh.Webhooks[0].ClientConfig.CABundle
		t.Cleanup(func() {
			if err := k8s.Get(ctx, client.ObjectKey{Name: webhookName}, &wh); err == nil {
				wh.Webhooks[0].ClientConfig.CABundle = good
				_ = k8s.Update(ctx, &wh)
			}
		})
		for _, c := range []struct {
			in   time.Duration
			sev  plugin.Severity
			exit int
			say  string
		}{{3 * 24 * time.Hour, plugin.SeverityWarning, 0, "expires in 3 days"}, {-time.Hour, plugin.SeverityError, 1, "expired at"}} {
			soon, err := selfSigned(time.Now().Add(c.in))
			if err != nil {
				t.Fatal(err)
			}
			wh.Webhooks[0].ClientConfig.CABundle = soon
			if err := k8s.Update(ctx, &wh); err != nil {
				t.Fatal(err)
			}
			r, code := analyze(t, "-n", "clean")
			wantOnly(t, r, plugin.CodeWebhookCertExpiry, c.sev, "mutatingwebhookconfiguration/"+webhookName, "CA (caBundle)", c.say, "refuses every opted-in pod")
			if code != c.exit {
				t.Errorf("exit %d, want %d", code, c.exit)
			}
		}
	})
	t.Run("IDM011 manager below its PDB", func(t *testing.T) {
		if err := setManagerReady(ctx, 0); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = setManagerReady(ctx, 2) })
		r, code := analyze(t, "-n", "clean")
		wantOnly(t, r, plugin.CodeManagerBelowPDB, plugin.SeverityError, "deployment/idemcp-system/idemcp-manager", "0 ready replicas", "wants 1 healthy")
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
	})
}

// checkInject runs check-inject for one pod and returns its verdict and
// its text output.
func checkInject(t *testing.T, ns, pod string) (plugin.Verdict, string) {
	t.Helper()
	out, errOut, code := run(t, "check-inject", pod, "-n", ns, "-o", "json")
	if code != 0 {
		t.Fatalf("check-inject %s/%s: exit %d: %s", ns, pod, code, errOut)
	}
	var vs []plugin.Verdict
	if err := json.Unmarshal([]byte(out), &vs); err != nil || len(vs) != 1 {
		t.Fatalf("check-inject -o json: %v: %s", err, out)
	}
	text, _, _ := run(t, "check-inject", pod, "-n", ns)
	return vs[0], text
}

func TestCheckInject(t *testing.T) {
	enabled := newNamespace(t, "ci-enabled", true)
	off := newNamespace(t, "ci-off", false)
	p := readyPolicy(t, enabled, "payments", memorySpec(), 1)
	readyPolicy(t, off, "payments", memorySpec(), 0)

	unlabelled := mcpPod(enabled, "unlabelled", "payments")
	delete(unlabelled.Labels, webhook.LabelInject)
	create(t, unlabelled)
	create(t, mcpPod(off, "ns-off", "payments"))
	create(t, mcpPod(managerNS, "excluded", "payments"))
	create(t, mcpPod(enabled, "no-policy", "nope"))
	injectedPod(t, mcpPod(enabled, "injected", "payments"), p, managerImage)
	windows := mcpPod(enabled, "windows", "payments")
	windows.Spec.OS = &corev1.PodOS{Name: corev1.Windows}
	create(t, windows)
	create(t, mcpPod(enabled, "would", "payments"))

	for _, c := range []struct {
		ns, pod                       string
		injected, wouldInject, refuse bool
		words                         []string
	}{
		{enabled, "unlabelled", false, false, false, []string{`not labelled idemcp.io/inject: "true"`, "pod template"}},
		{off, "ns-off", false, false, false, []string{"namespace ci-off is not enabled for injection", "kubectl label namespace ci-off idemcp.io/injection=enabled", "once that is fixed, the webhook injects it"}},
		{managerNS, "excluded", false, false, false, []string{"namespace idemcp-system is excluded", "kube-system, idemcp-system", "another namespace"}},
		{enabled, "no-policy", false, false, true, []string{"refuses", "IdempotencyPolicy ci-enabled/nope not found: create it"}},
		{enabled, "injected", true, false, false, []string{"already injected"}},
		{enabled, "windows", false, false, true, []string{"refuses", "only on Linux", "Windows"}},
		{enabled, "would", false, true, false, []string{"the webhook injects a pod like this one (policy payments", "rollout restart"}},
	} {
		t.Run(c.pod, func(t *testing.T) {
			v, text := checkInject(t, c.ns, c.pod)
			if v.Injected != c.injected || v.WouldInject != c.wouldInject || v.Refused != c.refuse {
				t.Errorf("injected %t, would inject %t, refused %t; want %t, %t, %t: %q", v.Injected, v.WouldInject, v.Refused, c.injected, c.wouldInject, c.refuse, v.Reasons)
			}
			for _, w := range c.words {
				if !strings.Contains(text, w) {
					t.Errorf("check-inject says %q, without %q", text, w)
				}
			}
		})
	}

	t.Run("selector, every reason in order", func(t *testing.T) {
		// A pod in a disabled namespace that also names a missing policy:
		// the API server's selector first, then the webhook's refusal.
		create(t, mcpPod(off, "two-reasons", "nope"))
		out, _, code := run(t, "check-inject", "-l", "app=mcp", "-n", off)
		if code != 0 {
			t.Fatalf("exit %d", code)
		}
		i, j := strings.Index(out, "two-reasons"), strings.Index(out, "ns-off")
		if i < 0 || j < 0 {
			t.Fatalf("check-inject -l app=mcp does not list both pods: %s", out)
		}
		sec := out[i:]
		a, b := strings.Index(sec, "not enabled for injection"), strings.Index(sec, "once that is fixed, the webhook refuses a pod like this one: IdempotencyPolicy ci-off/nope not found")
		if a < 0 || b < 0 || a > b {
			t.Errorf("reasons not both there in the webhook's order: %s", sec)
		}
	})
}

func TestStatus(t *testing.T) {
	ns := newNamespace(t, "status", true)
	p := readyPolicy(t, ns, "payments", memorySpec(), 1)
	injectedPod(t, mcpPod(ns, "mcp-0", p.Name), p, managerImage)
	e := &plugin.Env{Client: k8s, Namespace: ns, Now: time.Now,
		Probe: func(_ context.Context, namespace, pod string, port int32) (string, error) {
			if namespace != ns || pod != "mcp-0" || port != 15481 {
				return "", fmt.Errorf("probed %s/%s:%d", namespace, pod, port)
			}
			return "ok policy=" + p.Status.PolicyHash + " store=reachable stream=connected\n", nil
		}}
	st, err := plugin.Status(context.Background(), e, "payments")
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Pods) != 1 {
		t.Fatalf("pods %+v, want mcp-0", st.Pods)
	}
	s := st.Pods[0]
	if s.AppliedHash != p.Status.PolicyHash || !s.Current || s.Store != "reachable" || s.Stream != "connected" || s.Version != "v0.3.0" || st.Sidecars.Connected != 1 {
		t.Errorf("status %+v of %+v", s, st)
	}

	// Through the CLI, where envtest has no kubelet to proxy to: the hash
	// the pod started with, the store unknown.
	out, _, code := run(t, "status", "payments", "-n", ns)
	if code != 0 || !strings.Contains(out, "mcp-0") || !strings.Contains(out, "(at start)") || !strings.Contains(out, "unknown") || !strings.Contains(out, "1 connected") {
		t.Errorf("status (exit %d):\n%s", code, out)
	}
}

func TestCommandLine(t *testing.T) {
	for _, args := range [][]string{{"analyze", "-o", "table"}, {"status"}, {"check-inject"}, {"check-inject", "a", "-l", "x=y"}, {"analyze", "--bogus"},
		{"keys", "list"}, {"keys", "list", "payments", "--state", "done"}, {"keys", "list", "payments", "-o", "table"},
		{"keys", "show", "payments"}, {"keys", "release", "payments"}, {"keys", "forget", "payments", "a", "b"}, {"keys", "show", "payments", "3f9a1c", "-o", "wide"}} {
		if _, _, code := run(t, args...); code != 2 {
			t.Errorf("%q: exit %d, want 2", args, code)
		}
	}
	for _, sub := range []string{"analyze", "check-inject", "status", "keys list", "keys show", "keys release", "keys forget"} {
		out, _, code := run(t, append(strings.Fields(sub), "--help")...)
		if code != 0 || !strings.Contains(out, "kubectl idemcp "+sub) || !strings.Contains(out, "--namespace") || !strings.Contains(out, "--context") || !strings.Contains(out, "--output") {
			t.Errorf("%s --help (exit %d) lacks kubectl's flags:\n%s", sub, code, out)
		}
	}
	if out, _, _ := run(t, "keys", "list", "--help"); !strings.Contains(out, "json|yaml|wide") || !strings.Contains(out, "--state") || !strings.Contains(out, "--since") {
		t.Errorf("keys list --help lacks -o json|yaml|wide, --state or --since:\n%s", out)
	}
	if out, _, _ := run(t, "--help"); !strings.Contains(out, "keys") || !strings.Contains(out, "--kubeconfig") {
		t.Errorf("kubectl idemcp --help lacks keys or --kubeconfig:\n%s", out)
	}
}

func TestAnalyzeManagerNotReady(t *testing.T) {
	ctx := context.Background()
	var pdb policyv1.PodDisruptionBudget
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: managerNS, Name: "idemcp-manager"}, &pdb); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Delete(ctx, &pdb); err != nil {
		t.Fatal(err)
	}
	if err := setManagerReady(ctx, 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pdb.ResourceVersion = ""
		if err := k8s.Create(ctx, &pdb); err != nil {
			t.Errorf("restoring the PodDisruptionBudget: %v", err)
		}
		_ = setManagerReady(ctx, 2)
	})
	r, code := analyze(t, "-n", "clean")
	wantOnly(t, r, plugin.CodeManagerNotReady, plugin.SeverityError, "deployment/idemcp-system/idemcp-manager", "no ready replica", "refuses every opted-in pod")
	if code != 1 {
		t.Errorf("exit %d, want 1", code)
	}
}

func TestEveryCodeHasItsDocsSection(t *testing.T) {
	page, err := os.ReadFile(filepath.Join("..", "..", "docs", "plugin.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range plugin.Codes {
		if !strings.Contains(string(page), "\n### "+c+"\n") {
			t.Errorf("docs/plugin.md has no section ### %s, which its findings link to", c)
		}
	}
}

func TestAnalyzeWebhookNotInstalled(t *testing.T) {
	ctx := context.Background()
	var wh admissionv1.MutatingWebhookConfiguration
	if err := k8s.Get(ctx, client.ObjectKey{Name: webhookName}, &wh); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Delete(ctx, &wh); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		wh.ResourceVersion = ""
		if err := k8s.Create(ctx, &wh); err != nil {
			t.Errorf("restoring the webhook configuration: %v", err)
		}
	})
	r, code := analyze(t, "-n", "default")
	wantOnly(t, r, plugin.CodeWebhookNotInstalled, plugin.SeverityError, "mutatingwebhookconfiguration/-", "inject.idemcp.io", "install idemcp")
	if code != 1 {
		t.Errorf("exit %d, want 1", code)
	}
}
