package webhook_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/webhook"
)

func createPolicy(t *testing.T, ns, name string, spec v1alpha1.IdempotencyPolicySpec) *v1alpha1.IdempotencyPolicy {
	t.Helper()
	p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: spec}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	return p
}

// mcpPod is an MCP server pod that opts in with the label
// idemcp.io/inject: "true".
func mcpPod(ns, name string, annotations map[string]string) *corev1.Pod {
	a := map[string]string{}
	for k, v := range annotations {
		a[k] = v
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Annotations: a, Labels: map[string]string{webhook.LabelInject: "true"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name:  "server",
			Image: "example.com/mcp-server:1",
			Ports: []corev1.ContainerPort{{Name: "mcp", ContainerPort: 8080}, {Name: "metrics", ContainerPort: 9090}},
		}}},
	}
}

var optIn = map[string]string{webhook.AnnotationPolicy: "payments"}

func managedSpec() v1alpha1.IdempotencyPolicySpec {
	return v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{Managed: &v1alpha1.ManagedRedis{}}}}
}

func sidecarOf(t *testing.T, pod *corev1.Pod) (c corev1.Container, native bool) {
	t.Helper()
	n := 0
	for _, ic := range pod.Spec.InitContainers {
		if ic.Name == webhook.ContainerName {
			c, native, n = ic, true, n+1
		}
	}
	for _, pc := range pod.Spec.Containers {
		if pc.Name == webhook.ContainerName {
			c, n = pc, n+1
		}
	}
	if n != 1 {
		t.Fatalf("pod has %d idemcp sidecars, want 1", n)
	}
	return c, native
}

func envValue(c corev1.Container, name string) *corev1.EnvVar {
	for i := range c.Env {
		if c.Env[i].Name == name {
			return &c.Env[i]
		}
	}
	return nil
}

// livenessSurvivesAFullAdminPort: the sidecar's liveness probe is a TCP
// connect to the admin port. Pods holding all of the admin port's
// connections make an HTTP probe get 503; a connection accepted and
// answered 503 still shows the sidecar alive, so it is not restarted
// (which would make every call in flight "outcome unknown").
func livenessSurvivesAFullAdminPort(t *testing.T, c *corev1.Container) {
	t.Helper()
	pr := c.LivenessProbe
	if pr == nil || pr.TCPSocket == nil || pr.HTTPGet != nil || pr.TCPSocket.Port.String() != webhook.PortNameAdmin {
		t.Errorf("liveness probe %+v is not a TCP connect to the admin port: a full admin port (503) would get the sidecar restarted", pr)
	}
}

