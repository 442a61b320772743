// Package webhook is the Pod mutating webhook that injects the idemcp
// sidecar into MCP server pods that opt in.
package webhook

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// Annotations and labels users and the webhook write on pods.
const (
	// AnnotationInject opts a pod in: "true".
	AnnotationInject = "idemcp.io/inject"
	// AnnotationPolicy names the IdempotencyPolicy in the pod's namespace.
	AnnotationPolicy = "idemcp.io/policy"
	// AnnotationUpstreamPort is the MCP server's port, when no container
	// port is named "mcp".
	AnnotationUpstreamPort = "idemcp.io/upstream-port"
	// AnnotationStatus is written by the webhook; its presence makes
	// injection idempotent.
	AnnotationStatus = "idemcp.io/status"
	// AnnotationNativeSidecar: "false" injects a plain container instead of
	// a native sidecar, for clusters before Kubernetes 1.29.
	AnnotationNativeSidecar = "idemcp.io/native-sidecar"
	// LabelInjection on a namespace enables the webhook there: "enabled".
	LabelInjection = "idemcp.io/injection"
)

// Names of what the webhook adds.
const (
	ContainerName   = "idemcp-proxy"
	TokenVolume     = "idemcp-token"
	TokenMountPath  = "/var/run/secrets/idemcp"
	TokenAudience   = "idemcp"
	PortNameMCP     = "mcp"
	PortNameRenamed = "mcp-upstream"
	PortNameAdmin   = "idemcp-admin"
)

// Config is what the injector puts into every sidecar.
type Config struct {
	// Image is the manager's own image: one image, version-locked.
	Image string
	// ProxyPort and AdminPort are the sidecar's ports in the pod.
	ProxyPort int32
	AdminPort int32
	// Resources of the sidecar container.
	Resources corev1.ResourceRequirements
	// PolicyEndpoint is where sidecars fetch policy updates (the manager's
	// policy stream); empty until that exists.
	PolicyEndpoint string
}

// DefaultConfig returns the defaults the manager's flags start from.
func DefaultConfig(image string) Config {
	return Config{
		Image:     image,
		ProxyPort: 15480,
		AdminPort: 15481,
		Resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m"), corev1.ResourceMemory: resource.MustParse("32Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("128Mi")},
		},
	}
}

// Status is the JSON in the idemcp.io/status annotation.
type Status struct {
	Container  string `json:"container"`
	Policy     string `json:"policy"`
	PolicyHash string `json:"policyHash"`
	Upstream   int32  `json:"upstreamPort"`
	Image      string `json:"image"`
}

// ErrNoUpstreamPort is returned when the injector cannot tell which port
// the MCP server listens on.
var ErrNoUpstreamPort = errors.New("no upstream port")

