package controllers

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/credentials"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/webhook"
)

// FieldManagerProxy writes an IdempotentProxy's status.
const FieldManagerProxy = "idemcp-proxy-controller"

// Where a proxy pod finds the upstream's TLS files.
const (
	proxyCAVolume     = "upstream-ca"
	proxyCAPath       = "/etc/idemcp/upstream-ca"
	proxyClientVolume = "upstream-client-cert"
	proxyClientPath   = "/etc/idemcp/upstream-client"
	// annotationTemplateHash is the hash of what the Deployment's pod
	// template was built from, less the policy snapshot: the template is
	// replaced (a rollout) only when it changes. A policy change reaches
	// the pods live, on the policy stream, and restarts nothing.
	annotationTemplateHash = "idemcp.io/template-hash"
	// DefaultUpstreamCheck is how often the upstream is dialled.
	DefaultUpstreamCheck = 30 * time.Second
)

// SyncedPods tells which pods enforce a policy's current version: the
// policy stream (controllers/policystream.Server).
type SyncedPods interface {
	SyncedPods(namespace, policy string) map[string]bool
}

// IdempotentProxyReconciler runs an IdempotentProxy: a Deployment of the
// data plane in front of its upstream, with a Service and a
// PodDisruptionBudget, and reports whether it is ready, reaches its
// upstream and enforces its policy.
type IdempotentProxyReconciler struct {
	client.Client
	// APIReader reads the Secrets and ConfigMaps a proxy names, one at a
	// time: neither is cached.
	APIReader client.Reader
	Scheme    *runtime.Scheme
	// Config is the webhook's: the proxy runs the very container it
	// injects.
	Config webhook.Config
	// PolicyCA returns the PEM the policy stream's certificate verifies
	// against (nil: none given to the pods).
	PolicyCA func(context.Context) ([]byte, error)
	// Streams is the policy stream; nil when the manager serves none
	// (Synced is then not observed).
	Streams SyncedPods
	// UpstreamCheck is how often the upstream is dialled
	// (DefaultUpstreamCheck if 0).
	UpstreamCheck time.Duration
	// Dial connects to the upstream for the check (net.Dialer if nil).
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

// +kubebuilder:rbac:groups=idemcp.io,resources=idempotentproxies,verbs=get;list;watch
// +kubebuilder:rbac:groups=idemcp.io,resources=idempotentproxies/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=idemcp.io,resources=idempotentproxies/finalizers,verbs=update
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups="",resources=services,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get

// proxyConfigError is why a proxy's spec cannot be run as it is: a
// condition reason and a message that names the field.
type proxyConfigError struct{ reason, message string }

func (e *proxyConfigError) Error() string { return e.message }

func configErr(reason, format string, args ...any) error {
	return &proxyConfigError{reason: reason, message: fmt.Sprintf(format, args...)}
}

// Reconcile implements reconcile.Reconciler.
func (r *IdempotentProxyReconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	var px v1alpha1.IdempotentProxy
	if err := r.Get(ctx, req.NamespacedName, &px); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	if !px.DeletionTimestamp.IsZero() {
		return reconcile.Result{}, nil // the garbage collector removes the children
	}
	ctx = log.IntoContext(ctx, log.FromContext(ctx).WithValues("idempotentproxy", klog.KObj(&px)))
	status := px.Status.DeepCopy()
	status.ObservedGeneration = px.Generation
	upstream, upErr := UpstreamURL(&px)
	status.Upstream = upstream

	configured := metav1.Condition{Type: v1alpha1.ConditionConfigured, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonApplied}
	var tlsCfg *tls.Config
	err := upErr
	var pol *v1alpha1.IdempotencyPolicy
	if err == nil {
		pol, tlsCfg, err = r.apply(ctx, &px, upstream, status)
	}
	var cfgErr *proxyConfigError
	switch {
	case errors.As(err, &cfgErr):
		configured.Status, configured.Reason, configured.Message = metav1.ConditionFalse, cfgErr.reason, cfgErr.message
	case err != nil:
		return reconcile.Result{}, err
	default:
		configured.Message = fmt.Sprintf("Deployment, Service and PodDisruptionBudget %s forward to %s under IdempotencyPolicy %s", px.Name, upstream, px.Spec.PolicyRef.Name)
	}

	var dep appsv1.Deployment
	switch err := r.Get(ctx, req.NamespacedName, &dep); {
	case apierrors.IsNotFound(err):
		dep = appsv1.Deployment{}
	case err != nil:
		return reconcile.Result{}, err
	}
	owned := metav1.IsControlledBy(&dep, &px)
	status.Replicas, status.ReadyReplicas = 0, 0
	if owned {
		status.Replicas, status.ReadyReplicas = dep.Status.Replicas, dep.Status.ReadyReplicas
	}
	want := ptr.Deref(px.Spec.Replicas, 2)
	status.Ready = fmt.Sprintf("%d/%d", status.ReadyReplicas, want)
	available := availableCondition(&px, want, status.ReadyReplicas)

	every := r.UpstreamCheck
	if every <= 0 {
		every = DefaultUpstreamCheck
	}
	reach := meta.FindStatusCondition(status.Conditions, v1alpha1.ConditionUpstreamReachable)
	due := reach == nil || status.UpstreamCheckedAt == nil || time.Since(status.UpstreamCheckedAt.Time) >= every ||
		reach.ObservedGeneration != px.Generation
	var reachable metav1.Condition
	if upErr != nil {
		reachable = metav1.Condition{Type: v1alpha1.ConditionUpstreamReachable, Status: metav1.ConditionUnknown, Reason: v1alpha1.ReasonNotChecked, Message: "the upstream is not known: " + upErr.Error()}
	} else if due && (configured.Status == metav1.ConditionTrue || tlsCfg != nil || !isHTTPS(upstream)) {
		reachable = r.checkUpstream(ctx, upstream, tlsCfg)
		status.UpstreamCheckedAt = &metav1.Time{Time: time.Now()}
	} else if reach != nil {
		reachable = *reach
	} else {
		reachable = metav1.Condition{Type: v1alpha1.ConditionUpstreamReachable, Status: metav1.ConditionUnknown, Reason: v1alpha1.ReasonNotChecked, Message: "not checked until spec.upstream.tls can be read: see the Configured condition"}
	}

	synced, err := r.syncedCondition(ctx, &px, pol, status)
	if err != nil {
		return reconcile.Result{}, err
	}
	for _, c := range []metav1.Condition{configured, reachable, available, synced} {
		c.ObservedGeneration = px.Generation
		meta.SetStatusCondition(&status.Conditions, c)
	}
	ready := proxyReady(status.Conditions)
	ready.ObservedGeneration = px.Generation
	meta.SetStatusCondition(&status.Conditions, ready)

	patch := client.MergeFrom(px.DeepCopy())
	px.Status = *status
	if err := r.Status().Patch(ctx, &px, patch); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	next := every
	if status.UpstreamCheckedAt != nil {
		next = max(time.Until(status.UpstreamCheckedAt.Add(every)), time.Second)
	}
	if synced.Status != metav1.ConditionTrue && synced.Reason != v1alpha1.ReasonSyncNotObserved {
		next = min(next, 2*time.Second) // acknowledgements come within a second
	}
	if configured.Status != metav1.ConditionTrue {
		// Secrets and ConfigMaps are not watched: look again soon.
		next = min(next, 5*time.Second)
	}
	return reconcile.Result{RequeueAfter: next}, nil
}

// UpstreamURL is the URL a proxy forwards to: spec.upstream.url, or the
// Service's in-cluster name.
func UpstreamURL(px *v1alpha1.IdempotentProxy) (string, error) {
	u := px.Spec.Upstream
	switch {
	case u.URL != "":
		parsed, err := url.Parse(u.URL)
		if err != nil || (parsed.Scheme != "http" && parsed.Scheme != "https") || parsed.Hostname() == "" || parsed.User != nil {
			return "", configErr(v1alpha1.ReasonInvalidSpec, "spec.upstream.url %q is not an https:// or http:// URL with a host and no credentials, such as https://mcp.example.com", u.URL)
		}
		return u.URL, nil
	case u.Service != nil:
		scheme := "http"
		if u.Service.Scheme == v1alpha1.SchemeHTTPS {
			scheme = "https"
		}
		return fmt.Sprintf("%s://%s.%s.svc:%d%s", scheme, u.Service.Name, px.Namespace, u.Service.Port, u.Service.Path), nil
	}
	return "", configErr(v1alpha1.ReasonInvalidSpec, "spec.upstream needs url or service")
}

func isHTTPS(u string) bool { return len(u) > 8 && u[:8] == "https://" }

// proxyLabels select a proxy's pods.
func proxyLabels(px *v1alpha1.IdempotentProxy) map[string]string {
	return map[string]string{
		"app.kubernetes.io/name":     "idemcp-proxy",
		"app.kubernetes.io/instance": px.Name,
		v1alpha1.LabelProxy:          px.Name,
	}
}

// ProxyKeyPrefix is the key space of a proxy's records in a shared store:
// under its policy's, and its own, as one workload's is.
func ProxyKeyPrefix(px *v1alpha1.IdempotentProxy) string {
	return policy.RedisKeyPrefix(px.Namespace, px.Spec.PolicyRef.Name) + "idpx/" + px.Name + ":"
}

// apply reads what the proxy names and applies its Deployment, Service
// and PodDisruptionBudget. A *proxyConfigError says what to fix.
func (r *IdempotentProxyReconciler) apply(ctx context.Context, px *v1alpha1.IdempotentProxy, upstream string, status *v1alpha1.IdempotentProxyStatus) (*v1alpha1.IdempotencyPolicy, *tls.Config, error) {
	var pol v1alpha1.IdempotencyPolicy
	key := client.ObjectKey{Namespace: px.Namespace, Name: px.Spec.PolicyRef.Name}
	tlsCfg, args, vols, mounts, tlsErr := r.upstreamTLS(ctx, px, upstream)
	switch err := r.Get(ctx, key, &pol); {
	case apierrors.IsNotFound(err):
		return nil, tlsCfg, configErr(v1alpha1.ReasonPolicyNotFound, "spec.policyRef.name: IdempotencyPolicy %s does not exist: create it, or name an IdempotencyPolicy of namespace %s", key, px.Namespace)
	case err != nil:
		return nil, tlsCfg, fmt.Errorf("reading IdempotencyPolicy %s: %w", key, err)
	}
	compiled, err := policy.Compile(pol.Spec)
	if err != nil {
		return &pol, tlsCfg, configErr(v1alpha1.ReasonPolicyInvalid, "spec.policyRef.name: IdempotencyPolicy %s is invalid: %v", key, err)
	}
	status.PolicyHash = compiled.Hash
	if tlsErr != nil {
		return &pol, tlsCfg, tlsErr
	}
	if err := r.checkPolicySecrets(ctx, &pol); err != nil {
		return &pol, tlsCfg, err
	}
	cfg := r.Config
	if r.PolicyCA != nil && cfg.PolicyEndpoint != "" {
		ca, err := r.PolicyCA(ctx)
		if err != nil {
			return &pol, tlsCfg, fmt.Errorf("reading the policy stream's CA: %w", err)
		}
		cfg.PolicyCABundle = string(ca)
	}
	hostHeader := webhookHostHeader(px.Spec.Upstream.HostHeader)
	args = append(args, "--upstream-host-header="+hostHeader)
	c, annotation, err := webhook.StandaloneContainer(&pol, compiled.Hash, cfg, webhook.Standalone{
		Upstream: upstream, Args: args, KeyPrefix: ProxyKeyPrefix(px), Resources: px.Spec.Resources, Mounts: mounts,
	})
	if err != nil {
		return &pol, tlsCfg, configErr(v1alpha1.ReasonPolicyInvalid, "spec.policyRef.name: %v", err)
	}
	if err := r.applyChildren(ctx, px, &pol, c, annotation, vols); err != nil {
		return &pol, tlsCfg, err
	}
	return &pol, tlsCfg, nil
}

func webhookHostHeader(h v1alpha1.HostHeader) string {
	if h == v1alpha1.HostClient {
		return "client"
	}
	return "upstream"
}

// checkPolicySecrets makes sure the Secrets the policy gives its data
// plane exist with the owner's consent, as the webhook does for an
// injected pod: a pod with a secretKeyRef to a missing Secret never starts.
func (r *IdempotentProxyReconciler) checkPolicySecrets(ctx context.Context, p *v1alpha1.IdempotencyPolicy) error {
	for _, ref := range credentials.Refs(p) {
		var s corev1.Secret
		err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: p.Namespace, Name: ref.Name}, &s)
		switch {
		case apierrors.IsNotFound(err) && ref.Managed:
			return configErr(v1alpha1.ReasonSecretNotFound, "IdempotencyPolicy %s/%s: its Secret %s (%s) is not made yet; the idemcp controller makes it within seconds", p.Namespace, p.Name, ref.Name, ref.Field)
		case apierrors.IsNotFound(err):
			return configErr(v1alpha1.ReasonSecretNotFound, "IdempotencyPolicy %s/%s: Secret %s (%s) does not exist: create it with the label %s: %q", p.Namespace, p.Name, ref.Name, ref.Field, credentials.Label, credentials.Value)
		case err != nil:
			return fmt.Errorf("reading Secret %s/%s: %w", p.Namespace, ref.Name, err)
		}
		if err := credentials.Check(ref, &s); err != nil {
			return configErr(v1alpha1.ReasonSecretNotLabelled, "IdempotencyPolicy %s/%s may not use this Secret: %v", p.Namespace, p.Name, err)
		}
		if _, ok := s.Data[ref.Key]; !ok {
			return configErr(v1alpha1.ReasonSecretKeyMissing, "IdempotencyPolicy %s/%s: Secret %s (%s) has no key %q", p.Namespace, p.Name, ref.Name, ref.Field, ref.Key)
		}
	}
	return nil
}

