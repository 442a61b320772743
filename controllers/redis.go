package controllers

import (
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"strconv"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// DefaultRedisImage runs a managed Redis when the policy names no image.
const DefaultRedisImage = "redis:7.4-alpine"

const (
	redisPort          = 6379
	redisPasswordKey   = "password"
	redisConfigKey     = "redis.conf"
	redisComponent     = "redis"
	redisDataVolume    = "data"
	redisConfigVolume  = "config"
	redisConfigMount   = "/etc/redis"
	redisDataMount     = "/data"
	redisUID           = 999 // the redis user of the official images
	redisPasswordBytes = 32
)

// RedisName is the name of the Secret, workload and Service of a policy's
// managed Redis.
func RedisName(policy string) string { return policy + "-redis" }

// RedisEndpoint is the address sidecars use for a policy's managed Redis.
func RedisEndpoint(p *v1alpha1.IdempotencyPolicy) string {
	return fmt.Sprintf("%s.%s.svc:%d", RedisName(p.Name), p.Namespace, redisPort)
}

func redisLabels(p *v1alpha1.IdempotencyPolicy) map[string]string {
	return map[string]string{
		"app.kubernetes.io/name":       "redis",
		"app.kubernetes.io/instance":   RedisName(p.Name),
		"app.kubernetes.io/managed-by": "idemcp",
		v1alpha1.LabelPolicy:           p.Name,
		v1alpha1.LabelComponent:        redisComponent,
	}
}

func redisSelector(p *v1alpha1.IdempotencyPolicy) map[string]string {
	return map[string]string{"app.kubernetes.io/instance": RedisName(p.Name), v1alpha1.LabelComponent: redisComponent}
}

// newRedisPassword makes the password of a managed Redis, once.
func newRedisPassword() (string, error) {
	b := make([]byte, redisPasswordBytes)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(b), nil
}

// redisSecretData holds the password and a redis.conf that requires it, so
// the password never appears on Redis's command line.
func redisSecretData(password string) map[string][]byte {
	conf := fmt.Sprintf("requirepass %s\n", password)
	return map[string][]byte{redisPasswordKey: []byte(password), redisConfigKey: []byte(conf)}
}

// redisPodSpec is the pod of a managed Redis: append-only persistence, no
// eviction (an evicted claim would let a duplicate run), restricted
// security context.
func redisPodSpec(p *v1alpha1.IdempotencyPolicy, image string) corev1.PodSpec {
	m := p.Spec.Store.Redis.Managed
	if m.Image != "" {
		image = m.Image
	}
	c := corev1.Container{
		Name:  "redis",
		Image: image,
		Args: []string{
			redisConfigMount + "/" + redisConfigKey,
			"--appendonly", "yes",
			"--maxmemory-policy", "noeviction",
			"--dir", redisDataMount,
			"--protected-mode", "no",
		},
		Ports: []corev1.ContainerPort{{Name: "redis", ContainerPort: redisPort, Protocol: corev1.ProtocolTCP}},
		ReadinessProbe: &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromString("redis")}},
			PeriodSeconds: 5,
		},
		LivenessProbe: &corev1.Probe{
			ProbeHandler:        corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromString("redis")}},
			InitialDelaySeconds: 10,
			PeriodSeconds:       10,
		},
		VolumeMounts: []corev1.VolumeMount{
			{Name: redisConfigVolume, MountPath: redisConfigMount, ReadOnly: true},
			{Name: redisDataVolume, MountPath: redisDataMount},
		},
		SecurityContext: &corev1.SecurityContext{
			RunAsNonRoot:             ptr.To(true),
			RunAsUser:                ptr.To[int64](redisUID),
			RunAsGroup:               ptr.To[int64](redisUID),
			AllowPrivilegeEscalation: ptr.To(false),
			ReadOnlyRootFilesystem:   ptr.To(true),
			Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
			SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
		},
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
	if m.Resources != nil {
		c.Resources = *m.Resources
	} else {
		c.Resources = corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("50m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		}
	}
	if limit := c.Resources.Limits.Memory(); limit != nil && !limit.IsZero() {
		// noeviction needs a maxmemory: without one Redis grows until the
		// kernel kills it, losing the claims it held. 75% leaves room for
		// the append-only rewrite.
		c.Args = append(c.Args, "--maxmemory", strconv.FormatInt(limit.Value()*3/4, 10))
	}
	spec := corev1.PodSpec{
		Containers:                   []corev1.Container{c},
		AutomountServiceAccountToken: ptr.To(false),
		SecurityContext:              &corev1.PodSecurityContext{FSGroup: ptr.To[int64](redisUID)},
		Volumes: []corev1.Volume{{
			Name: redisConfigVolume,
			VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
				SecretName: RedisName(p.Name),
				Items:      []corev1.KeyToPath{{Key: redisConfigKey, Path: redisConfigKey}},
			}},
		}},
	}
	if m.Storage == nil {
		spec.Volumes = append(spec.Volumes, corev1.Volume{Name: redisDataVolume, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}})
	}
	return spec
}