// Injected reports whether the pod already carries the sidecar.
func Injected(pod *corev1.Pod) bool {
	if _, ok := pod.Annotations[AnnotationStatus]; ok {
		return true
	}
	for _, c := range append(append([]corev1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...) {
		if c.Name == ContainerName {
			return true
		}
	}
	return false
}

// upstreamPort finds the MCP server's port: the annotation, else a
// container port named "mcp", else the only container port of the pod.
func upstreamPort(pod *corev1.Pod) (int32, error) {
	if v, ok := pod.Annotations[AnnotationUpstreamPort]; ok {
		n, err := strconv.ParseInt(v, 10, 32)
		if err != nil || n < 1 || n > 65535 {
			return 0, fmt.Errorf("%w: annotation %s is %q; give the MCP server's port as a number from 1 to 65535", ErrNoUpstreamPort, AnnotationUpstreamPort, v)
		}
		return int32(n), nil
	}
	var all []corev1.ContainerPort
	for _, c := range pod.Spec.Containers {
		for _, p := range c.Ports {
			if p.Name == PortNameMCP {
				return p.ContainerPort, nil
			}
			if p.Protocol == "" || p.Protocol == corev1.ProtocolTCP {
				all = append(all, p)
			}
		}
	}
	if len(all) == 1 {
		return all[0].ContainerPort, nil
	}
	return 0, fmt.Errorf("%w: name the MCP server's container port %q or annotate the pod %s: \"<port>\" (the pod has %d TCP ports)",
		ErrNoUpstreamPort, PortNameMCP, AnnotationUpstreamPort, len(all))
}

// Inject adds the sidecar to pod for policy p. It changes nothing and
// returns an error if no upstream port can be found.
func Inject(pod *corev1.Pod, p *v1alpha1.IdempotencyPolicy, policyHash string, cfg Config) error {
	port, err := upstreamPort(pod)
	if err != nil {
		return err
	}
	if port == cfg.ProxyPort || port == cfg.AdminPort {
		return fmt.Errorf("%w: the MCP server's port %d is one the sidecar uses; move it or change the manager's --sidecar-port/--sidecar-admin-port", ErrNoUpstreamPort, port)
	}
	snapshot, err := policySnapshot(p)
	if err != nil {
		return err
	}

	// Port swap: a Service with targetPort: mcp now reaches the sidecar.
	proxyPortName := ""
	for i := range pod.Spec.Containers {
		c := &pod.Spec.Containers[i]
		for j := range c.Ports {
			cp := &c.Ports[j]
			if cp.Name == PortNameMCP && cp.ContainerPort == port {
				cp.Name = PortNameRenamed
				proxyPortName = PortNameMCP
				// The kubelet resolves a probe's named port in its own
				// container: the server's probes keep their port by number.
				renamePortRefs(c, PortNameMCP, port)
			}
		}
	}

	c := sidecarContainer(p, cfg, port, snapshot, proxyPortName)
	if pod.Annotations[AnnotationNativeSidecar] == "false" {
		pod.Spec.Containers = append(pod.Spec.Containers, c)
	} else {
		// A native sidecar starts before the MCP server and outlives it.
		c.RestartPolicy = ptr.To(corev1.ContainerRestartPolicyAlways)
		pod.Spec.InitContainers = append([]corev1.Container{c}, pod.Spec.InitContainers...)
	}
	if pod.Spec.ServiceAccountName == "" {
		// The projected token needs one; the API server's ServiceAccount
		// admission sets the same default where it runs.
		pod.Spec.ServiceAccountName = "default"
	}
	pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{
		Name: TokenVolume,
		VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
			Sources: []corev1.VolumeProjection{{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{
				Audience: TokenAudience, ExpirationSeconds: ptr.To[int64](3600), Path: "token",
			}}},
		}},
	})

	if pod.Labels == nil {
		pod.Labels = map[string]string{}
	}
	pod.Labels[v1alpha1.LabelPolicy] = p.Name
	status, _ := json.Marshal(Status{Container: ContainerName, Policy: p.Name, PolicyHash: policyHash, Upstream: port, Image: cfg.Image})
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	pod.Annotations[AnnotationStatus] = string(status)
	return nil
}

// renamePortRefs points the container's probes and lifecycle hooks that
// name port at its number instead.
func renamePortRefs(c *corev1.Container, name string, number int32) {
	fix := func(h *corev1.ProbeHandler) {
		if h == nil {
			return
		}
		if h.HTTPGet != nil && h.HTTPGet.Port.Type == intstr.String && h.HTTPGet.Port.StrVal == name {
			h.HTTPGet.Port = intstr.FromInt32(number)
		}
		if h.TCPSocket != nil && h.TCPSocket.Port.Type == intstr.String && h.TCPSocket.Port.StrVal == name {
			h.TCPSocket.Port = intstr.FromInt32(number)
		}
	}
	for _, p := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe, c.StartupProbe} {
		if p != nil {
			fix(&p.ProbeHandler)
		}
	}
	if c.Lifecycle != nil {
		for _, h := range []*corev1.LifecycleHandler{c.Lifecycle.PostStart, c.Lifecycle.PreStop} {
			if h == nil {
				continue
			}
			if h.HTTPGet != nil && h.HTTPGet.Port.Type == intstr.String && h.HTTPGet.Port.StrVal == name {
				h.HTTPGet.Port = intstr.FromInt32(number)
			}
			if h.TCPSocket != nil && h.TCPSocket.Port.Type == intstr.String && h.TCPSocket.Port.StrVal == name {
				h.TCPSocket.Port = intstr.FromInt32(number)
			}
		}
	}
}