// upstreamTLS reads spec.upstream.tls: the data plane's flags, volumes and
// mounts, and the TLS configuration the manager's own check dials with.
// The returned configuration is usable even with an error about a later
// field when the earlier ones could be read.
func (r *IdempotentProxyReconciler) upstreamTLS(ctx context.Context, px *v1alpha1.IdempotentProxy, upstream string) (*tls.Config, []string, []corev1.Volume, []corev1.VolumeMount, error) {
	t := px.Spec.Upstream.TLS
	if !isHTTPS(upstream) {
		return nil, nil, nil, nil, nil
	}
	if t == nil {
		// The system's roots and the URL's host, as the data plane does.
		return &tls.Config{MinVersion: tls.VersionTLS12}, nil, nil, nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: t.ServerName}
	var (
		args   []string
		vols   []corev1.Volume
		mounts []corev1.VolumeMount
	)
	if t.ServerName != "" {
		args = append(args, "--upstream-server-name="+t.ServerName)
	}
	if b := t.CABundle; b != nil {
		var pem []byte
		var src corev1.VolumeSource
		switch {
		case b.SecretRef != nil:
			field := "spec.upstream.tls.caBundle.secretRef"
			s, err := r.labelledSecret(ctx, px.Namespace, b.SecretRef.Name, field, b.SecretRef.Key)
			if err != nil {
				return nil, nil, nil, nil, err
			}
			pem = s.Data[b.SecretRef.Key]
			src.Secret = &corev1.SecretVolumeSource{SecretName: s.Name, Items: []corev1.KeyToPath{{Key: b.SecretRef.Key, Path: "ca.crt"}}}
		case b.ConfigMapRef != nil:
			var cm corev1.ConfigMap
			key := client.ObjectKey{Namespace: px.Namespace, Name: b.ConfigMapRef.Name}
			switch err := r.APIReader.Get(ctx, key, &cm); {
			case apierrors.IsNotFound(err):
				return nil, nil, nil, nil, configErr(v1alpha1.ReasonConfigMapNotFound, "spec.upstream.tls.caBundle.configMapRef.name: ConfigMap %s does not exist: create it with the CA's PEM under key %q", key, b.ConfigMapRef.Key)
			case err != nil:
				return nil, nil, nil, nil, fmt.Errorf("reading ConfigMap %s: %w", key, err)
			}
			pem = []byte(cm.Data[b.ConfigMapRef.Key])
			if len(pem) == 0 {
				return nil, nil, nil, nil, configErr(v1alpha1.ReasonSecretKeyMissing, "spec.upstream.tls.caBundle.configMapRef.key: ConfigMap %s has no key %q", key, b.ConfigMapRef.Key)
			}
			src.ConfigMap = &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: cm.Name}, Items: []corev1.KeyToPath{{Key: b.ConfigMapRef.Key, Path: "ca.crt"}}}
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, nil, nil, nil, configErr(v1alpha1.ReasonInvalidSecret, "spec.upstream.tls.caBundle: the key holds no PEM certificate: put the CA's certificate (-----BEGIN CERTIFICATE-----) there")
		}
		cfg.RootCAs = pool
		vols = append(vols, corev1.Volume{Name: proxyCAVolume, VolumeSource: src})
		mounts = append(mounts, corev1.VolumeMount{Name: proxyCAVolume, MountPath: proxyCAPath, ReadOnly: true})
		args = append(args, "--upstream-ca-file="+proxyCAPath+"/ca.crt")
	}
	if ref := t.ClientCertSecretRef; ref != nil {
		field := "spec.upstream.tls.clientCertSecretRef"
		s, err := r.labelledSecret(ctx, px.Namespace, ref.Name, field, corev1.TLSCertKey, corev1.TLSPrivateKeyKey)
		if err != nil {
			return cfg, nil, nil, nil, err
		}
		kp, err := tls.X509KeyPair(s.Data[corev1.TLSCertKey], s.Data[corev1.TLSPrivateKeyKey])
		if err != nil {
			return cfg, nil, nil, nil, configErr(v1alpha1.ReasonInvalidSecret, "%s.name: Secret %s/%s does not hold a certificate and its key in %s and %s: %v", field, px.Namespace, ref.Name, corev1.TLSCertKey, corev1.TLSPrivateKeyKey, err)
		}
		cfg.Certificates = []tls.Certificate{kp}
		vols = append(vols, corev1.Volume{Name: proxyClientVolume, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: ref.Name}}})
		mounts = append(mounts, corev1.VolumeMount{Name: proxyClientVolume, MountPath: proxyClientPath, ReadOnly: true})
		args = append(args, "--upstream-client-cert-file="+proxyClientPath+"/"+corev1.TLSCertKey, "--upstream-client-key-file="+proxyClientPath+"/"+corev1.TLSPrivateKeyKey)
	}
	return cfg, args, vols, mounts, nil
}

