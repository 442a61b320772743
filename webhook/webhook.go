package webhook

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/bounded"
	"github.com/idemcp/idemcp/internal/credentials"
	"github.com/idemcp/idemcp/internal/policy"
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

// Reasons for skipping a pod, as metric labels.
const (
	SkipManagerNamespace = "manager_namespace"
	SkipNotOptedIn       = "not_opted_in"
	SkipHostNetwork      = "host_network"
	SkipAlreadyInjected  = "already_injected"
	SkipPolicyMissing    = "policy_missing"
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
	Client client.Reader
	// APIReader, when set, is asked before a policy missing from Client's
	// cache is reported missing.
	APIReader        client.Reader
	Config           Config
	ManagerNamespace string
	MissingPolicy    MissingPolicy
	Recorder         events.EventRecorder
	// PolicyCA returns the PEM injected as IDEMCP_POLICY_CA beside the
	// policy stream's endpoint.
	PolicyCA func(context.Context) ([]byte, error)
	// SecretsMetadataOnly reads the Secrets a policy names as metadata
	// only: their owner's consent (the label) is checked, whether they
	// hold the key is not. kubectl-idemcp sets it, so it never fetches a
	// Secret's data with its user's credentials.
	SecretsMetadataOnly bool
	// Unchecked, when set, is told what Decide could not check (a Secret
	// its reader may not get) instead of failing on it: kubectl-idemcp
	// says so in its verdict. The webhook leaves it nil.
	Unchecked func(what string)
}

var _ admission.Defaulter[*corev1.Pod] = (*Injector)(nil)

// +kubebuilder:rbac:groups="",resources=limitranges,verbs=get;list;watch

// call is one admission of one pod. A dry run (kubectl --dry-run=server)
// has no side effects: no Events, no metrics, as the webhook's
// sideEffects: None promises.
type call struct {
	dryRun   bool
	recorder events.EventRecorder
}

func (c call) event(regarding runtime.Object, eventtype, reason, note string, args ...any) {
	if !c.dryRun {
		c.recorder.Eventf(regarding, nil, eventtype, reason, "Inject", "%s", bounded.Note(fmt.Sprintf(note, args...)))
	}
}

func (c call) skip(reason string) string {
	if !c.dryRun {
		skips.WithLabelValues(reason).Inc()
	}
	return reason
}

func (c call) deny(err error) error {
	reason := "error"
	var r *Refusal
	if errors.As(err, &r) {
		reason = r.Reason
	}
	if !c.dryRun {
		denials.WithLabelValues(reason).Inc()
	}
	return err
}

// Default injects the sidecar into pod if it opted in.
func (i *Injector) Default(ctx context.Context, pod *corev1.Pod) error {
	_, err := i.Decide(ctx, pod)
	return err
}

