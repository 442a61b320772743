package webhook_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/endpointslice"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/test/envtestutil"
	"github.com/idemcp/idemcp/webhook"
)

// route resolves a Service's named targetPort as the EndpointSlice
// controller does.
func route(pod *corev1.Pod, name string) (int, error) {
	return endpointslice.FindPort(pod, &corev1.ServicePort{TargetPort: intstr.FromString(name), Protocol: corev1.ProtocolTCP})
}

func resources(cpuReq, memReq, cpuLim, memLim string) corev1.ResourceRequirements {
	r := corev1.ResourceRequirements{Requests: corev1.ResourceList{}, Limits: corev1.ResourceList{}}
	for _, q := range []struct {
		l    corev1.ResourceList
		name corev1.ResourceName
		v    string
	}{{r.Requests, corev1.ResourceCPU, cpuReq}, {r.Requests, corev1.ResourceMemory, memReq}, {r.Limits, corev1.ResourceCPU, cpuLim}, {r.Limits, corev1.ResourceMemory, memLim}} {
		if q.v != "" {
			q.l[q.name] = resource.MustParse(q.v)
		}
	}
	return r
}

func server(ports ...corev1.ContainerPort) corev1.Container {
	return corev1.Container{Name: "server", Image: "example.com/mcp-server:1", Ports: ports}
}

func shapePod(ns string, containers ...corev1.Container) *corev1.Pod {
	p := mcpPod(ns, "shape", optIn)
	p.Spec.Containers = containers
	return p
}