func TestInjectsOptedInPod(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", managedSpec())
	pod := mcpPod(ns, "mcp-0", optIn)
	if err := k8s.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	c, native := sidecarOf(t, pod)
	if !native || c.RestartPolicy == nil || *c.RestartPolicy != corev1.ContainerRestartPolicyAlways || pod.Spec.InitContainers[0].Name != webhook.ContainerName {
		t.Errorf("sidecar is not the first init container with restartPolicy Always: %+v", pod.Spec.InitContainers)
	}
	if c.Image != testImage {
		t.Errorf("image %s, want the manager's %s", c.Image, testImage)
	}
	// The admin address is explicit and on every interface of the pod: run
	// by hand the sidecar's admin listener defaults to loopback, where the
	// kubelet's probes and a scraper could not reach it.
	wantArgs := []string{"sidecar", "--listen=:15480", "--admin-listen=:15481", "--upstream=http://127.0.0.1:8080", "--redis-addr=payments-redis." + ns + ".svc:6379"}
	if strings.Join(c.Args, " ") != strings.Join(wantArgs, " ") {
		t.Errorf("args %q, want %q", c.Args, wantArgs)
	}
	if len(c.Command) != 1 || c.Command[0] != "/idemcp-proxy" {
		t.Errorf("command %q, want the image's data-plane binary [/idemcp-proxy]", c.Command)
	}
	// Port swap: the server's mcp port is renamed, the sidecar's takes the name.
	if p := pod.Spec.Containers[0].Ports[0]; p.Name != "mcp-upstream" || p.ContainerPort != 8080 {
		t.Errorf("server port %+v, want mcp-upstream/8080", p)
	}
	if p := c.Ports[0]; p.Name != "mcp" || p.ContainerPort != 15480 {
		t.Errorf("sidecar port %+v, want mcp/15480", p)
	}
	for _, pr := range []*corev1.Probe{c.ReadinessProbe, c.StartupProbe} {
		if pr == nil || pr.HTTPGet == nil || pr.HTTPGet.Port.String() != webhook.PortNameAdmin {
			t.Errorf("probe %+v is not an HTTP GET on the admin port", pr)
		}
	}
	if c.ReadinessProbe.HTTPGet.Path != "/readyz" || c.StartupProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("probe paths %s %s", c.ReadinessProbe.HTTPGet.Path, c.StartupProbe.HTTPGet.Path)
	}
	livenessSurvivesAFullAdminPort(t, &c)
	if c.Resources.Requests.Cpu().String() != "50m" || c.Resources.Limits.Cpu().String() != "500m" ||
		c.Resources.Requests.Memory().String() != "64Mi" || c.Resources.Limits.Memory().String() != "128Mi" {
		t.Errorf("resources %+v", c.Resources)
	}
	sc := c.SecurityContext
	if sc == nil || !*sc.RunAsNonRoot || !*sc.ReadOnlyRootFilesystem || *sc.AllowPrivilegeEscalation ||
		len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("security context %+v is not restricted", sc)
	}
	pw := envValue(c, "IDEMCP_REDIS_PASSWORD")
	if pw == nil || pw.ValueFrom == nil || pw.ValueFrom.SecretKeyRef == nil || pw.ValueFrom.SecretKeyRef.Name != "payments-redis" || pw.ValueFrom.SecretKeyRef.Key != "password" {
		t.Errorf("redis password env %+v, want a secretKeyRef to payments-redis/password", pw)
	}
	// Every workload of the policy shares its key space; the sidecar adds
	// no upstream to an explicit prefix.
	if pre := envValue(c, "IDEMCP_REDIS_KEY_PREFIX"); pre == nil || pre.Value != "idemcp:"+ns+"/payments:" {
		t.Errorf("redis key prefix env %+v, want idemcp:%s/payments:", pre, ns)
	}
	// The sidecar reaches the MCP server at the pod's IPs (the kubelet
	// fills them in), not only at the loopback address of --upstream: an
	// SDK refuses a request that keeps the Service's Host over loopback.
	// The API server took the pod, so it accepts the field path.
	if ips := envValue(c, webhook.EnvUpstreamDialIPs); ips == nil || ips.Value != "" || ips.ValueFrom == nil ||
		ips.ValueFrom.FieldRef == nil || ips.ValueFrom.FieldRef.FieldPath != "status.podIPs" {
		t.Errorf("%s env %+v, want a fieldRef to status.podIPs", webhook.EnvUpstreamDialIPs, ips)
	}
	snap := envValue(c, "IDEMCP_POLICY")
	if snap == nil || !strings.Contains(snap.Value, `"kind":"IdempotencyPolicy"`) || !strings.Contains(snap.Value, `"managed":{}`) || strings.Contains(snap.Value, "password") {
		t.Errorf("policy snapshot %+v", snap)
	}
	var token *corev1.Volume
	for i := range pod.Spec.Volumes {
		if pod.Spec.Volumes[i].Name == webhook.TokenVolume {
			token = &pod.Spec.Volumes[i]
		}
	}
	if token == nil || token.Projected == nil || token.Projected.Sources[0].ServiceAccountToken.Audience != "idemcp" {
		t.Errorf("token volume %+v, want a projected token with audience idemcp", token)
	}
	if len(c.VolumeMounts) != 1 || c.VolumeMounts[0].MountPath != webhook.TokenMountPath {
		t.Errorf("mounts %+v", c.VolumeMounts)
	}
	var status webhook.Status
	if err := json.Unmarshal([]byte(pod.Annotations[webhook.AnnotationStatus]), &status); err != nil || status.Policy != "payments" || status.PolicyHash == "" || status.Upstream != 8080 {
		t.Errorf("status annotation %q (%v)", pod.Annotations[webhook.AnnotationStatus], err)
	}
	if pod.Labels[v1alpha1.LabelPolicy] != "payments" {
		t.Errorf("labels %v", pod.Labels)
	}

	// Created again from the injected spec (a re-invocation, or a pod
	// copied from another): still one sidecar.
	again := pod.DeepCopy()
	again.ObjectMeta = metav1.ObjectMeta{Name: "mcp-1", Namespace: ns, Annotations: pod.Annotations, Labels: pod.Labels}
	again.Status = corev1.PodStatus{}
	if err := k8s.Create(ctx, again); err != nil {
		t.Fatal(err)
	}
	sidecarOf(t, again)
	// Running the defaulter again on an injected pod changes nothing.
	inj := &webhook.Injector{Client: k8s, Config: sidecar, Recorder: events.NewFakeRecorder(10), MissingPolicy: webhook.MissingPolicyDeny}
	before := again.DeepCopy()
	if err := inj.Default(ctx, again); err != nil {
		t.Fatal(err)
	}
	if !equality.Semantic.DeepEqual(before, again) {
		t.Error("re-running the defaulter changed an injected pod")
	}
}