// labelledSecret reads a Secret a proxy names for its pods, which must
// exist, carry idemcp's credentials label (its owner's consent) and hold
// keys.
func (r *IdempotentProxyReconciler) labelledSecret(ctx context.Context, ns, name, field string, keys ...string) (*corev1.Secret, error) {
	var s corev1.Secret
	switch err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &s); {
	case apierrors.IsNotFound(err):
		return nil, configErr(v1alpha1.ReasonSecretNotFound, "%s.name: Secret %s/%s does not exist: create it with the label %s: %q", field, ns, name, credentials.Label, credentials.Value)
	case err != nil:
		return nil, fmt.Errorf("reading Secret %s/%s (%s): %w", ns, name, field, err)
	}
	if !credentials.Allowed(&s) {
		return nil, configErr(v1alpha1.ReasonSecretNotLabelled, "%s.name: Secret %s/%s lacks the label %s: %q, its owner's consent to its use by idemcp: %s", field, ns, name, credentials.Label, credentials.Value, credentials.LabelCommand(ns, name))
	}
	for _, k := range keys {
		if len(s.Data[k]) == 0 {
			return nil, configErr(v1alpha1.ReasonSecretKeyMissing, "%s: Secret %s/%s has no key %q", field, ns, name, k)
		}
	}
	return &s, nil
}