// TestPodShapes creates every pod shape real clusters produce against the
// real API server and webhook: either each Service port name that reached
// the MCP server before injection reaches the sidecar after it, with the
// sidecar forwarding to that same server port, or the create is refused
// with a message that says how to fix it. Admitted pods passed the API
// server's validation, quota and LimitRange admission.
func TestPodShapes(t *testing.T) {
	for _, tc := range []struct {
		name string
		pod  func(ns string) *corev1.Pod
		// setup makes quotas and limit ranges in the namespace.
		setup func(t *testing.T, ns string)
		// refused is part of the expected refusal; empty when admitted.
		refused string
		// routes are the Service port names that reached the server.
		routes   []string
		upstream int32
		check    func(t *testing.T, pod *corev1.Pod, sidecar corev1.Container)
	}{{
		name: "two containers with a port named mcp",
		pod: func(ns string) *corev1.Pod {
			inspector := corev1.Container{Name: "inspector", Image: "example.com/inspector:1",
				Ports:         []corev1.ContainerPort{{Name: "mcp", ContainerPort: 6274}},
				LivenessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromString("mcp")}}}}
			return shapePod(ns, server(corev1.ContainerPort{Name: "mcp", ContainerPort: 8080}), inspector)
		},
		routes: []string{"mcp"}, upstream: 8080,
		check: func(t *testing.T, pod *corev1.Pod, _ corev1.Container) {
			in := pod.Spec.Containers[1]
			if in.Ports[0].Name != "idemcp-dup-1" || in.LivenessProbe.TCPSocket.Port.IntValue() != 6274 {
				t.Errorf("inspector ports %+v probe %v: want renamed idemcp-dup-1, probe by number", in.Ports, in.LivenessProbe.TCPSocket.Port)
			}
		},
	}, {
		name: "the MCP server is a native sidecar",
		pod: func(ns string) *corev1.Pod {
			p := shapePod(ns, corev1.Container{Name: "app", Image: "example.com/app:1", Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 3000}}})
			s := server(corev1.ContainerPort{Name: "mcp", ContainerPort: 8080})
			s.RestartPolicy = ptr.To(corev1.ContainerRestartPolicyAlways)
			p.Spec.InitContainers = []corev1.Container{s}
			return p
		},
		routes: []string{"mcp"}, upstream: 8080,
		check: func(t *testing.T, pod *corev1.Pod, _ corev1.Container) {
			if n := pod.Spec.InitContainers[1].Ports[0].Name; n != "mcp-upstream" {
				t.Errorf("the native-sidecar server's port is %q, want mcp-upstream", n)
			}
			if n, _ := route(pod, "http"); n != 3000 {
				t.Errorf("http now routes to %d, want the app's 3000 untouched", n)
			}
		},
	}, {
		name: "hostPort on the mcp port",
		pod: func(ns string) *corev1.Pod {
			return shapePod(ns, server(corev1.ContainerPort{Name: "mcp", ContainerPort: 8080, HostPort: 30080}))
		},
		routes: []string{"mcp"}, upstream: 8080,
		check: func(t *testing.T, pod *corev1.Pod, sc corev1.Container) {
			if sc.Ports[0].HostPort != 30080 || pod.Spec.Containers[0].Ports[0].HostPort != 0 {
				t.Errorf("sidecar port %+v, server port %+v: want the hostPort moved to the sidecar", sc.Ports[0], pod.Spec.Containers[0].Ports[0])
			}
		},
	}, {
		name: "a single port named http",
		pod: func(ns string) *corev1.Pod {
			return shapePod(ns, server(corev1.ContainerPort{Name: "http", ContainerPort: 8080}))
		},
		routes: []string{"http"}, upstream: 8080,
	}, {
		name:   "a single unnamed port",
		pod:    func(ns string) *corev1.Pod { return shapePod(ns, server(corev1.ContainerPort{ContainerPort: 8080})) },
		routes: nil, upstream: 8080,
		check: func(t *testing.T, _ *corev1.Pod, sc corev1.Container) {
			if sc.Ports[0].Name != "mcp" {
				t.Errorf("sidecar port %+v, want the name mcp for Services to target", sc.Ports[0])
			}
		},
	}, {
		name: "a UDP port named mcp",
		pod: func(ns string) *corev1.Pod {
			return shapePod(ns, server(corev1.ContainerPort{Name: "mcp", ContainerPort: 8080, Protocol: corev1.ProtocolUDP}, corev1.ContainerPort{Name: "http", ContainerPort: 8081}))
		},
		refused: `port "mcp" is UDP: MCP runs over TCP`,
	}, {
		name: "the app already uses the sidecar's ports",
		pod: func(ns string) *corev1.Pod {
			other := corev1.Container{Name: "other", Image: "example.com/other:1", Ports: []corev1.ContainerPort{{ContainerPort: 9000, HostPort: 15482}}}
			return shapePod(ns, server(corev1.ContainerPort{Name: "mcp", ContainerPort: 8080}, corev1.ContainerPort{Name: "a", ContainerPort: 15480}, corev1.ContainerPort{Name: "b", ContainerPort: 15481}), other)
		},
		routes: []string{"mcp"}, upstream: 8080,
		check: func(t *testing.T, _ *corev1.Pod, sc corev1.Container) {
			if sc.Ports[0].ContainerPort != 15483 || sc.Ports[1].ContainerPort != 15484 {
				t.Errorf("sidecar ports %+v, want the free 15483 and 15484", sc.Ports)
			}
			if want := []string{"--listen=:15483", "--admin-listen=:15484"}; strings.Join(sc.Args[1:3], " ") != strings.Join(want, " ") {
				t.Errorf("args %q, want %q", sc.Args, want)
			}
		},
	}, {
		name: "a label idemcp.io/policy naming another policy",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Labels[v1alpha1.LabelPolicy] = "orders"
			return p
		},
		refused: `label idemcp.io/policy is "orders" but its annotation idemcp.io/policy names "payments": idemcp never changes a label you set`,
	}, {
		name: "a label idemcp.io/policy naming the same policy",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Labels[v1alpha1.LabelPolicy] = "payments"
			return p
		},
		routes: []string{"mcp"}, upstream: 8080,
	}, {
		name: "a port named mcp-upstream",
		pod: func(ns string) *corev1.Pod {
			return shapePod(ns, server(corev1.ContainerPort{Name: "mcp", ContainerPort: 8080}, corev1.ContainerPort{Name: "mcp-upstream", ContainerPort: 8081}))
		},
		refused: "container server has a port named mcp-upstream, a name idemcp gives to ports it adds or renames: rename the port",
	}, {
		name: "a volume named idemcp-token",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Spec.Volumes = []corev1.Volume{{Name: "idemcp-token", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}
			return p
		},
		refused: "the pod has a volume named idemcp-token, which idemcp adds for its sidecar's token: rename the volume",
	}, {
		name: "a Windows pod",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Spec.OS = &corev1.PodOS{Name: corev1.Windows}
			return p
		},
		refused: "idemcp's sidecar runs only on Linux and this pod is for Windows",
	}, {
		name: "inject: TRUE",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Labels[webhook.LabelInject] = "TRUE"
			return p
		},
		routes: []string{"mcp"}, upstream: 8080,
	}, {
		name: "inject: yes",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Labels[webhook.LabelInject] = "yes"
			return p
		},
		refused: `the pod's label idemcp.io/inject is "yes", which is not a boolean: use "true" or "false"`,
	}, {
		name: "native-sidecar: nope",
		pod: func(ns string) *corev1.Pod {
			return mcpPod(ns, "shape", map[string]string{webhook.AnnotationPolicy: "payments", webhook.AnnotationNativeSidecar: "nope"})
		},
		refused: `the pod's annotation idemcp.io/native-sidecar is "nope", which is not a boolean`,
	}, {
		name: "an app container named idemcp-proxy",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Spec.Containers[0].Name = webhook.ContainerName
			return p
		},
		refused: "the pod has a container named idemcp-proxy that idemcp did not inject",
	}, {
		name: "an app container named idemcp-proxy with a copied status annotation",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Spec.Containers[0].Name = webhook.ContainerName
			p.Annotations[webhook.AnnotationStatus] = `{"container":"idemcp-proxy","image":"` + testImage + `"}`
			return p
		},
		refused: "the pod has a container named idemcp-proxy that idemcp did not inject",
	}, {
		name: "a ResourceQuota that requires limits",
		setup: func(t *testing.T, ns string) {
			quota(t, ns, corev1.ResourceList{
				corev1.ResourceLimitsCPU: resource.MustParse("10"), corev1.ResourceLimitsMemory: resource.MustParse("10Gi"),
				corev1.ResourceRequestsCPU: resource.MustParse("10"), corev1.ResourceRequestsMemory: resource.MustParse("10Gi"),
			})
		},
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Spec.Containers[0].Resources = resources("100m", "64Mi", "200m", "128Mi")
			return p
		},
		routes: []string{"mcp"}, upstream: 8080,
	}, {
		name:  "a LimitRange with a 100m CPU minimum",
		setup: func(t *testing.T, ns string) { limitRange(t, ns, corev1.LimitTypeContainer, "100m") },
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Spec.Containers[0].Resources = resources("200m", "", "", "")
			return p
		},
		refused: "LimitRange %s/limits: the minimum cpu request per Container is 100m, and the idemcp sidecar requests 50m: set the pod annotation idemcp.io/proxy-cpu-request (or the manager's --sidecar-cpu-request)",
	}, {
		name:  "a LimitRange with a 100m CPU minimum, and the annotation",
		setup: func(t *testing.T, ns string) { limitRange(t, ns, corev1.LimitTypeContainer, "100m") },
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", map[string]string{webhook.AnnotationPolicy: "payments", webhook.AnnotationProxyCPURequest: "100m"})
			p.Spec.Containers[0].Resources = resources("200m", "", "", "")
			return p
		},
		routes: []string{"mcp"}, upstream: 8080,
		check: func(t *testing.T, _ *corev1.Pod, sc corev1.Container) {
			if q := sc.Resources.Requests[corev1.ResourceCPU]; q.String() != "100m" {
				t.Errorf("sidecar cpu request %s, want the annotated 100m", q.String())
			}
		},
	}, {
		name:  "a LimitRange with a Pod maximum",
		setup: func(t *testing.T, ns string) { limitRange(t, ns, corev1.LimitTypePod, "") },
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Spec.Containers[0].Resources = resources("100m", "64Mi", "600m", "128Mi")
			return p
		},
		refused: "LimitRange %s/limits: the maximum cpu limit per Pod is 1, and the pod with the idemcp sidecar is limited to 1100m: set the pod annotation idemcp.io/proxy-cpu-limit",
	}, {
		name: "a Guaranteed pod",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Spec.Containers[0].Resources = resources("", "", "1", "1Gi")
			return p
		},
		routes: []string{"mcp"}, upstream: 8080,
		check: func(t *testing.T, pod *corev1.Pod, sc corev1.Container) {
			if pod.Status.QOSClass != corev1.PodQOSGuaranteed {
				t.Errorf("QoS class %s, want Guaranteed as before injection (sidecar %+v)", pod.Status.QOSClass, sc.Resources)
			}
		},
	}, {
		name: "pod-level resources",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", optIn)
			p.Spec.Resources = ptr.To(resources("200m", "256Mi", "1", "512Mi"))
			p.Spec.Containers[0].Resources = resources("200m", "256Mi", "", "")
			return p
		},
		routes: []string{"mcp"}, upstream: 8080,
		check: func(t *testing.T, pod *corev1.Pod, sc corev1.Container) {
			if pod.Spec.Resources == nil {
				t.Fatal("the API server dropped spec.resources: PodLevelResources is off")
			}
			if len(sc.Resources.Requests)+len(sc.Resources.Limits) != 0 {
				t.Errorf("sidecar resources %+v, want none: it shares the pod-level budget", sc.Resources)
			}
			if e := envValue(sc, webhook.EnvMemoryStoreMaxBytes); e == nil || e.Value != fmt.Sprint(128<<20/2) {
				t.Errorf("memory store bound %+v, want half the default 128Mi limit", e)
			}
		},
	}, {
		name: "pod-level resources smaller than an annotated sidecar limit",
		pod: func(ns string) *corev1.Pod {
			p := mcpPod(ns, "shape", map[string]string{webhook.AnnotationPolicy: "payments", webhook.AnnotationProxyCPULimit: "2"})
			p.Spec.Resources = ptr.To(resources("200m", "256Mi", "1", "512Mi"))
			return p
		},
		refused: "the sidecar's cpu limit 2 is more than the pod-level limit 1: lower the pod annotation idemcp.io/proxy-cpu-limit",
	}, {
		name: "resource annotations that are not quantities",
		pod: func(ns string) *corev1.Pod {
			return mcpPod(ns, "shape", map[string]string{webhook.AnnotationPolicy: "payments", webhook.AnnotationProxyMemoryLimit: "lots"})
		},
		refused: `annotation idemcp.io/proxy-memory-limit is "lots": give a quantity more than 0, such as 128Mi`,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			ns := namespace(t, true)
			createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{})
			if tc.setup != nil {
				tc.setup(t, ns)
			}
			pod := tc.pod(ns)
			// As the API server defaults it, before the webhook sees it.
			before := pod.DeepCopy()
			for _, cs := range [][]corev1.Container{before.Spec.InitContainers, before.Spec.Containers} {
				for i := range cs {
					for j := range cs[i].Ports {
						if cs[i].Ports[j].Protocol == "" {
							cs[i].Ports[j].Protocol = corev1.ProtocolTCP
						}
					}
				}
			}
			for _, name := range tc.routes {
				if n, err := route(before, name); err != nil || int32(n) != tc.upstream {
					t.Fatalf("before injection %s routes to %d (%v), want the server's %d", name, n, err, tc.upstream)
				}
			}
			err := k8s.Create(ctx, pod)
			if tc.refused != "" {
				want := tc.refused
				if strings.Contains(want, "%s") {
					want = fmt.Sprintf(want, ns)
				}
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Fatalf("create: %v\nwant a refusal containing %q", err, want)
				}
				return
			}
			if err != nil {
				t.Fatalf("create: %v", err)
			}
			sc, _ := sidecarOf(t, pod)
			if want := fmt.Sprintf("--upstream=http://127.0.0.1:%d", tc.upstream); !strings.Contains(strings.Join(sc.Args, " "), want) {
				t.Errorf("sidecar args %q, want %s", sc.Args, want)
			}
			for _, name := range tc.routes {
				n, err := route(pod, name)
				if err != nil || int32(n) != sc.Ports[0].ContainerPort {
					t.Errorf("after injection %s routes to %d (%v), want the sidecar's %d", name, n, err, sc.Ports[0].ContainerPort)
				}
				for _, c := range append(append([]corev1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...) {
					for _, p := range c.Ports {
						if c.Name != webhook.ContainerName && (p.ContainerPort == int32(n) || p.Name == name) {
							t.Errorf("container %s still declares %s/%d, which the sidecar's port should own", c.Name, p.Name, p.ContainerPort)
						}
					}
				}
			}
			if tc.check != nil {
				tc.check(t, pod, sc)
			}
		})
	}
}

