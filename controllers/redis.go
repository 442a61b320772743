package controllers

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"strconv"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/credentials"
	"github.com/idemcp/idemcp/internal/managedredis"
)

// DefaultRedisImage runs a new managed Redis when the policy names no image.
const DefaultRedisImage = "redis:7.4-alpine"

// DefaultRedisStorage is the volume of a managed Redis whose policy names
// no size.
var DefaultRedisStorage = resource.MustParse("1Gi")

// Default resources of a managed Redis: requests equal limits, so it runs
// in the Guaranteed QoS class and is the last to be evicted.
var (
	defaultRedisCPU    = resource.MustParse("100m")
	defaultRedisMemory = resource.MustParse("256Mi")
)

const (
	redisPort          = managedredis.Port
	redisPasswordKey   = credentials.RedisPasswordKey
	redisConfigKey     = credentials.RedisConfigKey
	redisComponent     = "redis"
	redisContainer     = "redis"
	redisDataVolume    = "data"
	redisConfigVolume  = "config"
	redisConfigMount   = "/etc/redis"
	redisDataMount     = "/data"
	redisUID           = 999 // the redis user of the official images
	redisPasswordBytes = 32
	// annotationConfigHash on the pod template restarts Redis when its
	// password changes (a lost Secret was recreated).
	annotationConfigHash = "idemcp.io/config-hash"
	managedBy            = "idemcp"
)

// RedisReadinessCommand is the managed Redis's readiness probe: ready only
// when Redis answers PONG, which it does not while it loads its
// append-only file (it answers LOADING), nor to a wrong password.
// redis-cli exits 0 on an error reply, hence the grep; it reads the
// password from REDISCLI_AUTH, so it never appears on a command line.
var RedisReadinessCommand = []string{"sh", "-c", fmt.Sprintf("redis-cli -h 127.0.0.1 -p %d ping | grep -qx PONG", redisPort)}

// RedisName is the name of the Secret, StatefulSet, Service,
// PodDisruptionBudget and NetworkPolicy of a policy's managed Redis.
func RedisName(policy string) string { return credentials.RedisSecretName(policy) }

// RedisClaimName is the volume claim of a policy's managed Redis.
func RedisClaimName(policy string) string { return redisDataVolume + "-" + RedisName(policy) + "-0" }

// RedisEndpoint is the address sidecars use for a policy's managed Redis.
func RedisEndpoint(p *v1alpha1.IdempotencyPolicy) string {
	return managedredis.Addr(p.Namespace, p.Name)
}

func redisLabels(p *v1alpha1.IdempotencyPolicy) map[string]string {
	return map[string]string{
		"app.kubernetes.io/name":       "redis",
		"app.kubernetes.io/instance":   RedisName(p.Name),
		"app.kubernetes.io/managed-by": managedBy,
		v1alpha1.LabelPolicy:           p.Name,
		v1alpha1.LabelComponent:        redisComponent,
	}
}

// redisPodLabels also opt the pod out of injection explicitly, so the
// webhook is never even called for it.
func redisPodLabels(p *v1alpha1.IdempotencyPolicy) map[string]string {
	l := redisLabels(p)
	l[v1alpha1.LabelInject] = "false"
	return l
}

func redisSelector(p *v1alpha1.IdempotencyPolicy) map[string]string {
	return map[string]string{"app.kubernetes.io/instance": RedisName(p.Name), v1alpha1.LabelComponent: redisComponent}
}

// newRedisPassword makes the password of a managed Redis.
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

func configHash(data map[string][]byte) string {
	sum := sha256.Sum256(data[redisConfigKey])
	return hex.EncodeToString(sum[:8])
}

// redisResources makes requests equal limits (Guaranteed QoS): a missing
// limit takes the request, a missing request the limit, and a resource
// with neither takes the default.
func redisResources(m *v1alpha1.ManagedRedis) corev1.ResourceRequirements {
	var in corev1.ResourceRequirements
	if m.Resources != nil {
		in = *m.Resources.DeepCopy()
	}
	out := corev1.ResourceRequirements{Requests: corev1.ResourceList{}, Limits: corev1.ResourceList{}}
	for name, def := range map[corev1.ResourceName]resource.Quantity{corev1.ResourceCPU: defaultRedisCPU, corev1.ResourceMemory: defaultRedisMemory} {
		q, ok := in.Limits[name]
		if !ok {
			q, ok = in.Requests[name]
		}
		if !ok {
			q = def
		}
		out.Requests[name], out.Limits[name] = q, q
	}
	return out
}