// policySnapshot is the policy the sidecar enforces from its first request,
// even with no manager to ask.
func policySnapshot(p *v1alpha1.IdempotencyPolicy) (string, error) {
	snap := v1alpha1.IdempotencyPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: v1alpha1.GroupVersion.String(), Kind: "IdempotencyPolicy"},
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace},
		Spec:       p.Spec,
	}
	b, err := json.Marshal(snap)
	if err != nil {
		return "", fmt.Errorf("writing the policy snapshot: %w", err)
	}
	return string(b), nil
}

func sidecarContainer(p *v1alpha1.IdempotencyPolicy, cfg Config, upstream int32, snapshot, proxyPortName string) corev1.Container {
	args := []string{
		"sidecar",
		"--listen=:" + strconv.Itoa(int(cfg.ProxyPort)),
		"--admin-listen=:" + strconv.Itoa(int(cfg.AdminPort)),
		"--upstream=http://127.0.0.1:" + strconv.Itoa(int(upstream)),
	}
	env := []corev1.EnvVar{
		{Name: "IDEMCP_POLICY", Value: snapshot},
		{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
		{Name: "POD_NAMESPACE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.namespace"}}},
	}
	if r := p.Spec.Store.Redis; p.Spec.Store.Type == v1alpha1.StoreRedis && r != nil {
		var ref *corev1.SecretKeySelector
		switch {
		case r.Managed != nil:
			args = append(args, "--redis-addr="+fmt.Sprintf("%s-redis.%s.svc:6379", p.Name, p.Namespace))
			ref = &corev1.SecretKeySelector{LocalObjectReference: corev1.LocalObjectReference{Name: p.Name + "-redis"}, Key: "password"}
		case r.External != nil && r.External.PasswordSecretRef != nil:
			ref = &corev1.SecretKeySelector{LocalObjectReference: corev1.LocalObjectReference{Name: r.External.PasswordSecretRef.Name}, Key: r.External.PasswordSecretRef.Key}
		}
		if ref != nil {
			// Secrets never travel in the policy: the kubelet resolves this.
			env = append(env, corev1.EnvVar{Name: "IDEMCP_REDIS_PASSWORD", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: ref}})
		}
	}
	if limit := cfg.Resources.Limits.Memory(); limit != nil && !limit.IsZero() {
		// Let the Go runtime collect before the kernel kills: 80% of the limit.
		env = append(env, corev1.EnvVar{Name: "GOMEMLIMIT", Value: strconv.FormatInt(limit.Value()*8/10, 10)})
	}
	if cfg.PolicyEndpoint != "" {
		env = append(env, corev1.EnvVar{Name: "IDEMCP_POLICY_ENDPOINT", Value: cfg.PolicyEndpoint})
	}
	probe := func(path string) *corev1.Probe {
		return &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: path, Port: intstr.FromString(PortNameAdmin)}},
			PeriodSeconds: 10, TimeoutSeconds: 2, FailureThreshold: 3,
		}
	}
	return corev1.Container{
		Name:  ContainerName,
		Image: cfg.Image,
		Args:  args,
		Env:   env,
		Ports: []corev1.ContainerPort{
			{Name: proxyPortName, ContainerPort: cfg.ProxyPort, Protocol: corev1.ProtocolTCP},
			{Name: PortNameAdmin, ContainerPort: cfg.AdminPort, Protocol: corev1.ProtocolTCP},
		},
		ReadinessProbe: probe("/readyz"),
		LivenessProbe:  probe("/healthz"),
		StartupProbe: &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromString(PortNameAdmin)}},
			PeriodSeconds: 1, FailureThreshold: 30,
		},
		Resources:    cfg.Resources,
		VolumeMounts: []corev1.VolumeMount{{Name: TokenVolume, MountPath: TokenMountPath, ReadOnly: true}},
		SecurityContext: &corev1.SecurityContext{
			RunAsNonRoot:             ptr.To(true),
			RunAsUser:                ptr.To[int64](65532),
			RunAsGroup:               ptr.To[int64](65532),
			AllowPrivilegeEscalation: ptr.To(false),
			ReadOnlyRootFilesystem:   ptr.To(true),
			Privileged:               ptr.To(false),
			Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
			SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
		},
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
}

// optedIn reports whether the pod asks for the sidecar.
func optedIn(pod *corev1.Pod) bool {
	return strings.EqualFold(pod.Annotations[AnnotationInject], "true")
}
