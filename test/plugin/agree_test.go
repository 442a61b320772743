// Package plugin_test checks that kubectl idemcp check-inject and the
// webhook never disagree: against a real API server with the webhook
// configuration of config/webhook and the manager serving it, each pod
// shape is first explained by check-inject, then created, and what the
// webhook did must be what check-inject said.
package plugin_test

import (
	"context"
	"os"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/internal/plugin"
	"github.com/idemcp/idemcp/test/envtestutil"
	"github.com/idemcp/idemcp/webhook"
)

const (
	managerNS = "idemcp-system"
	image     = "ghcr.io/idemcp/idemcp:agree"
)

var k8s client.Client

func TestMain(m *testing.M) {
	os.Exit(envtestutil.RunWithManager(m, manager.Options{
		Namespace: managerNS, MissingPolicy: "deny", Sidecar: webhook.DefaultConfig(image),
	}, func(c *envtestutil.Cluster) { k8s = c.Client }))
}

func namespace(t *testing.T, enabled bool) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "agree-"}}
	if enabled {
		ns.Labels = map[string]string{webhook.LabelInjection: "enabled"}
	}
	if err := k8s.Create(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	return ns.Name
}

func mcpPod(ns, name string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
			Labels:      map[string]string{webhook.LabelInject: "true"},
			Annotations: map[string]string{webhook.AnnotationPolicy: "payments"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "server", Image: "example.com/mcp-server:1",
			Ports: []corev1.ContainerPort{{Name: "mcp", ContainerPort: 8080}},
		}}},
	}
}

func TestCheckInjectAgreesWithTheWebhook(t *testing.T) {
	ctx := context.Background()
	// The manager's Deployment as the plugin finds it: the in-process
	// manager runs with the flags its args say (the defaults) and the
	// image of its container.
	lbls := map[string]string{"app.kubernetes.io/name": "idemcp", "app.kubernetes.io/component": "manager"}
	if err := k8s.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: managerNS}}); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Create(ctx, &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "idemcp-manager", Namespace: managerNS, Labels: lbls},
		Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: lbls},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: lbls}, Spec: corev1.PodSpec{Containers: []corev1.Container{{
				Name: "manager", Image: image, Args: []string{"manager", "--leader-elect"},
			}}}},
		},
	}); err != nil {
		t.Fatal(err)
	}
	e := &plugin.Env{Client: k8s}
	in := plugin.FindInstall(ctx, e)
	if in.Webhook == nil || in.SidecarImage != image || in.Options.Namespace != managerNS {
		t.Fatalf("the plugin found webhook %v, image %q, manager namespace %q", in.Webhook != nil, in.SidecarImage, in.Options.Namespace)
	}

	enabled, off := namespace(t, true), namespace(t, false)
	for _, ns := range []string{enabled, off} {
		if err := k8s.Create(ctx, &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "payments", Namespace: ns}}); err != nil {
			t.Fatal(err)
		}
	}
	shapes := map[string]func(*corev1.Pod){
		"plain":           func(*corev1.Pod) {},
		"not-labelled":    func(p *corev1.Pod) { delete(p.Labels, webhook.LabelInject) },
		"opted-out":       func(p *corev1.Pod) { p.Labels[webhook.LabelInject] = "false" },
		"not-a-boolean":   func(p *corev1.Pod) { p.Labels[webhook.LabelInject] = "yes" },
		"host-network":    func(p *corev1.Pod) { p.Spec.HostNetwork = true },
		"missing-policy":  func(p *corev1.Pod) { p.Annotations[webhook.AnnotationPolicy] = "nope" },
		"no-policy":       func(p *corev1.Pod) { delete(p.Annotations, webhook.AnnotationPolicy) },
		"windows":         func(p *corev1.Pod) { p.Spec.OS = &corev1.PodOS{Name: corev1.Windows} },
		"foreign-sidecar": func(p *corev1.Pod) { p.Spec.Containers[0].Name = webhook.ContainerName },
		"no-upstream-port": func(p *corev1.Pod) {
			p.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 1}, {ContainerPort: 2}}
		},
		"label-conflict": func(p *corev1.Pod) { p.Labels[v1alpha1.LabelPolicy] = "other" },
		"native-off":     func(p *corev1.Pod) { p.Annotations[webhook.AnnotationNativeSidecar] = "false" },
		"bad-native":     func(p *corev1.Pod) { p.Annotations[webhook.AnnotationNativeSidecar] = "maybe" },
		"udp":            func(p *corev1.Pod) { p.Spec.Containers[0].Ports[0].Protocol = corev1.ProtocolUDP },
		"no-automount":   func(p *corev1.Pod) { p.Spec.AutomountServiceAccountToken = ptr.To(false) },
	}
	for _, ns := range []string{enabled, off, managerNS} {
		if ns == managerNS {
			if err := k8s.Create(ctx, &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "payments", Namespace: ns}}); err != nil {
				t.Fatal(err)
			}
		}
		for name, shape := range shapes {
			pod := mcpPod(ns, name)
			shape(pod)
			t.Run(ns+"/"+name, func(t *testing.T) {
				v := plugin.CheckInject(ctx, k8s, in, pod.DeepCopy())
				err := k8s.Create(ctx, pod)
				switch {
				case v.Refused:
					if err == nil {
						t.Fatalf("check-inject said refused (%q), the webhook admitted the pod (injected %t)", v.Reasons, webhook.Injected(pod))
					}
					if v.Refusal == "" || !strings.Contains(err.Error(), v.Refusal) {
						t.Errorf("check-inject says %q, the webhook %q", v.Refusal, err)
					}
				case err != nil:
					t.Fatalf("check-inject said not refused (%q), the webhook refused: %v", v.Reasons, err)
				case v.WouldInject != webhook.Injected(pod):
					t.Errorf("check-inject said would inject %t (%q), the webhook injected %t", v.WouldInject, v.Reasons, webhook.Injected(pod))
				}
				if len(v.Reasons) == 0 {
					t.Error("check-inject gave no reason")
				}
			})
		}
	}
}