// applyChildren creates or updates the proxy's Deployment, Service and
// PodDisruptionBudget.
func (r *IdempotentProxyReconciler) applyChildren(ctx context.Context, px *v1alpha1.IdempotentProxy, pol *v1alpha1.IdempotencyPolicy, c corev1.Container, annotation string, vols []corev1.Volume) error {
	labels := proxyLabels(px)
	objLabels := map[string]string{"app.kubernetes.io/managed-by": "idemcp", v1alpha1.LabelProxy: px.Name, "app.kubernetes.io/name": "idemcp-proxy", "app.kubernetes.io/instance": px.Name}
	podLabels := map[string]string{v1alpha1.LabelPolicy: pol.Name, v1alpha1.LabelInject: "false"}
	for k, v := range labels {
		podLabels[k] = v
	}
	template := corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: podLabels, Annotations: map[string]string{webhook.AnnotationStatus: annotation}},
		Spec: corev1.PodSpec{
			ServiceAccountName:           "default",
			AutomountServiceAccountToken: ptr.To(false),
			Containers:                   []corev1.Container{c},
			Volumes:                      append([]corev1.Volume{{Name: webhook.TokenVolume, VolumeSource: webhook.TokenVolumeSource()}}, vols...),
			// Calls in flight finish and are stored before the pod goes
			// (the data plane's --shutdown-timeout is 30s).
			TerminationGracePeriodSeconds: ptr.To[int64](45),
			SecurityContext:               &corev1.PodSecurityContext{RunAsNonRoot: ptr.To(true), SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
		},
	}
	hash := templateHash(template, pol.Spec.Store)

	dep := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: px.Namespace, Name: px.Name}}
	if err := r.ensureOwned(ctx, px, dep, func() {
		dep.Labels = mergeLabels(dep.Labels, objLabels)
		dep.Spec.Replicas = ptr.To(ptr.Deref(px.Spec.Replicas, 2))
		if dep.Spec.Selector == nil {
			dep.Spec.Selector = &metav1.LabelSelector{MatchLabels: labels}
		}
		if dep.Annotations[annotationTemplateHash] != hash || dep.Spec.Template.Labels[v1alpha1.LabelPolicy] != pol.Name {
			// Otherwise the live template stays, with its older policy
			// snapshot: the pods get the current policy on the stream.
			dep.Spec.Template = template
			if dep.Annotations == nil {
				dep.Annotations = map[string]string{}
			}
			dep.Annotations[annotationTemplateHash] = hash
		}
		dep.Spec.Strategy = appsv1.DeploymentStrategy{Type: appsv1.RollingUpdateDeploymentStrategyType, RollingUpdate: &appsv1.RollingUpdateDeployment{
			MaxUnavailable: ptr.To(intstr.FromInt32(0)), MaxSurge: ptr.To(intstr.FromInt32(1)),
		}}
	}); err != nil {
		return err
	}
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: px.Namespace, Name: px.Name}}
	if err := r.ensureOwned(ctx, px, svc, func() {
		svc.Labels = mergeLabels(svc.Labels, objLabels)
		svc.Spec.Selector = labels
		svc.Spec.Ports = []corev1.ServicePort{{Name: webhook.PortNameMCP, Port: px.Spec.Port, TargetPort: intstr.FromString(webhook.PortNameMCP), Protocol: corev1.ProtocolTCP, AppProtocol: ptr.To("http")}}
	}); err != nil {
		return err
	}
	pdb := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Namespace: px.Namespace, Name: px.Name}}
	return r.ensureOwned(ctx, px, pdb, func() {
		pdb.Labels = mergeLabels(pdb.Labels, objLabels)
		pdb.Spec.Selector = &metav1.LabelSelector{MatchLabels: labels}
		// One pod at a time: a drain never takes every replica, and a
		// retry finds another one serving.
		pdb.Spec.MaxUnavailable = ptr.To(intstr.FromInt32(1))
		pdb.Spec.MinAvailable = nil
	})
}