// redisMaxMemory is 75% of the memory limit: noeviction needs a maxmemory
// (without one Redis grows until the kernel kills it, losing the claims it
// held), and the rest leaves room for the append-only rewrite.
func redisMaxMemory(res corev1.ResourceRequirements) int64 {
	return res.Limits.Memory().Value() * 3 / 4
}

// redisPodSpec is the pod of a managed Redis: append-only persistence, no
// eviction (an evicted claim would let a duplicate run), restricted
// security context.
func redisPodSpec(p *v1alpha1.IdempotencyPolicy, image string) corev1.PodSpec {
	m := p.Spec.Store.Redis.Managed
	res := redisResources(m)
	c := corev1.Container{
		Name:  redisContainer,
		Image: image,
		Args: []string{
			redisConfigMount + "/" + redisConfigKey,
			"--appendonly", "yes",
			"--maxmemory-policy", "noeviction",
			"--maxmemory", strconv.FormatInt(redisMaxMemory(res), 10),
			"--dir", redisDataMount,
			// requirepass is set and the NetworkPolicy admits only the
			// policy's own pods; protected mode would refuse them all.
			"--protected-mode", "no",
		},
		Env: []corev1.EnvVar{{Name: "REDISCLI_AUTH", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
			LocalObjectReference: corev1.LocalObjectReference{Name: RedisName(p.Name)}, Key: redisPasswordKey,
		}}}},
		Ports: []corev1.ContainerPort{{Name: "redis", ContainerPort: redisPort, Protocol: corev1.ProtocolTCP}},
		ReadinessProbe: &corev1.Probe{
			ProbeHandler:   corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: RedisReadinessCommand}},
			PeriodSeconds:  5,
			TimeoutSeconds: 3,
		},
		// TCP, not ping: a Redis loading a large file is alive, not stuck.
		LivenessProbe: &corev1.Probe{
			ProbeHandler:        corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromString("redis")}},
			InitialDelaySeconds: 10,
			PeriodSeconds:       10,
		},
		Resources: res,
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
	if m.Ephemeral {
		spec.Volumes = append(spec.Volumes, corev1.Volume{Name: redisDataVolume, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}})
	}
	return spec
}

// redisStorage is the size of the volume a policy asks for.
func redisStorage(m *v1alpha1.ManagedRedis) resource.Quantity {
	if m.Storage != nil {
		return *m.Storage
	}
	return DefaultRedisStorage
}

// mutateRedisStatefulSet sets the fields idemcp owns. The immutable ones
// (selector, service name, volume claims) are set only on creation; the
// CRD refuses a change of storage or ephemeral, which would need new ones.
func mutateRedisStatefulSet(s *appsv1.StatefulSet, p *v1alpha1.IdempotencyPolicy, image, hash string) {
	s.Labels = mergeLabels(s.Labels, redisLabels(p))
	s.Spec.Replicas = ptr.To[int32](1)
	// A StatefulSet runs at most one pod per ordinal, even during a
	// rollout or on a lost node: never two Redis splitting the records.
	s.Spec.UpdateStrategy = appsv1.StatefulSetUpdateStrategy{Type: appsv1.RollingUpdateStatefulSetStrategyType}
	// The claim goes with the StatefulSet: switching away from managed
	// Redis, or deleting the policy, leaves no orphaned volume.
	s.Spec.PersistentVolumeClaimRetentionPolicy = &appsv1.StatefulSetPersistentVolumeClaimRetentionPolicy{
		WhenDeleted: appsv1.DeletePersistentVolumeClaimRetentionPolicyType,
		WhenScaled:  appsv1.RetainPersistentVolumeClaimRetentionPolicyType,
	}
	if s.CreationTimestamp.IsZero() {
		s.Spec.ServiceName = RedisName(p.Name)
		s.Spec.PodManagementPolicy = appsv1.OrderedReadyPodManagement
		s.Spec.Selector = &metav1.LabelSelector{MatchLabels: redisSelector(p)}
		if m := p.Spec.Store.Redis.Managed; !m.Ephemeral {
			s.Spec.VolumeClaimTemplates = []corev1.PersistentVolumeClaim{{
				ObjectMeta: metav1.ObjectMeta{Name: redisDataVolume, Labels: redisLabels(p)},
				Spec: corev1.PersistentVolumeClaimSpec{
					AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
					StorageClassName: m.StorageClassName,
					Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: redisStorage(m)}},
				},
			}}
		}
	}
	s.Spec.Template.Labels = redisPodLabels(p)
	s.Spec.Template.Annotations = mergeLabels(s.Spec.Template.Annotations, map[string]string{annotationConfigHash: hash})
	mutatePodSpec(&s.Spec.Template.Spec, redisPodSpec(p, image))
}

