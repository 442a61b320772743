// Package webhook is the Pod mutating webhook that injects the idemcp
// sidecar into MCP server pods that opt in.
package webhook

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/credentials"
	"github.com/idemcp/idemcp/internal/managedredis"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
)

// Annotations and labels users and the webhook write on pods.
const (
	// LabelInject opts a pod in: "true". It is a label so that the webhook's
	// objectSelector keeps the API server from calling the webhook for any
	// other pod.
	LabelInject = "idemcp.io/inject"
	// AnnotationPolicy names the IdempotencyPolicy in the pod's namespace.
	AnnotationPolicy = "idemcp.io/policy"
	// AnnotationUpstreamPort is the MCP server's port, when no container
	// port is named "mcp".
	AnnotationUpstreamPort = "idemcp.io/upstream-port"
	// AnnotationStatus is written by the webhook; together with the
	// container it describes it makes injection idempotent.
	AnnotationStatus = "idemcp.io/status"
	// AnnotationNativeSidecar: "false" injects a plain container instead of
	// a native sidecar, for clusters before Kubernetes 1.29.
	AnnotationNativeSidecar = "idemcp.io/native-sidecar"
	// LabelInjection on a namespace enables the webhook there: "enabled".
	LabelInjection = "idemcp.io/injection"
)

// Names of what the webhook adds.
const (
	ContainerName = "idemcp-proxy"
	// ProxyCommand is the data-plane binary of the image, which the sidecar
	// runs: idemcp's sidecar without the manager's Kubernetes libraries,
	// for a smaller and faster-starting sidecar (cmd/idemcp-proxy).
	ProxyCommand    = "/idemcp-proxy"
	TokenVolume     = "idemcp-token"
	TokenMountPath  = "/var/run/secrets/idemcp"
	TokenAudience   = "idemcp"
	PortNameMCP     = "mcp"
	PortNameRenamed = "mcp-upstream"
	PortNameAdmin   = "idemcp-admin"
	// PortNameShadowed prefixes the new names of the other ports that
	// shared the server port's name, so that the name resolves to the
	// sidecar alone: idemcp-dup-1, idemcp-dup-2, ...
	PortNameShadowed = "idemcp-dup-"
)

// EnvUpstreamDialIPs is the sidecar's --upstream-dial-ips, which the
// webhook sets to the pod's IPs (the Downward API's status.podIPs).
const EnvUpstreamDialIPs = "IDEMCP_UPSTREAM_DIAL_IPS"

// EnvKeySpace is the sidecar's --key-space (keyspace.go).
const EnvKeySpace = "IDEMCP_KEY_SPACE"

// EnvLegacyKeys is the sidecar's --legacy-keys: the policy's
// status.legacyKeys when the pod is injected, so that a new pod derives
// its keys as the pods without key spaces still running do, or looks
// under their keys, from its first call, with or without a manager.
const EnvLegacyKeys = "IDEMCP_LEGACY_KEYS"

// MaxPolicySnapshotBytes is the largest IDEMCP_POLICY value: Linux caps one
// environment string ("NAME=value" and its NUL) at 128 KiB, and a container
// past it fails to start with E2BIG.
const MaxPolicySnapshotBytes = 128<<10 - len("IDEMCP_POLICY=") - 1

// Config is what the injector puts into every sidecar.
type Config struct {
	// Image is the manager's own image: one image, version-locked.
	Image string
	// ProxyPort and AdminPort are the sidecar's preferred ports in the pod;
	// the next free ones are taken when the pod already uses them.
	ProxyPort int32
	AdminPort int32
	// Resources of the sidecar container, unless the pod's annotations say
	// otherwise.
	Resources corev1.ResourceRequirements
	// PolicyEndpoint is where sidecars fetch policy updates (the manager's
	// policy stream); empty: sidecars keep their starting snapshot.
	PolicyEndpoint string
	// PolicyCABundle is the PEM the stream's certificate verifies against.
	PolicyCABundle string
	// Tracing turns tracing on in every sidecar (IDEMCP_TRACING), whatever
	// its policy says.
	Tracing bool
	// OTelEnv is the OTEL_* environment every sidecar gets: where its
	// spans go, should tracing be on (by Tracing or by its policy).
	OTelEnv []corev1.EnvVar
}