// templateHash hashes a pod template less its policy snapshot, plus the
// store the policy names (a running data plane cannot switch stores, so a
// store change must restart the pods; everything else the stream brings).
func templateHash(t corev1.PodTemplateSpec, store v1alpha1.StoreSpec) string {
	t = *t.DeepCopy()
	t.Annotations = nil
	for i := range t.Spec.Containers {
		for j := range t.Spec.Containers[i].Env {
			if t.Spec.Containers[i].Env[j].Name == "IDEMCP_POLICY" {
				t.Spec.Containers[i].Env[j].Value = ""
			}
		}
	}
	b, _ := json.Marshal([]any{t, store})
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:8])
}

// ensureOwned creates obj or updates it with mutate, unless it exists and
// belongs to someone else: idemcp never adopts an object.
func (r *IdempotentProxyReconciler) ensureOwned(ctx context.Context, px *v1alpha1.IdempotentProxy, obj client.Object, mutate func()) error {
	kind := fmt.Sprintf("%T", obj)[len("*v1."):]
	conflict := configErr(v1alpha1.ReasonObjectConflict, "metadata.name: a %s %s/%s exists that IdempotentProxy %s does not control; idemcp never adopts it: delete it, or rename the proxy", kind, px.Namespace, px.Name, px.Name)
	_, err := controllerutil.CreateOrUpdate(ctx, r.Client, obj, func() error {
		if obj.GetUID() != "" && !metav1.IsControlledBy(obj, px) {
			return conflict
		}
		mutate()
		return controllerutil.SetControllerReference(px, obj, r.Scheme)
	})
	if apierrors.IsAlreadyExists(err) {
		// The cache holds only idemcp's own objects (labelled
		// app.kubernetes.io/managed-by: idemcp): this one is someone else's.
		return conflict
	}
	var ce *proxyConfigError
	if err != nil && !errors.As(err, &ce) {
		return fmt.Errorf("applying %s %s/%s: %w", kind, px.Namespace, px.Name, err)
	}
	return err
}

