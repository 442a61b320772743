package webhook

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/sidecar/policy"
)

// Path is where the manager serves the Pod webhook.
const Path = "/mutate-v1-pod"

// MissingPolicy says what happens to an opted-in pod whose policy does not
// exist.
type MissingPolicy string

const (
	// MissingPolicyDeny refuses the pod, so it never runs without the
	// exactly-once guarantee it asked for. A ReplicaSet retries, so the pod
	// starts once the policy is applied. The default.
	MissingPolicyDeny MissingPolicy = "deny"
	// MissingPolicyAdmit lets the pod start without the sidecar.
	MissingPolicyAdmit MissingPolicy = "admit"
)

// Reasons for skipping or refusing a pod, as metric labels and events.
const (
	SkipManagerNamespace = "manager_namespace"
	SkipNotOptedIn       = "not_opted_in"
	SkipHostNetwork      = "host_network"
	SkipAlreadyInjected  = "already_injected"
	SkipPolicyMissing    = "policy_missing"
	DenyPolicyMissing    = "policy_missing"
	DenyNoUpstreamPort   = "no_upstream_port"
	DenyInvalidPolicy    = "invalid_policy"
)

var (
	injections = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "idemcp_webhook_injections_total",
		Help: "Pods the webhook injected the sidecar into.",
	})
	skips = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idemcp_webhook_skips_total",
		Help: "Pods the webhook admitted without injecting, by reason.",
	}, []string{"reason"})
	denials = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idemcp_webhook_denials_total",
		Help: "Pods the webhook refused, by reason.",
	}, []string{"reason"})
)

func init() {
	metrics.Registry.MustRegister(injections, skips, denials)
}

// Injector is the Pod defaulter. It is safe to run twice on one pod.
type Injector struct {
	Client           client.Reader
	Config           Config
	ManagerNamespace string
	MissingPolicy    MissingPolicy
	Recorder         events.EventRecorder
}

var _ admission.Defaulter[*corev1.Pod] = (*Injector)(nil)

// Default injects the sidecar into pod if it opted in.
func (i *Injector) Default(ctx context.Context, pod *corev1.Pod) error {
	ns := pod.Namespace
	if req, err := admission.RequestFromContext(ctx); err == nil && req.Namespace != "" {
		ns = req.Namespace
	}
	name := pod.Name
	if name == "" {
		name = pod.GenerateName + "<generated>"
	}
	logger := log.FromContext(ctx).WithValues("pod", ns+"/"+name)
	switch {
	case ns == i.ManagerNamespace:
		skips.WithLabelValues(SkipManagerNamespace).Inc()
		return nil
	case !optedIn(pod):
		skips.WithLabelValues(SkipNotOptedIn).Inc()
		return nil
	case Injected(pod):
		skips.WithLabelValues(SkipAlreadyInjected).Inc()
		return nil
	}
	policyName := pod.Annotations[AnnotationPolicy]
	var p v1alpha1.IdempotencyPolicy
	err := errors.New("the pod has no " + AnnotationPolicy + " annotation")
	if policyName != "" {
		err = i.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: policyName}, &p)
	}
	if pod.Spec.HostNetwork {
		skips.WithLabelValues(SkipHostNetwork).Inc()
		logger.Info("Not injecting a hostNetwork pod: the sidecar's ports would be the node's")
		if err == nil {
			i.Recorder.Eventf(&p, nil, corev1.EventTypeWarning, "HostNetworkSkipped", "Inject",
				"Pod %s uses hostNetwork and was admitted without the idemcp sidecar", name)
		}
		return nil
	}
	if err != nil {
		if policyName != "" && !apierrors.IsNotFound(err) {
			return fmt.Errorf("reading IdempotencyPolicy %s/%s: %w", ns, policyName, err)
		}
		msg := fmt.Sprintf("IdempotencyPolicy %s/%s not found: create it, or set the pod's %s annotation to an existing policy, or remove %s", ns, policyName, AnnotationPolicy, AnnotationInject)
		if policyName == "" {
			msg = fmt.Sprintf("the pod asks for idemcp (%s: \"true\") but names no policy: add the annotation %s: <name of an IdempotencyPolicy in %s>", AnnotationInject, AnnotationPolicy, ns)
		}
		if i.MissingPolicy == MissingPolicyAdmit {
			skips.WithLabelValues(SkipPolicyMissing).Inc()
			logger.Info("Admitting without the sidecar", "reason", msg)
			return nil
		}
		denials.WithLabelValues(DenyPolicyMissing).Inc()
		return errors.New(msg)
	}
	compiled, err := policy.Compile(p.Spec)
	if err != nil {
		denials.WithLabelValues(DenyInvalidPolicy).Inc()
		return fmt.Errorf("IdempotencyPolicy %s/%s is invalid: %w", ns, policyName, err)
	}
	if err := Inject(pod, &p, compiled.Hash, i.Config); err != nil {
		denials.WithLabelValues(DenyNoUpstreamPort).Inc()
		i.Recorder.Eventf(&p, nil, corev1.EventTypeWarning, "InjectionRefused", "Inject", "Pod %s: %v", name, err)
		return fmt.Errorf("idemcp cannot inject pod %s: %w", name, err)
	}
	injections.Inc()
	i.Recorder.Eventf(&p, nil, corev1.EventTypeNormal, "Injected", "Inject", "Injected the idemcp sidecar into pod %s", name)
	logger.V(1).Info("Injected the sidecar", "policy", policyName, "policyHash", compiled.Hash)
	return nil
}

// Handler returns the admission handler to register at Path.
func (i *Injector) Handler(scheme *runtime.Scheme) http.Handler {
	return admission.WithDefaulter[*corev1.Pod](scheme, i)
}