// OTelEnv picks the OTEL_* variables of environ (as os.Environ gives it)
// that configure a sidecar's exporter: all but OTEL_SERVICE_NAME, so that
// each names itself idemcp-sidecar.
func OTelEnv(environ []string) []corev1.EnvVar {
	var out []corev1.EnvVar
	for _, kv := range environ {
		name, value, ok := strings.Cut(kv, "=")
		if ok && strings.HasPrefix(name, "OTEL_") && name != "OTEL_SERVICE_NAME" {
			out = append(out, corev1.EnvVar{Name: name, Value: value})
		}
	}
	slices.SortFunc(out, func(a, b corev1.EnvVar) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// DefaultConfig returns the defaults the manager's flags start from.
func DefaultConfig(image string) Config {
	return Config{
		Image:     image,
		ProxyPort: 15480,
		AdminPort: 15481,
		Resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("50m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("500m"), corev1.ResourceMemory: resource.MustParse("128Mi")},
		},
	}
}

// Status is the JSON in the idemcp.io/status annotation.
type Status struct {
	Container  string `json:"container"`
	Policy     string `json:"policy"`
	PolicyHash string `json:"policyHash"`
	Upstream   int32  `json:"upstreamPort"`
	ProxyPort  int32  `json:"proxyPort,omitempty"`
	AdminPort  int32  `json:"adminPort,omitempty"`
	Image      string `json:"image"`
	// KeySpace is the sidecar's --key-space: the workload, or the
	// idemcp.io/key-space it shares.
	KeySpace string `json:"keySpace,omitempty"`
}

// Refusal is why the webhook refuses a pod, with a message that says how to
// fix it. Reason is its metric label.
type Refusal struct {
	Reason  string
	Message string
}

func (r *Refusal) Error() string { return r.Message }

func refuse(reason, format string, args ...any) error {
	return &Refusal{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// Reasons for refusing a pod, as metric labels.
const (
	DenyNoUpstreamPort   = "no_upstream_port"
	DenyInvalidPolicy    = "invalid_policy"
	DenyPolicyMissing    = "policy_missing"
	DenyPolicyDeleting   = "policy_deleting"
	DenyPolicyTooLarge   = "policy_too_large"
	DenyBadAnnotation    = "bad_annotation"
	DenyNotTCP           = "not_tcp"
	DenyWindows          = "windows"
	DenyForeignContainer = "foreign_container"
	DenyLabelConflict    = "label_conflict"
	DenyNameCollision    = "name_collision"
	DenyPortCollision    = "port_collision"
	DenyResources        = "resources"
	// DenySecretNotLabelled: the policy names a Secret without the label
	// idemcp.io/credentials: "true" (credentials.Check).
	DenySecretNotLabelled = "secret_not_labelled"
	// DenySecretNotFound: the policy names a Secret (not one the
	// controller makes) that does not exist.
	DenySecretNotFound = "secret_not_found"
	// DenySecretNotOwned: a Secret the controller makes for the policy
	// (NAME-redis, NAME-seal) exists, labelled, but was made by someone
	// else: the policy does not control it.
	DenySecretNotOwned = "secret_not_owned"
	// DenySecretKeyMissing: a Secret the sidecar needs lacks the key.
	DenySecretKeyMissing = "secret_key_missing"
	// DenyRestartPolicy: a plain-container sidecar in a pod that is meant
	// to complete (restartPolicy OnFailure or Never) would keep it running.
	DenyRestartPolicy = "restart_policy"
)

// parseBool reads a boolean label or annotation the one way idemcp reads
// them all: strconv.ParseBool, so "true", "True", "TRUE", "1", "t" and their
// false counterparts; anything else is refused.
func parseBool(what, key, value string) (bool, error) {
	b, err := strconv.ParseBool(value)
	if err != nil {
		return false, refuse(DenyBadAnnotation, "the pod's %s %s is %q, which is not a boolean: use \"true\" or \"false\"", what, key, value)
	}
	return b, nil
}

// OptedIn reports whether the pod asks for the sidecar with the label
// idemcp.io/inject. A value that is not a boolean is an error.
func OptedIn(pod *corev1.Pod) (bool, error) {
	v, ok := pod.Labels[LabelInject]
	if !ok {
		return false, nil
	}
	return parseBool("label", LabelInject, v)
}

// statusOf reads the idemcp.io/status annotation.
func statusOf(pod *corev1.Pod) (Status, bool) {
	var s Status
	v, ok := pod.Annotations[AnnotationStatus]
	if !ok || json.Unmarshal([]byte(v), &s) != nil {
		return Status{}, false
	}
	return s, true
}

// injectedContainer returns the init or regular container called
// ContainerName.
func injectedContainer(pod *corev1.Pod) *corev1.Container {
	for i := range pod.Spec.InitContainers {
		if pod.Spec.InitContainers[i].Name == ContainerName {
			return &pod.Spec.InitContainers[i]
		}
	}
	for i := range pod.Spec.Containers {
		if pod.Spec.Containers[i].Name == ContainerName {
			return &pod.Spec.Containers[i]
		}
	}
	return nil
}

// Injected reports whether the pod carries the webhook's own injection: the
// status annotation together with the sidecar container it describes. A
// container that only has the sidecar's name is not one.
func Injected(pod *corev1.Pod) bool {
	s, ok := statusOf(pod)
	if !ok || s.Container != ContainerName {
		return false
	}
	c := injectedContainer(pod)
	return c != nil && c.Image == s.Image && len(c.Args) > 0 && c.Args[0] == "sidecar"
}

// Inject adds the sidecar to pod for policy p. It changes nothing and
// returns a *Refusal when the pod cannot be injected so that its traffic
// goes through the sidecar and it can start.
func Inject(pod *corev1.Pod, p *v1alpha1.IdempotencyPolicy, policyHash string, cfg Config) error {
	if err := checkPod(pod, p.Name); err != nil {
		return err
	}
	native := true
	if v, ok := pod.Annotations[AnnotationNativeSidecar]; ok {
		b, err := parseBool("annotation", AnnotationNativeSidecar, v)
		if err != nil {
			return err
		}
		native = b
	}
	if rp := pod.Spec.RestartPolicy; !native && rp != "" && rp != corev1.RestartPolicyAlways {
		// A plain container that never exits keeps a Job's pod from ever
		// completing; only a native sidecar is stopped when the main
		// containers end.
		return refuse(DenyRestartPolicy, "the pod's restartPolicy is %s (a Job's pod, or one meant to complete), and %s: \"false\" makes the idemcp sidecar a plain container, which never exits, so the pod would never complete: remove the annotation to get a native sidecar (Kubernetes 1.29 or later), which stops when the pod's containers end, or remove the label %s from pods that are meant to complete",
			rp, AnnotationNativeSidecar, LabelInject)
	}
	snapshot, err := policySnapshot(p)
	if err != nil {
		return err
	}
	out := pod.DeepCopy()
	plan, err := planPorts(out, cfg)
	if err != nil {
		return err
	}
	res, err := sidecarResources(out, cfg)
	if err != nil {
		return err
	}

	keySpace, err := keySpaceOf(out)
	if err != nil {
		return err
	}
	plan.apply()
	c := sidecarContainer(p, cfg, plan, snapshot)
	// Part of every key: two workloads under one policy never replay
	// each other's results.
	c.Env = append(c.Env, corev1.EnvVar{Name: EnvKeySpace, Value: keySpace})
	if v := policywire.LegacyKeysOf(p.Status.LegacyKeys).Flag(); v != "" {
		c.Env = append(c.Env, corev1.EnvVar{Name: EnvLegacyKeys, Value: v})
	}
	c.Resources = res
	c.Env = append(c.Env, memoryEnv(out, res, cfg)...)
	if native {
		// A native sidecar starts before the MCP server and outlives it.
		c.RestartPolicy = ptr.To(corev1.ContainerRestartPolicyAlways)
		out.Spec.InitContainers = append([]corev1.Container{c}, out.Spec.InitContainers...)
	} else {
		out.Spec.Containers = append(out.Spec.Containers, c)
	}
	if err := checkPodLevelResources(out); err != nil {
		return err
	}
	if out.Spec.ServiceAccountName == "" {
		// The projected token needs one; the API server's ServiceAccount
		// admission sets the same default where it runs.
		out.Spec.ServiceAccountName = "default"
	}
	out.Spec.Volumes = append(out.Spec.Volumes, tokenVolume())

	if out.Labels == nil {
		out.Labels = map[string]string{}
	}
	out.Labels[v1alpha1.LabelPolicy] = p.Name
	status, _ := json.Marshal(Status{
		Container: ContainerName, Policy: p.Name, PolicyHash: policyHash, Upstream: plan.upstream,
		ProxyPort: plan.proxyPort, AdminPort: plan.adminPort, Image: cfg.Image, KeySpace: keySpace,
	})
	if out.Annotations == nil {
		out.Annotations = map[string]string{}
	}
	out.Annotations[AnnotationStatus] = string(status)
	*pod = *out
	return nil
}

// checkPod refuses the pods no injection can serve, before anything is
// changed.
func checkPod(pod *corev1.Pod, policy string) error {
	if (pod.Spec.OS != nil && pod.Spec.OS.Name == corev1.Windows) || pod.Spec.NodeSelector[corev1.LabelOSStable] == string(corev1.Windows) {
		return refuse(DenyWindows, "idemcp's sidecar runs only on Linux and this pod is for Windows: run the MCP server on Linux, or remove the label %s", LabelInject)
	}
	if injectedContainer(pod) != nil {
		return refuse(DenyForeignContainer, "the pod has a container named %s that idemcp did not inject (no matching %s annotation): that name is the idemcp sidecar's; rename the container", ContainerName, AnnotationStatus)
	}
	if v, ok := pod.Labels[v1alpha1.LabelPolicy]; ok && v != policy {
		return refuse(DenyLabelConflict, "the pod's label %s is %q but its annotation %s names %q: idemcp never changes a label you set; make them equal or remove the label (and keep it out of workload selectors)", v1alpha1.LabelPolicy, v, AnnotationPolicy, policy)
	}
	for _, v := range pod.Spec.Volumes {
		if v.Name == TokenVolume {
			return refuse(DenyNameCollision, "the pod has a volume named %s, which idemcp adds for its sidecar's token: rename the volume", TokenVolume)
		}
	}
	for _, c := range allContainers(pod) {
		for _, p := range c.Ports {
			if p.Name == PortNameRenamed || p.Name == PortNameAdmin || strings.HasPrefix(p.Name, PortNameShadowed) {
				return refuse(DenyNameCollision, "container %s has a port named %s, a name idemcp gives to ports it adds or renames: rename the port", c.Name, p.Name)
			}
		}
	}
	return nil
}

func tokenVolume() corev1.Volume {
	return corev1.Volume{
		Name: TokenVolume,
		VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
			Sources: []corev1.VolumeProjection{{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{
				Audience: TokenAudience, ExpirationSeconds: ptr.To[int64](3600), Path: "token",
			}}},
		}},
	}
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
// even with no manager to ask. The CRD bounds the tool rules so that any
// valid policy fits; what still does not (a policy from before those
// bounds, very long Secret or address fields) is refused here, because a
// container whose environment is too large never starts.
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
	if len(b) > MaxPolicySnapshotBytes {
		return "", refuse(DenyPolicyTooLarge, "IdempotencyPolicy %s/%s is %d bytes as JSON, more than the %d that fit in the sidecar's IDEMCP_POLICY environment variable (Linux caps one at 128 KiB): shorten or merge its tool rules and ignoreArguments",
			p.Namespace, p.Name, len(b), MaxPolicySnapshotBytes)
	}
	return string(b), nil
}

func sidecarContainer(p *v1alpha1.IdempotencyPolicy, cfg Config, plan *portPlan, snapshot string) corev1.Container {
	args := []string{
		"sidecar",
		"--listen=:" + strconv.Itoa(int(plan.proxyPort)),
		// Always explicit: the sidecar's own default is loopback, which
		// the kubelet's probes and scrapers cannot reach.
		"--admin-listen=:" + strconv.Itoa(int(plan.adminPort)),
		"--upstream=http://127.0.0.1:" + strconv.Itoa(int(plan.upstream)),
	}
	env := []corev1.EnvVar{
		{Name: "IDEMCP_POLICY", Value: snapshot},
		{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
		{Name: "POD_NAMESPACE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.namespace"}}},
		// --upstream-dial-ips: the sidecar reaches the MCP server at the
		// pod's IPs (primary first, both families in a dual-stack pod),
		// so the server sees a request to its pod IP with the client's
		// Host, which SDKs' DNS rebinding protection refuses over loopback;
		// a server that listens only on loopback is reached at --upstream.
		{Name: EnvUpstreamDialIPs, ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.podIPs"}}},
	}
	if r := p.Spec.Store.Redis; p.Spec.Store.Type == v1alpha1.StoreRedis && r != nil {
		if r.Managed != nil {
			args = append(args, "--redis-addr="+managedredis.Addr(p.Namespace, p.Name))
		}
		// The policy's own key space: every workload of the policy shares
		// it (a sidecar run by hand would add its upstream to it).
		env = append(env, corev1.EnvVar{Name: "IDEMCP_REDIS_KEY_PREFIX", Value: policy.RedisKeyPrefix(p.Namespace, p.Name)})
	}
	if pg := p.Spec.Store.Postgres; p.Spec.Store.Type == v1alpha1.StorePostgres && pg != nil {
		env = append(env, corev1.EnvVar{Name: "IDEMCP_POSTGRES_KEY_PREFIX", Value: policy.RedisKeyPrefix(p.Namespace, p.Name)})
	}
	// Secrets never travel in the policy: the kubelet resolves these. They
	// are exactly the ones the webhook checked (credentials.Refs): the
	// Redis password, the PostgreSQL URL, and the keys that seal stored
	// results (read at start: a rotation reaches the sidecar when its pod
	// restarts).
	for _, ref := range credentials.Refs(p) {
		env = append(env, corev1.EnvVar{Name: ref.Env, ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
			LocalObjectReference: corev1.LocalObjectReference{Name: ref.Name}, Key: ref.Key,
		}}})
	}
	if cfg.Tracing {
		env = append(env, corev1.EnvVar{Name: "IDEMCP_TRACING", Value: "true"})
	}
	env = append(env, cfg.OTelEnv...)
	if cfg.PolicyEndpoint != "" {
		env = append(env, corev1.EnvVar{Name: "IDEMCP_POLICY_ENDPOINT", Value: cfg.PolicyEndpoint})
		if cfg.PolicyCABundle != "" {
			env = append(env, corev1.EnvVar{Name: "IDEMCP_POLICY_CA", Value: cfg.PolicyCABundle})
		}
	}
	probe := func(path string) *corev1.Probe {
		return &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: path, Port: intstr.FromString(PortNameAdmin)}},
			PeriodSeconds: 10, TimeoutSeconds: 2, FailureThreshold: 3,
		}
	}
	return corev1.Container{
		Name:    ContainerName,
		Image:   cfg.Image,
		Command: []string{ProxyCommand},
		Args:    args,
		Env:     env,
		Ports: []corev1.ContainerPort{
			{Name: plan.name, ContainerPort: plan.proxyPort, HostPort: plan.hostPort, HostIP: plan.hostIP, Protocol: corev1.ProtocolTCP},
			{Name: PortNameAdmin, ContainerPort: plan.adminPort, Protocol: corev1.ProtocolTCP},
		},
		ReadinessProbe: probe("/readyz"),
		// Liveness is a TCP connect: any pod can reach the admin port, and
		// pods holding all of its connections make HTTP probes get 503
		// (sidecar/listen.go). A connection accepted, even to be answered
		// 503, shows the process alive; restarting it would make every
		// call in flight "outcome unknown". Readiness and startup stay
		// HTTP: they gate traffic, not the container's life.
		LivenessProbe: &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromString(PortNameAdmin)}},
			PeriodSeconds: 10, TimeoutSeconds: 2, FailureThreshold: 3,
		},
		StartupProbe: &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromString(PortNameAdmin)}},
			PeriodSeconds: 1, FailureThreshold: 30,
		},
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