// checkUpstream dials the upstream, with a TLS handshake for https://:
// nothing is sent, so no tool runs.
func (r *IdempotentProxyReconciler) checkUpstream(ctx context.Context, upstream string, cfg *tls.Config) metav1.Condition {
	c := metav1.Condition{Type: v1alpha1.ConditionUpstreamReachable}
	u, err := url.Parse(upstream)
	if err != nil {
		c.Status, c.Reason, c.Message = metav1.ConditionUnknown, v1alpha1.ReasonNotChecked, err.Error()
		return c
	}
	port := u.Port()
	if port == "" {
		port = "80"
		if u.Scheme == "https" {
			port = "443"
		}
	}
	addr := net.JoinHostPort(u.Hostname(), port)
	dial := r.Dial
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	start := time.Now()
	conn, err := dial(ctx, "tcp", addr)
	if err != nil {
		c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonUnreachable
		c.Message = fmt.Sprintf("the manager cannot connect to %s (spec.upstream): %v; check the host name, the port and any NetworkPolicy or firewall between the cluster and the server", addr, err)
		return c
	}
	defer func() { _ = conn.Close() }()
	what := "TCP connect"
	if u.Scheme == "https" {
		if cfg == nil {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12}
		} else {
			cfg = cfg.Clone()
		}
		if cfg.ServerName == "" {
			cfg.ServerName = u.Hostname()
		}
		tc := tls.Client(conn, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonTLSHandshakeFailed
			c.Message = fmt.Sprintf("TLS handshake with %s (server name %s) failed: %v; set spec.upstream.tls.caBundle to the CA that signed the server's certificate, or spec.upstream.tls.serverName to a name in it", addr, cfg.ServerName, err)
			return c
		}
		what = "TLS handshake"
	}
	c.Status, c.Reason = metav1.ConditionTrue, v1alpha1.ReasonReachable
	c.Message = fmt.Sprintf("%s to %s succeeded in %s (checked from the manager, every %s; no request is sent)", what, addr, time.Since(start).Round(time.Millisecond), r.upstreamEvery())
	return c
}