func quota(t *testing.T, ns string, hard corev1.ResourceList) {
	t.Helper()
	ctx := context.Background()
	q := &corev1.ResourceQuota{ObjectMeta: metav1.ObjectMeta{Name: "quota", Namespace: ns}, Spec: corev1.ResourceQuotaSpec{Hard: hard}}
	if err := k8s.Create(ctx, q); err != nil {
		t.Fatal(err)
	}
	// No quota controller runs in envtest: record what it would, or the
	// quota admission refuses every pod as "status unknown".
	q.Status.Hard = hard
	q.Status.Used = corev1.ResourceList{}
	for k := range hard {
		q.Status.Used[k] = resource.MustParse("0")
	}
	if err := k8s.Status().Update(ctx, q); err != nil {
		t.Fatal(err)
	}
}

func limitRange(t *testing.T, ns string, typ corev1.LimitType, minCPU string) {
	t.Helper()
	item := corev1.LimitRangeItem{Type: typ}
	if typ == corev1.LimitTypeContainer {
		item.Min = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse(minCPU)}
	} else {
		item.Max = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1")}
	}
	lr := &corev1.LimitRange{ObjectMeta: metav1.ObjectMeta{Name: "limits", Namespace: ns}, Spec: corev1.LimitRangeSpec{Limits: []corev1.LimitRangeItem{item}}}
	if err := k8s.Create(context.Background(), lr); err != nil {
		t.Fatal(err)
	}
	// The webhook reads LimitRanges from the manager's cache.
	envtestutil.Eventually(t, "the LimitRange to reach the webhook", func() error {
		p := mcpPod(ns, "probe", optIn)
		if typ == corev1.LimitTypeContainer {
			p.Spec.Containers[0].Resources = resources("200m", "", "", "")
		} else {
			p.Spec.Containers[0].Resources = resources("", "", "900m", "")
		}
		err := k8s.Create(context.Background(), p, client.DryRunAll)
		if err == nil || !strings.Contains(err.Error(), "LimitRange") {
			return fmt.Errorf("a dry run still gets %w", err)
		}
		return nil
	})
}