// mutateRedisDeployment sets the fields idemcp owns on a Deployment,
// leaving the ones the API server defaults alone, so an unchanged policy
// makes no update.
func mutateRedisDeployment(d *appsv1.Deployment, p *v1alpha1.IdempotencyPolicy, image string) {
	d.Labels = mergeLabels(d.Labels, redisLabels(p))
	d.Spec.Replicas = ptr.To[int32](1)
	// One Redis at a time: two would split the records.
	d.Spec.Strategy = appsv1.DeploymentStrategy{Type: appsv1.RecreateDeploymentStrategyType}
	d.Spec.Selector = &metav1.LabelSelector{MatchLabels: redisSelector(p)}
	d.Spec.Template.Labels = redisLabels(p)
	mutatePodSpec(&d.Spec.Template.Spec, redisPodSpec(p, image))
}

func mutateRedisStatefulSet(s *appsv1.StatefulSet, p *v1alpha1.IdempotencyPolicy, image string) {
	s.Labels = mergeLabels(s.Labels, redisLabels(p))
	s.Spec.Replicas = ptr.To[int32](1)
	s.Spec.ServiceName = RedisName(p.Name)
	s.Spec.Selector = &metav1.LabelSelector{MatchLabels: redisSelector(p)}
	s.Spec.Template.Labels = redisLabels(p)
	mutatePodSpec(&s.Spec.Template.Spec, redisPodSpec(p, image))
	if s.CreationTimestamp.IsZero() { // volumeClaimTemplates cannot change
		s.Spec.VolumeClaimTemplates = []corev1.PersistentVolumeClaim{{
			ObjectMeta: metav1.ObjectMeta{Name: redisDataVolume, Labels: redisLabels(p)},
			Spec: corev1.PersistentVolumeClaimSpec{
				AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: *p.Spec.Store.Redis.Managed.Storage}},
			},
		}}
	}
}

// mutatePodSpec copies the desired pod spec's owned fields over the live
// one, keeping what the API server defaulted in the containers.
func mutatePodSpec(live *corev1.PodSpec, want corev1.PodSpec) {
	if len(live.Containers) != 1 {
		live.Containers = want.Containers
	} else {
		lc, wc := &live.Containers[0], want.Containers[0]
		lc.Name, lc.Image, lc.Args, lc.Ports = wc.Name, wc.Image, wc.Args, wc.Ports
		lc.Resources, lc.VolumeMounts, lc.SecurityContext = wc.Resources, wc.VolumeMounts, wc.SecurityContext
		lc.TerminationMessagePolicy = wc.TerminationMessagePolicy
		lc.Command, lc.Env = nil, nil
		if lc.ReadinessProbe == nil || lc.ReadinessProbe.TCPSocket == nil {
			lc.ReadinessProbe = wc.ReadinessProbe
		}
		if lc.LivenessProbe == nil || lc.LivenessProbe.TCPSocket == nil {
			lc.LivenessProbe = wc.LivenessProbe
		}
	}
	live.AutomountServiceAccountToken = want.AutomountServiceAccountToken
	if live.SecurityContext == nil || live.SecurityContext.FSGroup == nil {
		live.SecurityContext = want.SecurityContext
	}
	live.Volumes = mergeVolumes(live.Volumes, want.Volumes)
}

// mergeVolumes returns want, keeping defaulted fields of volumes that did
// not change in kind.
func mergeVolumes(live, want []corev1.Volume) []corev1.Volume {
	byName := map[string]corev1.Volume{}
	for _, v := range live {
		byName[v.Name] = v
	}
	out := make([]corev1.Volume, 0, len(want))
	for _, w := range want {
		if l, ok := byName[w.Name]; ok && sameVolumeKind(l, w) {
			if w.Secret != nil {
				l.Secret.SecretName, l.Secret.Items = w.Secret.SecretName, w.Secret.Items
			}
			out = append(out, l)
			continue
		}
		out = append(out, w)
	}
	return out
}

func sameVolumeKind(a, b corev1.Volume) bool {
	return (a.Secret != nil) == (b.Secret != nil) && (a.EmptyDir != nil) == (b.EmptyDir != nil)
}

func mutateRedisService(s *corev1.Service, p *v1alpha1.IdempotencyPolicy) {
	s.Labels = mergeLabels(s.Labels, redisLabels(p))
	s.Spec.Selector = redisSelector(p)
	s.Spec.Ports = []corev1.ServicePort{{Name: "redis", Port: redisPort, TargetPort: intstr.FromString("redis"), Protocol: corev1.ProtocolTCP}}
}

func mergeLabels(live, want map[string]string) map[string]string {
	if live == nil {
		live = map[string]string{}
	}
	for k, v := range want {
		live[k] = v
	}
	return live
}