func (r *IdempotentProxyReconciler) upstreamEvery() time.Duration {
	if r.UpstreamCheck > 0 {
		return r.UpstreamCheck
	}
	return DefaultUpstreamCheck
}

func availableCondition(px *v1alpha1.IdempotentProxy, want, ready int32) metav1.Condition {
	c := metav1.Condition{Type: v1alpha1.ConditionAvailable}
	switch {
	case want == 0:
		c.Status, c.Reason, c.Message = metav1.ConditionFalse, v1alpha1.ReasonScaledToZero, "spec.replicas is 0: no pod serves the Service; set spec.replicas to 1 or more"
	case ready >= want:
		c.Status, c.Reason, c.Message = metav1.ConditionTrue, v1alpha1.ReasonReplicasReady, fmt.Sprintf("%d of %d replicas ready", ready, want)
	default:
		c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonReplicasNotReady
		c.Message = fmt.Sprintf("%d of %d replicas ready; see kubectl -n %s describe pods -l %s=%s", ready, want, px.Namespace, v1alpha1.LabelProxy, px.Name)
	}
	return c
}

// syncedCondition counts the proxy's pods that enforce the policy's
// current version, and writes status.synced.
func (r *IdempotentProxyReconciler) syncedCondition(ctx context.Context, px *v1alpha1.IdempotentProxy, pol *v1alpha1.IdempotencyPolicy, status *v1alpha1.IdempotentProxyStatus) (metav1.Condition, error) {
	c := metav1.Condition{Type: v1alpha1.ConditionProxiesSynced}
	var pods corev1.PodList
	if err := r.List(ctx, &pods, client.InNamespace(px.Namespace), client.MatchingLabels{v1alpha1.LabelProxy: px.Name}); err != nil {
		return c, fmt.Errorf("listing the pods of IdempotentProxy %s: %w", klog.KObj(px), err)
	}
	var running []string
	for i := range pods.Items {
		p := &pods.Items[i]
		if p.DeletionTimestamp == nil && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
			running = append(running, p.Name)
		}
	}
	m := len(running)
	if pol == nil || r.Streams == nil {
		status.Synced = fmt.Sprintf("?/%d", m)
		c.Status, c.Reason = metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved
		c.Message = "the manager runs without the policy stream, so the pods' policy is not observed"
		if pol == nil {
			c.Message = "no policy to sync: see the Configured condition"
		}
		return c, nil
	}
	synced := r.Streams.SyncedPods(px.Namespace, pol.Name)
	n := 0
	var behind []string
	for _, name := range running {
		if synced[name] {
			n++
		} else {
			behind = append(behind, name)
		}
	}
	status.Synced = strconv.Itoa(n) + "/" + strconv.Itoa(m)
	switch {
	case m == 0:
		c.Status, c.Reason, c.Message = metav1.ConditionTrue, v1alpha1.ReasonNoInjectedPods, "no proxy pod runs; nothing to sync"
	case n == m:
		c.Status, c.Reason, c.Message = metav1.ConditionTrue, v1alpha1.ReasonAllSynced, fmt.Sprintf("all %d proxy pods enforce IdempotencyPolicy %s at %s", m, pol.Name, status.PolicyHash)
	default:
		c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonSyncing
		c.Message = fmt.Sprintf("%d of %d proxy pods enforce IdempotencyPolicy %s at %s; not yet: %v (see the policy's SidecarsSynced condition: kubectl -n %s describe idpol %s)", n, m, pol.Name, status.PolicyHash, behind, px.Namespace, pol.Name)
	}
	return c, nil
}