// Decide is Default that also says why it left a pod as it was: skipped is
// one of the Skip* reasons, or "" when it injected pod or refused it (err).
// kubectl-idemcp check-inject calls it on a copy, with a dry-run request in
// ctx, so that it explains exactly what the webhook decides.
func (i *Injector) Decide(ctx context.Context, pod *corev1.Pod) (skipped string, err error) {
	ns := pod.Namespace
	c := call{recorder: i.Recorder}
	if req, err := admission.RequestFromContext(ctx); err == nil {
		if req.Namespace != "" {
			ns = req.Namespace
		}
		c.dryRun = req.DryRun != nil && *req.DryRun
	}
	name := describePod(pod)
	logger := log.FromContext(ctx).WithValues("namespace", ns, "pod", name)
	if ns == i.ManagerNamespace {
		return c.skip(SkipManagerNamespace), nil
	}
	optedIn, err := OptedIn(pod)
	switch {
	case err != nil:
		return "", c.deny(err)
	case !optedIn:
		return c.skip(SkipNotOptedIn), nil
	case Injected(pod):
		return c.skip(SkipAlreadyInjected), nil
	}
	policyName := pod.Annotations[AnnotationPolicy]
	var p v1alpha1.IdempotencyPolicy
	err = errors.New("the pod has no " + AnnotationPolicy + " annotation")
	if policyName != "" {
		key := client.ObjectKey{Namespace: ns, Name: policyName}
		err = i.Client.Get(ctx, key, &p)
		if apierrors.IsNotFound(err) && i.APIReader != nil {
			// A policy applied a moment ago may not be in the cache yet.
			err = i.APIReader.Get(ctx, key, &p)
		}
	}
	if pod.Spec.HostNetwork {
		logger.Info("Not injecting a hostNetwork pod: the sidecar's ports would be the node's")
		if err == nil {
			c.event(&p, corev1.EventTypeWarning, "HostNetworkSkipped", "%s uses hostNetwork and was admitted without the idemcp sidecar", capitalize(name))
		}
		return c.skip(SkipHostNetwork), nil
	}
	if err != nil {
		if policyName != "" && !apierrors.IsNotFound(err) {
			return "", fmt.Errorf("reading IdempotencyPolicy %s/%s: %w", ns, policyName, err)
		}
		msg := fmt.Sprintf("IdempotencyPolicy %s/%s not found: create it, or set the pod's %s annotation to an existing policy, or remove the label %s", ns, policyName, AnnotationPolicy, LabelInject)
		if policyName == "" {
			msg = fmt.Sprintf("the pod asks for idemcp (label %s: \"true\") but names no policy: add the annotation %s: <name of an IdempotencyPolicy in %s>", LabelInject, AnnotationPolicy, ns)
		}
		if i.MissingPolicy == MissingPolicyAdmit {
			logger.Info("Admitting without the sidecar", "reason", msg)
			return c.skip(SkipPolicyMissing), nil
		}
		return "", c.deny(refuse(DenyPolicyMissing, "%s", msg))
	}
	if p.DeletionTimestamp != nil {
		// A new pod would hold the policy's finalizer, and its store, for
		// as long as it lives: the deletion would never finish.
		msg := fmt.Sprintf("IdempotencyPolicy %s/%s is being deleted (since %s): it waits for the pods that use it to go, so it takes no new ones; remove the %s annotation, or name another policy, or recreate the policy once its deletion is done",
			ns, policyName, p.DeletionTimestamp.UTC().Format(time.RFC3339), AnnotationPolicy)
		if i.MissingPolicy == MissingPolicyAdmit {
			logger.Info("Admitting without the sidecar", "reason", msg)
			return c.skip(SkipPolicyMissing), nil
		}
		return "", c.deny(refuse(DenyPolicyDeleting, "%s", msg))
	}
	compiled, err := policy.Compile(p.Spec)
	if err != nil {
		return "", c.deny(refuse(DenyInvalidPolicy, "IdempotencyPolicy %s/%s is invalid: %v", ns, policyName, err))
	}
	cfg := i.Config
	if i.PolicyCA != nil && cfg.PolicyEndpoint != "" {
		// The bundle of today: the CAs the policy stream may serve from.
		ca, caErr := i.PolicyCA(ctx)
		if caErr != nil {
			return "", fmt.Errorf("idemcp cannot inject %s: reading the policy stream's CA: %w", name, caErr)
		}
		cfg.PolicyCABundle = string(ca)
	}
	err = i.checkSecrets(ctx, ns, &p)
	if err == nil {
		err = Inject(pod, &p, compiled.Hash, cfg)
	}
	if err == nil {
		var ranges corev1.LimitRangeList
		if err = i.Client.List(ctx, &ranges, client.InNamespace(ns)); err != nil {
			return "", fmt.Errorf("reading the LimitRanges of %s: %w", ns, err)
		}
		err = applyLimitRanges(pod, ranges.Items)
	}
	if err != nil {
		c.event(&p, corev1.EventTypeWarning, "InjectionRefused", "%s: %v", capitalize(name), err)
		return "", c.deny(fmt.Errorf("idemcp cannot inject %s: %w", name, err))
	}
	if !c.dryRun {
		injections.Inc()
	}
	c.event(&p, corev1.EventTypeNormal, "Injected", "Injected the idemcp sidecar into %s", name)
	if pod.Spec.AutomountServiceAccountToken != nil && !*pod.Spec.AutomountServiceAccountToken {
		// The policy stream authenticates the sidecar with a token for the
		// audience idemcp only (the API server does not accept it), mounted
		// into the sidecar alone: the app containers still get no token.
		if regarding := eventTarget(pod, ns); regarding != nil {
			c.event(regarding, corev1.EventTypeNormal, "IdemcpTokenMounted",
				"%s: automountServiceAccountToken is false; the idemcp sidecar alone gets a token of audience %s (not valid for the API server) for its policy stream", capitalize(name), TokenAudience)
		}
	}
	logger.V(1).Info("Injected the sidecar", "policy", policyName, "policyHash", compiled.Hash)
	return "", nil
}

// describePod names a pod under admission for a person: "pod mcp-0", or,
// for a pod whose name is generated only after admission, the workload
// that creates it ("a new pod of ReplicaSet mcp-5d8f").
func describePod(pod *corev1.Pod) string {
	switch owner := metav1.GetControllerOf(pod); {
	case pod.Name != "":
		return "pod " + pod.Name
	case owner != nil:
		return fmt.Sprintf("a new pod of %s %s", owner.Kind, owner.Name)
	case pod.GenerateName != "":
		return fmt.Sprintf("a new pod (generateName %s)", pod.GenerateName)
	}
	return "a new pod"
}

