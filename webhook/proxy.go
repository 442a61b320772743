package webhook

import (
	"encoding/json"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// Standalone is what the pods of an IdempotentProxy need beyond what an
// injected sidecar gets: an upstream outside the pod, its TLS, the Host
// sent to it, and a key space of their own.
type Standalone struct {
	// Upstream is the upstream's URL (--upstream).
	Upstream string
	// Args are more flags of the data plane (the upstream's TLS and Host).
	Args []string
	// Env are more variables.
	Env []corev1.EnvVar
	// KeyPrefix is the prefix of the proxy's records in a shared store:
	// its own, like one workload's.
	KeyPrefix string
	// Resources of the proxy container; nil: cfg.Resources.
	Resources *corev1.ResourceRequirements
	// Mounts are more volume mounts (the TLS files).
	Mounts []corev1.VolumeMount
}

// StandaloneContainer is the data-plane container of an IdempotentProxy's
// pod for policy p, policyHash its compiled hash: the container the
// webhook injects (the same flags, env, Secrets, probes and security
// context), except that it forwards to s.Upstream, never at the pod's own
// IPs, and keeps its records under s.KeyPrefix. It also returns the
// value of the pod's AnnotationStatus, which makes the policy count the
// pod as one that uses it (its finalizer keeps the store while the pod
// runs). The pod needs TokenVolumeSource as the volume TokenVolume.
func StandaloneContainer(p *v1alpha1.IdempotencyPolicy, policyHash string, cfg Config, s Standalone) (corev1.Container, string, error) {
	snapshot, err := policySnapshot(p)
	if err != nil {
		return corev1.Container{}, "", err
	}
	plan := &portPlan{name: PortNameMCP, proxyPort: cfg.ProxyPort, adminPort: cfg.AdminPort}
	c := sidecarContainer(p, cfg, plan, snapshot)
	for i, a := range c.Args {
		if strings.HasPrefix(a, "--upstream=") {
			c.Args[i] = "--upstream=" + s.Upstream
		}
	}
	c.Args = append(c.Args, s.Args...)
	env := c.Env[:0]
	for _, e := range c.Env {
		switch e.Name {
		case EnvUpstreamDialIPs:
			// The upstream is not in the pod: dialling the pod's own IP
			// at its port would reach the proxy itself, or nothing.
			continue
		case "IDEMCP_REDIS_KEY_PREFIX", "IDEMCP_POSTGRES_KEY_PREFIX":
			e.Value = s.KeyPrefix
		}
		env = append(env, e)
	}
	c.Env = append(env, s.Env...)
	c.Resources = *cfg.Resources.DeepCopy()
	if s.Resources != nil {
		c.Resources = *s.Resources.DeepCopy()
	}
	c.Env = append(c.Env, memoryEnv(&corev1.Pod{}, c.Resources, cfg)...)
	c.VolumeMounts = append(c.VolumeMounts, s.Mounts...)
	status, err := json.Marshal(Status{
		Container: ContainerName, Policy: p.Name, PolicyHash: policyHash,
		ProxyPort: plan.proxyPort, AdminPort: plan.adminPort, Image: cfg.Image,
	})
	if err != nil {
		return corev1.Container{}, "", err
	}
	return c, string(status), nil
}

// TokenVolumeSource is the projected service account token (audience
// idemcp) the data plane authenticates to the policy stream with.
func TokenVolumeSource() corev1.VolumeSource { return tokenVolume().VolumeSource }