// TestAutomountFalseGetsOnlyTheSidecarToken: the policy stream needs a
// token, so the sidecar gets one of audience idemcp, the app containers
// none, and an Event on the pod says so.
func TestAutomountFalseGetsOnlyTheSidecarToken(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{})
	pod := mcpPod(ns, "no-token", optIn)
	pod.Spec.AutomountServiceAccountToken = ptr.To(false)
	if err := k8s.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	sc, _ := sidecarOf(t, pod)
	if len(sc.VolumeMounts) != 1 || sc.VolumeMounts[0].Name != webhook.TokenVolume {
		t.Errorf("sidecar mounts %+v, want the idemcp token", sc.VolumeMounts)
	}
	if m := pod.Spec.Containers[0].VolumeMounts; len(m) != 0 {
		t.Errorf("the app container got mounts %+v, want none", m)
	}
	envtestutil.Eventually(t, "an Event on the pod", func() error {
		var list eventsv1.EventList
		if err := k8s.List(ctx, &list, client.InNamespace(ns)); err != nil {
			return err
		}
		for _, e := range list.Items {
			if e.Regarding.Kind == "Pod" && e.Regarding.Name == "no-token" && e.Reason == "IdemcpTokenMounted" && strings.Contains(e.Note, "audience idemcp") {
				return nil
			}
		}
		return fmt.Errorf("%d events, none IdemcpTokenMounted on the pod", len(list.Items))
	})

	// A pod whose name is generated has none yet when the webhook sees it:
	// the Event regards the workload that creates it.
	gen := mcpPod(ns, "", optIn)
	gen.GenerateName = "mcp-"
	gen.Spec.AutomountServiceAccountToken = ptr.To(false)
	gen.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "mcp-5d8f", UID: "0b5a3f0e-1111-4222-8333-944455556666", Controller: ptr.To(true)}}
	if err := k8s.Create(ctx, gen); err != nil {
		t.Fatal(err)
	}
	envtestutil.Eventually(t, "an Event on the pod's ReplicaSet", func() error {
		var list eventsv1.EventList
		if err := k8s.List(ctx, &list, client.InNamespace(ns)); err != nil {
			return err
		}
		for _, e := range list.Items {
			if e.Regarding.Kind == "ReplicaSet" && e.Regarding.Name == "mcp-5d8f" && e.Reason == "IdemcpTokenMounted" && strings.Contains(e.Note, "A new pod of ReplicaSet mcp-5d8f: automountServiceAccountToken is false") {
				return nil
			}
		}
		return fmt.Errorf("%d events, none IdemcpTokenMounted on the ReplicaSet", len(list.Items))
	})
}