// proxyReady sums the other conditions up.
func proxyReady(conds []metav1.Condition) metav1.Condition {
	c := metav1.Condition{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonReady, Message: "the proxy serves, reaches its upstream and enforces its policy"}
	for _, dep := range []struct{ typ, reason string }{
		{v1alpha1.ConditionConfigured, v1alpha1.ReasonNotConfigured},
		{v1alpha1.ConditionAvailable, v1alpha1.ReasonNotAvailable},
		{v1alpha1.ConditionUpstreamReachable, v1alpha1.ReasonUpstreamDown},
		{v1alpha1.ConditionProxiesSynced, v1alpha1.ReasonProxiesNotSynced},
	} {
		d := meta.FindStatusCondition(conds, dep.typ)
		if d == nil || d.Status == metav1.ConditionTrue {
			continue
		}
		if d.Status == metav1.ConditionUnknown && d.Reason == v1alpha1.ReasonSyncNotObserved {
			c.Status, c.Reason, c.Message = metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved, d.Message
			continue
		}
		return metav1.Condition{Type: v1alpha1.ConditionReady, Status: metav1.ConditionFalse, Reason: dep.reason, Message: dep.typ + ": " + d.Message}
	}
	return c
}

// SetupWithManager registers the reconciler.
func (r *IdempotentProxyReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1alpha1.IdempotentProxy{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Owns(&appsv1.Deployment{}).
		Owns(&corev1.Service{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		Watches(&v1alpha1.IdempotencyPolicy{}, handler.EnqueueRequestsFromMapFunc(r.policyToProxies)).
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(podToProxy),
			builder.WithPredicates(predicate.NewPredicateFuncs(func(o client.Object) bool {
				_, ok := o.GetLabels()[v1alpha1.LabelProxy]
				return ok
			}))).
		Named("idempotentproxy").
		Complete(r)
}

func (r *IdempotentProxyReconciler) policyToProxies(ctx context.Context, o client.Object) []reconcile.Request {
	var list v1alpha1.IdempotentProxyList
	if err := r.List(ctx, &list, client.InNamespace(o.GetNamespace())); err != nil {
		log.FromContext(ctx).Error(err, "Listing the IdempotentProxies of a policy failed", "policy", klog.KObj(o))
		return nil
	}
	var out []reconcile.Request
	for _, px := range list.Items {
		if px.Spec.PolicyRef.Name == o.GetName() {
			out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: px.Namespace, Name: px.Name}})
		}
	}
	return out
}

func podToProxy(_ context.Context, o client.Object) []reconcile.Request {
	return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: o.GetLabels()[v1alpha1.LabelProxy]}}}
}
