//go:build e2e

package realnode

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/internal/plugin"
	"github.com/idemcp/idemcp/test/poll"
	"github.com/idemcp/idemcp/webhook"
)

// analyze runs kubectl idemcp analyze on the suite's namespace with the
// suite's kubeconfig, and returns its exit status and findings.
func (s *suite) analyze(t *testing.T) (int, []plugin.Finding) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := plugin.Main([]string{"analyze", "-n", s.ns, "-o", "json", "--manager-namespace", s.mgrNS}, &out, &errOut)
	var r struct {
		Findings []plugin.Finding `json:"findings"`
	}
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatalf("kubectl idemcp analyze -o json exited %d and printed %q (%s): %v", code, out.String(), errOut.String(), err)
	}
	return code, r.Findings
}

func findings(fs []plugin.Finding, code, object string) []plugin.Finding {
	var out []plugin.Finding
	for _, f := range fs {
		if f.Code == code && (object == "" || f.Object == object) {
			out = append(out, f)
		}
	}
	return out
}

// analyzeServiceAndVersion seeds, on a real node, the analyze cases envtest
// cannot show for real: a Service that reaches the MCP server's port
// around the sidecar (IDM003, resolved against the running pods' ports as
// the endpoints controller resolves them) and a sidecar of another image
// than the manager's (IDM004, on a pod the kubelet runs).
func (s *suite) analyzeServiceAndVersion(t *testing.T) {
	code, fs := s.analyze(t)
	if code != 0 || len(findings(fs, plugin.CodeServiceBypass, "")) > 0 || len(findings(fs, plugin.CodeSidecarVersion, "")) > 0 {
		t.Fatalf("analyze of the installed suite exited %d with %+v, want 0 and no IDM003 or IDM004 (its Service targets the sidecar's port mcp)", code, fs)
	}

	// IDM003: by the renamed port's name, and by its number.
	labels := map[string]string{"app": appName}
	for _, svc := range []*corev1.Service{
		{ObjectMeta: metav1.ObjectMeta{Name: "mcp-direct", Namespace: s.ns}, Spec: corev1.ServiceSpec{Selector: labels,
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString(webhook.PortNameRenamed)}}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "mcp-direct-number", Namespace: s.ns}, Spec: corev1.ServiceSpec{Selector: labels,
			Ports: []corev1.ServicePort{{Port: 8081, TargetPort: intstr.FromInt32(serverPort)}}}},
	} {
		if err := s.k8s.Create(s.ctx, svc); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.k8s.Delete(s.ctx, svc) })
	}
	code, fs = s.analyze(t)
	for _, name := range []string{"mcp-direct", "mcp-direct-number"} {
		got := findings(fs, plugin.CodeServiceBypass, "service/"+s.ns+"/"+name)
		if len(got) != 1 || got[0].Severity != plugin.SeverityError || !strings.Contains(got[0].Message, "targetPort: "+webhook.PortNameMCP) {
			t.Fatalf("analyze with Service %s around the sidecar: %+v, want one IDM003 Error telling to set targetPort: mcp", name, fs)
		}
	}
	if code != 1 {
		t.Fatalf("analyze found IDM003 errors but exited %d, want 1", code)
	}
	if got := findings(fs, plugin.CodeServiceBypass, "service/"+s.ns+"/"+appName); len(got) > 0 {
		t.Fatalf("analyze reports the suite's own Service (targetPort mcp): %+v", got)
	}
	for _, name := range []string{"mcp-direct", "mcp-direct-number"} {
		if err := s.k8s.Delete(s.ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: s.ns}}); err != nil {
			t.Fatal(err)
		}
	}

	// IDM004: an injected pod whose sidecar image is not the manager's,
	// as one injected by an older manager runs until it is recreated.
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "mcp-older", Namespace: s.ns,
			Labels:      map[string]string{"app": "mcp-older", webhook.LabelInject: "true"},
			Annotations: map[string]string{webhook.AnnotationPolicy: policyName}},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			SecurityContext:               &corev1.PodSecurityContext{RunAsNonRoot: ptr.To(true), SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
			Containers: []corev1.Container{restrictedContainer(corev1.Container{
				Name: "server", Image: s.mcpImage(), ImagePullPolicy: corev1.PullIfNotPresent,
				Args:  []string{"-listen", fmt.Sprintf("0.0.0.0:%d", serverPort)},
				Ports: []corev1.ContainerPort{{Name: "mcp", ContainerPort: serverPort}},
			})},
		},
	}
	if err := s.k8s.Create(s.ctx, pod); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = s.k8s.Delete(s.ctx, pod, client.GracePeriodSeconds(0))
		poll.Within(t, 2*time.Minute, "pod mcp-older gone", func() error {
			err := s.k8s.Get(s.ctx, client.ObjectKeyFromObject(pod), &corev1.Pod{})
			if apierrors.IsNotFound(err) {
				return nil
			}
			return fmt.Errorf("still there: %w", err)
		})
	}()
	current := ""
	for _, c := range append(pod.Spec.InitContainers, pod.Spec.Containers...) {
		if c.Name == webhook.ContainerName {
			current = c.Image
		}
	}
	if current == "" {
		t.Fatalf("pod mcp-older was not injected: %+v", pod.Spec)
	}
	repo := current
	if i := strings.LastIndex(repo, ":"); i > strings.LastIndex(repo, "/") {
		repo = repo[:i]
	}
	older := repo + ":v0.0.1"
	list := "containers" // a plain-container sidecar, on clusters before 1.29
	if hasInit(pod) {
		list = "initContainers"
	}
	// An older manager wrote its own image into the status annotation
	// too: a sidecar whose image and annotation disagree is not idemcp's
	// (IDM001), not an older one.
	var status map[string]any
	if err := json.Unmarshal([]byte(pod.Annotations[webhook.AnnotationStatus]), &status); err != nil {
		t.Fatalf("reading the status annotation of mcp-older: %v", err)
	}
	status["image"] = older
	statusJSON, err := json.Marshal(status)
	if err != nil {
		t.Fatal(err)
	}
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}},"spec":{%q:[{"name":%q,"image":%q}]}}`,
		webhook.AnnotationStatus, statusJSON, list, webhook.ContainerName, older)
	if err := s.k8s.Patch(s.ctx, pod, client.RawPatch(types.StrategicMergePatchType, []byte(patch))); err != nil {
		t.Fatalf("setting the sidecar image of mcp-older to %s: %v", older, err)
	}
	code, fs = s.analyze(t)
	got := findings(fs, plugin.CodeSidecarVersion, "pod/"+s.ns+"/mcp-older")
	if len(got) != 1 || got[0].Severity != plugin.SeverityWarning || !strings.Contains(got[0].Message, older) || !strings.Contains(got[0].Message, current) {
		t.Fatalf("analyze with a sidecar image %s beside the manager's %s: %+v, want one IDM004 Warning naming both", older, current, fs)
	}
	if n := len(findings(fs, plugin.CodeSidecarVersion, "")); n != 1 {
		t.Fatalf("analyze reports %d IDM004, want only mcp-older's: %+v", n, fs)
	}
	// The image v0.0.1 does not exist here, so mcp-older's sidecar cannot
	// start and the policy is not synced (IDM005, an Error): that is the
	// one Error allowed, and analyze exits 1 for it.
	wantCode := 0
	for _, f := range fs {
		if f.Severity != plugin.SeverityError {
			continue
		}
		if f.Code != plugin.CodePolicyNotReady || !strings.Contains(f.Message, "mcp-older") {
			t.Fatalf("analyze with a version drift reports an Error other than the unsynced mcp-older: %+v", f)
		}
		wantCode = 1
	}
	if code != wantCode {
		t.Fatalf("analyze exited %d, want %d (1 only when it reports an Error): %+v", code, wantCode, fs)
	}
}

func hasInit(p *corev1.Pod) bool {
	for _, c := range p.Spec.InitContainers {
		if c.Name == webhook.ContainerName {
			return true
		}
	}
	return false
}