// TestDryRunHasNoSideEffects: sideEffects: None holds, no Event and no
// metric for a server-side dry run.
func TestDryRunHasNoSideEffects(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{})
	before := counter(t, "idemcp_webhook_injections_total")
	pod := mcpPod(ns, "dry", optIn)
	if err := k8s.Create(ctx, pod, client.DryRunAll); err != nil {
		t.Fatal(err)
	}
	if !webhook.Injected(pod) {
		t.Fatal("the dry run's answer shows no sidecar")
	}
	refused := mcpPod(ns, "dry-refused", optIn)
	refused.Spec.OS = &corev1.PodOS{Name: corev1.Windows}
	if err := k8s.Create(ctx, refused, client.DryRunAll); err == nil {
		t.Fatal("a Windows pod was admitted")
	}
	// A real create after them: its Event shows the recorder works, and
	// that the dry runs wrote none before it.
	if err := k8s.Create(ctx, mcpPod(ns, "real", optIn)); err != nil {
		t.Fatal(err)
	}
	envtestutil.Eventually(t, "the real create's Event", func() error {
		var list eventsv1.EventList
		if err := k8s.List(ctx, &list, client.InNamespace(ns)); err != nil {
			return err
		}
		real := false
		for _, e := range list.Items {
			if strings.Contains(e.Note, "pod dry") {
				t.Fatalf("a dry run wrote Event %q", e.Note)
			}
			real = real || strings.Contains(e.Note, "pod real")
		}
		if !real {
			return fmt.Errorf("no Event for pod real among %d", len(list.Items))
		}
		return nil
	})
	if got := counter(t, "idemcp_webhook_injections_total"); got != before+1 {
		t.Errorf("injections counted %v, want %v: only the real create counts", got, before+1)
	}
}

func counter(t *testing.T, name string) float64 {
	t.Helper()
	families, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name {
			sum := 0.0
			for _, m := range f.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
			return sum
		}
	}
	return 0
}