// mutatePodSpec copies the desired pod spec's owned fields over the live
// one, keeping what the API server defaulted, so an unchanged policy makes
// no update (and no restart).
func mutatePodSpec(live *corev1.PodSpec, want corev1.PodSpec) {
	if len(live.Containers) != 1 {
		live.Containers = want.Containers
	} else {
		lc, wc := &live.Containers[0], want.Containers[0]
		lc.Name, lc.Image, lc.Args, lc.Ports, lc.Env = wc.Name, wc.Image, wc.Args, wc.Ports, wc.Env
		lc.Resources, lc.VolumeMounts, lc.SecurityContext = wc.Resources, wc.VolumeMounts, wc.SecurityContext
		lc.TerminationMessagePolicy = wc.TerminationMessagePolicy
		lc.Command = nil
		if lc.ReadinessProbe == nil || lc.ReadinessProbe.Exec == nil || !equalStrings(lc.ReadinessProbe.Exec.Command, wc.ReadinessProbe.Exec.Command) {
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

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
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

// mutateRedisPDB keeps voluntary disruptions (a node drain) from evicting
// a ready Redis: a drain waits until someone moves it knowingly. An
// unready Redis may always be evicted, so a broken one never blocks a
// drain.
func mutateRedisPDB(b *policyv1.PodDisruptionBudget, p *v1alpha1.IdempotencyPolicy) {
	b.Labels = mergeLabels(b.Labels, redisLabels(p))
	b.Spec.MaxUnavailable = ptr.To(intstr.FromInt32(0))
	b.Spec.MinAvailable = nil
	b.Spec.Selector = &metav1.LabelSelector{MatchLabels: redisSelector(p)}
	b.Spec.UnhealthyPodEvictionPolicy = ptr.To(policyv1.AlwaysAllow)
}

// mutateRedisNetworkPolicy admits port 6379 only from the pods the webhook
// injected for this policy.
func mutateRedisNetworkPolicy(n *networkingv1.NetworkPolicy, p *v1alpha1.IdempotencyPolicy) {
	n.Labels = mergeLabels(n.Labels, redisLabels(p))
	n.Spec = networkingv1.NetworkPolicySpec{
		PodSelector: metav1.LabelSelector{MatchLabels: redisSelector(p)},
		PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
		Ingress: []networkingv1.NetworkPolicyIngressRule{{
			// The webhook writes idemcp.io/policy on the pods it injects;
			// the Redis pods carry it too, with a component label.
			From: []networkingv1.NetworkPolicyPeer{{PodSelector: &metav1.LabelSelector{
				MatchLabels:      map[string]string{v1alpha1.LabelPolicy: p.Name},
				MatchExpressions: []metav1.LabelSelectorRequirement{{Key: v1alpha1.LabelComponent, Operator: metav1.LabelSelectorOpDoesNotExist}},
			}}},
			Ports: []networkingv1.NetworkPolicyPort{{Protocol: ptr.To(corev1.ProtocolTCP), Port: ptr.To(intstr.FromInt32(redisPort))}},
		}},
	}
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