func capitalize(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// checkSecrets refuses a pod whose policy would give its sidecar a Secret
// without the owner's consent (credentials.Check), or a key the Secret
// does not have (the pod could never start). A Secret the policy names
// that does not exist is refused too: consent is read at admission only,
// so a pod admitted with a secretKeyRef to a missing Secret would get it
// from the kubelet once someone creates it, labelled or not. The pod could
// not start without it anyway, and its workload retries. Only the Secrets
// the controller makes (NAME-redis, NAME-seal) may be missing: it makes
// them labelled, within seconds of the policy.
func (i *Injector) checkSecrets(ctx context.Context, ns string, p *v1alpha1.IdempotencyPolicy) error {
	reader := i.APIReader
	if reader == nil {
		reader = i.Client
	}
	for _, ref := range credentials.Refs(p) {
		var (
			obj    client.Object
			secret *corev1.Secret
		)
		if i.SecretsMetadataOnly {
			m := &metav1.PartialObjectMetadata{}
			m.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Secret"))
			obj = m
		} else {
			secret = &corev1.Secret{}
			obj = secret
		}
		err := reader.Get(ctx, client.ObjectKey{Namespace: ns, Name: ref.Name}, obj)
		switch {
		case apierrors.IsForbidden(err) && i.Unchecked != nil:
			i.Unchecked(fmt.Sprintf("whether Secret %s/%s (%s) exists and carries the label %s: %q: reading its metadata needs get on secrets (%v)", ns, ref.Name, ref.Field, credentials.Label, credentials.Value, err))
			continue
		case apierrors.IsNotFound(err) && ref.Managed:
			continue
		case apierrors.IsNotFound(err):
			return refuse(DenySecretNotFound, "Secret %s/%s (%s) does not exist: idemcp gives the sidecar a Secret only once it exists and carries the label %s: %q (its owner's consent), so the pod could not start; create the Secret with that label, or label it once it exists (%s), and the pod's workload retries",
				ns, ref.Name, ref.Field, credentials.Label, credentials.Value, credentials.LabelCommand(ns, ref.Name))
		case err != nil:
			return fmt.Errorf("reading Secret %s/%s (%s): %w", ns, ref.Name, ref.Field, err)
		}
		if err := credentials.Check(ref, obj); err != nil {
			return refuse(DenySecretNotLabelled, "IdempotencyPolicy %s/%s may not use this Secret: %v", ns, p.Name, err)
		}
		if ref.Managed && !metav1.IsControlledBy(obj, p) {
			// The label alone would let whoever may create Secrets choose
			// the password or seal keys of the policy's sidecars.
			return refuse(DenySecretNotOwned, "Secret %s/%s (%s) is not controlled by IdempotencyPolicy %s/%s: idemcp makes this Secret itself and gives the sidecar only its own, and this one was made by someone else (the policy's StoreReady says %s); delete the Secret and idemcp makes its own, or rename the policy",
				ns, ref.Name, ref.Field, ns, p.Name, v1alpha1.ReasonRedisObjectConflict)
		}
		if secret == nil {
			if i.Unchecked != nil {
				i.Unchecked(fmt.Sprintf("whether Secret %s/%s (%s) has the key %q: that needs the Secret's data, which kubectl idemcp never reads", ns, ref.Name, ref.Field, ref.Key))
			}
			continue
		}
		if _, ok := secret.Data[ref.Key]; !ok {
			fix := fmt.Sprintf("add the key to the Secret, or change %s", ref.Field)
			switch {
			case ref.Managed && ref.Key == credentials.RedisPasswordKey:
				fix = "the idemcp controller puts it back within seconds, and the pod's workload retries; if this stays, see the policy's StoreReady condition (kubectl -n " + ns + " describe idpol " + p.Name + ")"
			case ref.Managed:
				fix = "the idemcp controller gives it a new key within seconds (results stored under the lost key then run again once; its Event SealKeysRepaired says so), and the pod's workload retries; if this stays, see the policy's StoreReady condition (kubectl -n " + ns + " describe idpol " + p.Name + ")"
			}
			return refuse(DenySecretKeyMissing, "Secret %s/%s (%s) has no key %q, which the sidecar's %s needs: the pod could not start; %s",
				ns, ref.Name, ref.Field, ref.Key, ref.Env, fix)
		}
	}
	return nil
}

// eventTarget is what an Event about a pod under admission regards: the pod
// itself when it has a name, else (a generated name is given only after
// admission) the workload that creates it, else nothing.
func eventTarget(pod *corev1.Pod, ns string) runtime.Object {
	if pod.Name != "" {
		return pod
	}
	if owner := metav1.GetControllerOf(pod); owner != nil {
		return &corev1.ObjectReference{APIVersion: owner.APIVersion, Kind: owner.Kind, Name: owner.Name, UID: owner.UID, Namespace: ns}
	}
	return nil
}

// Handler returns the admission handler to register at Path.
func (i *Injector) Handler(scheme *runtime.Scheme) http.Handler {
	return admission.WithDefaulter[*corev1.Pod](scheme, i)
}