func TestServerProbesKeepTheirPort(t *testing.T) {
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{})
	pod := mcpPod(ns, "probed", optIn)
	pod.Spec.Containers[0].ReadinessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/health", Port: intstr.FromString("mcp")}}}
	pod.Spec.Containers[0].LivenessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromString("mcp")}}}
	if err := k8s.Create(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	c := pod.Spec.Containers[0]
	if p := c.ReadinessProbe.HTTPGet.Port; p.Type != intstr.Int || p.IntVal != 8080 {
		t.Errorf("readiness probe port %s, want 8080: the renamed port no longer resolves in the server's container", p.String())
	}
	if p := c.LivenessProbe.TCPSocket.Port; p.Type != intstr.Int || p.IntVal != 8080 {
		t.Errorf("liveness probe port %s, want 8080", p.String())
	}
	sc, _ := sidecarOf(t, pod)
	if e := envValue(sc, "GOMEMLIMIT"); e == nil || e.Value != strconv.Itoa(128<<20*8/10) {
		t.Errorf("GOMEMLIMIT %+v, want 80%% of the 128Mi limit", e)
	}
	if e := envValue(sc, webhook.EnvMemoryStoreMaxBytes); e == nil || e.Value != strconv.Itoa(64<<20) {
		t.Errorf("%s %+v, want half of the 128Mi limit", webhook.EnvMemoryStoreMaxBytes, e)
	}
}

func TestPlainContainerFallbackAndUpstreamAnnotation(t *testing.T) {
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{})
	pod := mcpPod(ns, "old-cluster", map[string]string{
		webhook.AnnotationPolicy:        "payments",
		webhook.AnnotationNativeSidecar: "False", webhook.AnnotationUpstreamPort: "9090",
	})
	if err := k8s.Create(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	c, native := sidecarOf(t, pod)
	if native || c.RestartPolicy != nil {
		t.Error("with native-sidecar: false the sidecar must be a plain container")
	}
	if !strings.Contains(strings.Join(c.Args, " "), "--upstream=http://127.0.0.1:9090") {
		t.Errorf("args %q do not use the annotated port", c.Args)
	}
	// The annotated port's name (metrics) is taken over; mcp names
	// another port and stays.
	if p := pod.Spec.Containers[0].Ports; p[0].Name != "mcp" || p[1].Name != "mcp-upstream" || c.Ports[0].Name != "metrics" {
		t.Errorf("server ports %+v, sidecar port %+v: want mcp kept, metrics taken over by the sidecar", p, c.Ports[0])
	}
	if envValue(c, "IDEMCP_REDIS_PASSWORD") != nil {
		t.Error("a Memory policy got a Redis password")
	}
}

func TestPodsLeftAlone(t *testing.T) {
	ctx := context.Background()
	enabled, disabled := namespace(t, true), namespace(t, false)
	createPolicy(t, enabled, "payments", v1alpha1.IdempotencyPolicySpec{})
	createPolicy(t, disabled, "payments", v1alpha1.IdempotencyPolicySpec{})
	host := mcpPod(enabled, "host", optIn)
	host.Spec.HostNetwork = true
	notOptedIn := mcpPod(enabled, "not-opted-in", optIn)
	notOptedIn.Labels = nil
	// The annotation of earlier versions no longer opts in.
	notOptedIn.Annotations["idemcp.io/inject"] = "true"
	optedOut := mcpPod(enabled, "opted-out", optIn)
	optedOut.Labels[webhook.LabelInject] = "False"
	pods := []*corev1.Pod{notOptedIn, optedOut, mcpPod(disabled, "other-namespace", optIn), host}
	for _, p := range pods {
		if err := k8s.Create(ctx, p); err != nil {
			t.Fatalf("%s: %v", p.Name, err)
		}
		if len(p.Spec.InitContainers) != 0 || len(p.Spec.Containers) != 1 || p.Annotations[webhook.AnnotationStatus] != "" || p.Spec.Containers[0].Ports[0].Name != "mcp" {
			t.Errorf("pod %s/%s was changed: %+v", p.Namespace, p.Name, p.Spec)
		}
	}

	// The manager's own namespace is never injected, even when labelled.
	own := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "idemcp-system", Labels: map[string]string{webhook.LabelInjection: "enabled"}}}
	if err := k8s.Create(ctx, own); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	createPolicy(t, "idemcp-system", "payments", v1alpha1.IdempotencyPolicySpec{})
	mine := mcpPod("idemcp-system", "manager-like", optIn)
	if err := k8s.Create(ctx, mine); err != nil {
		t.Fatal(err)
	}
	if webhook.Injected(mine) {
		t.Error("a pod in the manager's own namespace was injected")
	}

	// A Deployment's pod template is not a pod: untouched.
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "mcp", Namespace: enabled},
		Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "mcp"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "mcp", webhook.LabelInject: "true"}, Annotations: optIn},
				Spec:       mcpPod(enabled, "", nil).Spec,
			},
		},
	}
	if err := k8s.Create(ctx, dep); err != nil {
		t.Fatal(err)
	}
	if len(dep.Spec.Template.Spec.InitContainers) != 0 || dep.Spec.Template.Annotations[webhook.AnnotationStatus] != "" {
		t.Error("the Deployment's pod template was injected")
	}
}

func TestRefusals(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	err := k8s.Create(ctx, mcpPod(ns, "no-policy", optIn))
	if err == nil || !strings.Contains(err.Error(), "IdempotencyPolicy "+ns+"/payments not found") {
		t.Errorf("pod with a missing policy: %v, want a denial naming the policy", err)
	}
	err = k8s.Create(ctx, mcpPod(ns, "unnamed", nil))
	if err == nil || !strings.Contains(err.Error(), "names no policy") {
		t.Errorf("pod naming no policy: %v", err)
	}
	createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{})
	noPort := mcpPod(ns, "no-port", optIn)
	noPort.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 1}, {ContainerPort: 2}}
	err = k8s.Create(ctx, noPort)
	if err == nil || !strings.Contains(err.Error(), `name the MCP server's container port "mcp" or annotate the pod idemcp.io/upstream-port`) {
		t.Errorf("pod without an upstream port: %v", err)
	}
	bad := mcpPod(ns, "bad-port", map[string]string{webhook.AnnotationPolicy: "payments", webhook.AnnotationUpstreamPort: "http"})
	if err = k8s.Create(ctx, bad); err == nil || !strings.Contains(err.Error(), `idemcp.io/upstream-port is "http"`) {
		t.Errorf("pod with a bad upstream-port: %v", err)
	}

	// With --webhook-missing-policy=admit the pod runs without the sidecar.
	admit := &webhook.Injector{Client: k8s, Config: sidecar, MissingPolicy: webhook.MissingPolicyAdmit, Recorder: events.NewFakeRecorder(10)}
	pod := mcpPod(ns, "admitted", map[string]string{webhook.AnnotationPolicy: "absent"})
	if err := admit.Default(ctx, pod); err != nil || webhook.Injected(pod) {
		t.Errorf("admit mode: err %v, injected %v; want admitted untouched", err, webhook.Injected(pod))
	}
	var list corev1.PodList
	if err := k8s.List(ctx, &list, client.InNamespace(ns)); err != nil || len(list.Items) != 0 {
		t.Errorf("refused pods exist: %d (%v)", len(list.Items), err)
	}
}

func recorder() events.EventRecorder { return events.NewFakeRecorder(100) }

func itoa(n int32) string { return fmt.Sprint(n) }

// TestRefusesPodsOfAPolicyBeingDeleted: a policy being deleted waits for
// its pods to go; a new pod that names it is refused with a message naming
// it, so the deletion can finish (in admit mode it runs without the sidecar).
func TestRefusesPodsOfAPolicyBeingDeleted(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	p := createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{})
	// The controller's finalizer, as if pods still used the policy.
	if err := k8s.Patch(ctx, p, client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"finalizers":["`+v1alpha1.FinalizerInUse+`"]}}`))); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = k8s.Patch(ctx, p, client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`)))
	})
	if err := k8s.Create(ctx, mcpPod(ns, "before", optIn)); err != nil {
		t.Fatalf("a pod of the live policy: %v", err)
	}
	if err := k8s.Delete(ctx, p); err != nil {
		t.Fatal(err)
	}
	// The webhook reads policies from its cache: it may take a moment to
	// see the deletion.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		err := k8s.Create(ctx, mcpPod(ns, "after", optIn))
		if err != nil && strings.Contains(err.Error(), "IdempotencyPolicy "+ns+"/payments is being deleted") {
			break
		}
		if err == nil {
			_ = k8s.Delete(ctx, mcpPod(ns, "after", optIn))
		}
		if time.Now().After(deadline) {
			t.Fatalf("a pod naming the policy being deleted: %v, want a refusal saying it is being deleted", err)
		}
	}

	var deleting v1alpha1.IdempotencyPolicy
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(p), &deleting); err != nil {
		t.Fatal(err)
	}
	admit := &webhook.Injector{Client: k8s, Config: sidecar, MissingPolicy: webhook.MissingPolicyAdmit, Recorder: events.NewFakeRecorder(10)}
	pod := mcpPod(ns, "admitted", optIn)
	if err := admit.Default(ctx, pod); err != nil || webhook.Injected(pod) || pod.Labels[v1alpha1.LabelPolicy] != "" {
		t.Errorf("admit mode: err %v, injected %v, label %q; want admitted without the sidecar", err, webhook.Injected(pod), pod.Labels[v1alpha1.LabelPolicy])
	}
}
