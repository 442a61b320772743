// Package controllers holds the IdempotencyPolicy reconciler: it compiles
// each policy, provisions the Redis it asks for, and reports what a person
// needs to know in the policy's status.
package controllers

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/bounded"
	"github.com/idemcp/idemcp/internal/credentials"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/tracing"
)

// FieldManager is the server-side apply field manager of the status the
// reconciler writes (observedGeneration, StoreReady, Ready, store,
// policyHash). The policy stream writes sidecars and SidecarsSynced under
// its own manager.
const FieldManager = "idemcp-controller"

// secretRecheck is how soon a policy whose Secret is missing, or not opted
// in, looks again. Labelled Secrets are watched, so this is a backstop.
const secretRecheck = 10 * time.Second

// IdempotencyPolicyReconciler reconciles IdempotencyPolicy objects.
type IdempotencyPolicyReconciler struct {
	client.Client
	// APIReader reads Secrets and the owners of pods straight from the API
	// server: the manager caches neither.
	APIReader client.Reader
	Scheme    *runtime.Scheme
	Recorder  events.EventRecorder
	// RedisImage runs a new managed Redis whose policy names no image.
	RedisImage string
	// SecretRecheck is how soon a policy whose Secret is missing looks
	// again (default 10s).
	SecretRecheck time.Duration
	// SidecarsUnobserved is set when the manager runs no policy stream:
	// the reconciler then writes status.sidecars and SidecarsSynced
	// (UnobservedSidecars), which the stream writes otherwise.
	SidecarsUnobserved bool
}

// +kubebuilder:rbac:groups=idemcp.io,resources=idempotencypolicies,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=idemcp.io,resources=idempotencypolicies/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=idemcp.io,resources=idempotencypolicies/finalizers,verbs=update
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;list;watch;create;patch
// +kubebuilder:rbac:groups="",resources=services,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims,verbs=get
// +kubebuilder:rbac:groups=apps,resources=statefulsets,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;delete
// +kubebuilder:rbac:groups=apps,resources=replicasets,verbs=get
// +kubebuilder:rbac:groups=batch,resources=jobs,verbs=get
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=networking.k8s.io,resources=networkpolicies,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile brings one policy's children and status in line with its spec.
func (r *IdempotencyPolicyReconciler) Reconcile(ctx context.Context, req ctrl.Request) (_ ctrl.Result, err error) {
	// A span per reconcile (the manager's --tracing sets the provider;
	// otherwise it is the no-op one).
	ctx, span := otel.Tracer(tracing.ScopeName).Start(ctx, "reconcile IdempotencyPolicy",
		trace.WithAttributes(attribute.String("k8s.namespace.name", req.Namespace), tracing.PolicyName.String(req.Name)))
	defer func() {
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()
	var p v1alpha1.IdempotencyPolicy
	if err := r.Get(ctx, req.NamespacedName, &p); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	logger := log.FromContext(ctx).WithValues("policy", klog.KObj(&p))
	ctx = log.IntoContext(ctx, logger)

	pods, err := r.listPolicyPods(ctx, &p)
	if err != nil {
		return ctrl.Result{}, err
	}
	if !p.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, r.finalize(ctx, &p, pods)
	}
	if !controllerutil.ContainsFinalizer(&p, v1alpha1.FinalizerInUse) {
		before := p.DeepCopy()
		controllerutil.AddFinalizer(&p, v1alpha1.FinalizerInUse)
		if err := r.Patch(ctx, &p, client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{})); err != nil {
			return ctrl.Result{}, fmt.Errorf("adding the finalizer to %s: %w", klog.KObj(&p), err)
		}
	}

	// What the sidecars do with keys without a key space does not wait
	// for a valid spec: the pods' keys are what they are.
	st := ownedStatus{ObservedGeneration: p.Generation, LegacyKeys: p.Status.LegacyKeys}
	if w := legacyWriters(pods); w > 0 {
		st.LegacyKeys = &v1alpha1.LegacyKeysStatus{Writers: w}
	}
	compiled, err := policy.Compile(p.Spec)
	if err != nil {
		// Nothing of the previous generation stays: no hash, no store.
		st.setStore(&p, metav1.ConditionUnknown, v1alpha1.ReasonInvalidSpec, "the spec does not compile: "+err.Error())
		return ctrl.Result{}, r.writeStatus(ctx, &p, st)
	}
	st.PolicyHash = compiled.Hash
	now := time.Now()
	st.LegacyKeys = nextLegacyKeys(p.Status.LegacyKeys, legacyWriters(pods), staleWriters(pods), legacyRetention(compiled), now)
	if l := st.LegacyKeys; l != nil && l.Until != nil && (p.Status.LegacyKeys == nil || p.Status.LegacyKeys.Until == nil) {
		logger.Info("No pod without a key space is left; sidecars use their key spaces, and look under the keys without one until the policy's records have expired", "until", l.Until.UTC())
	}

	store, requeue, err := r.reconcileStore(ctx, &p, pods)
	var conflict *conflictError
	switch {
	case errors.As(err, &conflict):
		store = storeState{status: metav1.ConditionFalse, reason: v1alpha1.ReasonRedisObjectConflict, message: conflict.Error()}
		requeue, err = r.recheck(), nil
	case err != nil:
		store = storeState{status: metav1.ConditionFalse, reason: v1alpha1.ReasonProvisioningFailed, message: err.Error()}
	}
	if err == nil {
		var sealRequeue time.Duration
		sealRequeue, err = r.reconcileSealKey(ctx, &p, compiled, pods)
		if errors.As(err, &conflict) {
			store = storeState{status: metav1.ConditionFalse, reason: v1alpha1.ReasonRedisObjectConflict, message: conflict.Error()}
			sealRequeue, err = r.recheck(), nil
		} else if err != nil {
			store = storeState{status: metav1.ConditionFalse, reason: v1alpha1.ReasonProvisioningFailed, message: err.Error()}
		}
		if sealRequeue > 0 && (requeue == 0 || sealRequeue < requeue) {
			requeue = sealRequeue
		}
	}
	st.setStore(&p, store.status, store.reason, store.message)
	if store.endpoint != "" || store.image != "" {
		st.Store = &v1alpha1.StoreStatus{Endpoint: store.endpoint, Image: store.image}
	}
	r.warnOnChange(&p, store)
	if d := legacyRequeue(st.LegacyKeys, now); d > 0 && (requeue == 0 || d < requeue) {
		requeue = d
	}
	if r.SidecarsUnobserved {
		err = errors.Join(err, r.writeUnobservedSidecars(ctx, &p, compiled.Hash, pods))
	}
	return ctrl.Result{RequeueAfter: requeue}, errors.Join(err, r.writeStatus(ctx, &p, st))
}

// finalize holds a policy being deleted while any pod uses it: its Redis
// must outlive the sidecars that store claims in it.
func (r *IdempotencyPolicyReconciler) finalize(ctx context.Context, p *v1alpha1.IdempotencyPolicy, pods *policyPods) error {
	if !controllerutil.ContainsFinalizer(p, v1alpha1.FinalizerInUse) {
		return nil
	}
	if n := len(pods.live); n > 0 {
		names := make([]string, 0, n)
		for _, pod := range pods.live {
			names = append(names, pod.Name)
		}
		slices.Sort(names)
		st := ownedStatus{ObservedGeneration: p.Generation, PolicyHash: p.Status.PolicyHash, Store: p.Status.Store, LegacyKeys: p.Status.LegacyKeys}
		if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady); c != nil {
			st.Conditions = append(st.Conditions, *c)
		}
		st.deleting = fmt.Sprintf("the policy is being deleted, and waits until no pod uses it: %s still do, in workloads %s; its store (%s) stays until then, whatever the deletion's propagation; delete or change them, and the policy and its store go",
			bounded.Count(n, "pod", "pods", names), bounded.List(pods.names()), heldObjects(p))
		if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady); c == nil || c.Reason != v1alpha1.ReasonPolicyInUse || c.Message != bounded.Message(st.deleting) {
			r.Recorder.Eventf(p, nil, corev1.EventTypeNormal, v1alpha1.ReasonPolicyInUse, "Delete", "%s",
				bounded.Note(fmt.Sprintf("Deletion waits for %s that use this policy; its store stays until they are gone", bounded.Count(n, "pod", "pods", names))))
		}
		return r.writeStatus(ctx, p, st)
	}
	// The managed objects are held by a second owner (holdByNamespace), so
	// no propagation policy deletes them while pods need them: they go
	// here, once none does.
	if err := errors.Join(r.removeManagedRedis(ctx, p), r.releaseSecret(ctx, p, SealName(p.Name))); err != nil {
		return err
	}
	before := p.DeepCopy()
	controllerutil.RemoveFinalizer(p, v1alpha1.FinalizerInUse)
	if err := r.Patch(ctx, p, client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{})); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("removing the finalizer of %s: %w", klog.KObj(p), err)
	}
	return nil
}

// storeState is what the store part of the status should say.
type storeState struct {
	status   metav1.ConditionStatus
	reason   string
	message  string
	endpoint string
	image    string
}

func (r *IdempotencyPolicyReconciler) reconcileStore(ctx context.Context, p *v1alpha1.IdempotencyPolicy, pods *policyPods) (storeState, time.Duration, error) {
	redis := p.Spec.Store.Redis
	managed := p.Spec.Store.Type == v1alpha1.StoreRedis && redis != nil && redis.Managed != nil
	if !managed {
		if err := r.removeManagedRedis(ctx, p); err != nil {
			return storeState{}, 0, err
		}
	}
	var (
		st      storeState
		requeue time.Duration
		err     error
	)
	switch {
	case managed:
		st, requeue, err = r.reconcileManagedRedis(ctx, p, pods)
	case p.Spec.Store.Type == v1alpha1.StoreRedis && redis != nil && redis.External != nil:
		st, requeue, err = r.reconcileExternalRedis(ctx, p)
	case p.Spec.Store.Type == v1alpha1.StorePostgres && p.Spec.Store.Postgres != nil:
		st, requeue, err = r.reconcilePostgres(ctx, p)
	default:
		return memoryState(pods), 0, nil
	}
	if err == nil && st.status == metav1.ConditionTrue {
		if ws := pods.sharingKeys(); len(ws) > 1 {
			st.reason = v1alpha1.ReasonStoreSharedByWorkloads
			st.message = fmt.Sprintf("pods of %d workloads use this policy with its one key space (%s): they were injected by an idemcp whose sidecars had no key space of their own, so these servers may replay each other's results for the same tool and arguments; restart them (kubectl rollout restart) and each workload gets its own",
				len(ws), bounded.List(ws))
		}
	}
	return st, requeue, err
}

func memoryState(pods *policyPods) storeState {
	st := storeState{status: metav1.ConditionTrue, reason: v1alpha1.ReasonMemoryStore, endpoint: "memory",
		message: "each sidecar keeps its own records in memory"}
	if n, detail := pods.serving(); n > 1 {
		st.reason = v1alpha1.ReasonMemoryStoreShared
		st.message = fmt.Sprintf("%d replicas serve at once with the Memory store (%s): each keeps its own records, so a retry that reaches another replica runs again; use store.type: Redis to share them",
			n, bounded.List(detail))
	}
	return st
}

func (r *IdempotencyPolicyReconciler) reconcileExternalRedis(ctx context.Context, p *v1alpha1.IdempotencyPolicy) (storeState, time.Duration, error) {
	ext := p.Spec.Store.Redis.External
	addrs := strings.Join(ext.Addresses, ",")
	st := storeState{status: metav1.ConditionTrue, reason: v1alpha1.ReasonExternalRedis, endpoint: addrs, message: "sidecars connect to " + addrs}
	ref := ext.PasswordSecretRef
	if ref == nil {
		st.message += " without a password"
		return st, 0, nil
	}
	var secret corev1.Secret
	err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: p.Namespace, Name: ref.Name}, &secret)
	switch {
	case apierrors.IsNotFound(err):
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonSecretNotFound
		st.message = fmt.Sprintf("Secret %s/%s named by spec.store.redis.external.passwordSecretRef does not exist; create it with the Redis password under key %q and the label %s: \"true\"", p.Namespace, ref.Name, ref.Key, v1alpha1.LabelCredentials)
		return st, r.recheck(), nil
	case err != nil:
		return storeState{}, 0, fmt.Errorf("reading Secret %s/%s: %w", p.Namespace, ref.Name, err)
	}
	if err := credentials.Check(credentials.Ref{Field: "spec.store.redis.external.passwordSecretRef", Name: ref.Name, Key: ref.Key}, &secret); err != nil {
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonSecretNotLabelled
		st.message = err.Error() + "; until then the webhook refuses new pods of this policy"
		return st, r.recheck(), nil
	}
	if _, ok := secret.Data[ref.Key]; !ok {
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonSecretKeyMissing
		st.message = fmt.Sprintf("Secret %s/%s has no key %q (spec.store.redis.external.passwordSecretRef.key); add the Redis password under that key", p.Namespace, ref.Name, ref.Key)
		return st, r.recheck(), nil
	}
	return st, 0, nil
}

func (r *IdempotencyPolicyReconciler) recheck() time.Duration {
	if r.SecretRecheck > 0 {
		return r.SecretRecheck
	}
	return secretRecheck
}

// warningReasons are StoreReady reasons a person should act on: each is
// also a Warning event, recorded when the reason first appears.
var warningReasons = map[string]bool{
	v1alpha1.ReasonMemoryStoreShared:      true,
	v1alpha1.ReasonStoreSharedByWorkloads: true,
	v1alpha1.ReasonSecretNotFound:         true,
	v1alpha1.ReasonSecretKeyMissing:       true,
	v1alpha1.ReasonSecretNotLabelled:      true,
	v1alpha1.ReasonInvalidSecret:          true,
	v1alpha1.ReasonRedisObjectConflict:    true,
	v1alpha1.ReasonRedisPasswordReset:     true,
	v1alpha1.ReasonRedisPasswordChanged:   true,
	v1alpha1.ReasonProvisioningFailed:     true,
}

func (r *IdempotencyPolicyReconciler) warnOnChange(p *v1alpha1.IdempotencyPolicy, st storeState) {
	if !warningReasons[st.reason] {
		return
	}
	if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady); c != nil && c.Reason == st.reason && c.Status == st.status && c.Message == st.message {
		return
	}
	r.Recorder.Eventf(p, nil, corev1.EventTypeWarning, st.reason, "CheckStore", "%s", bounded.Note(st.message))
}

// ownedStatus is the part of the status the reconciler owns, written with
// server-side apply: a field it leaves out is cleared.
type ownedStatus struct {
	ObservedGeneration int64                 `json:"observedGeneration"`
	Conditions         []metav1.Condition    `json:"conditions,omitempty"`
	Store              *v1alpha1.StoreStatus `json:"store,omitempty"`
	PolicyHash         string                `json:"policyHash,omitempty"`
	// LegacyKeys is status.legacyKeys (legacykeys.go).
	LegacyKeys *v1alpha1.LegacyKeysStatus `json:"legacyKeys,omitempty"`

	// deleting, when set, is why a policy being deleted is still there.
	deleting string `json:"-"`
}

func (s *ownedStatus) setStore(p *v1alpha1.IdempotencyPolicy, status metav1.ConditionStatus, reason, msg string) {
	conds := slices.Clone(p.Status.Conditions)
	meta.SetStatusCondition(&conds, metav1.Condition{Type: v1alpha1.ConditionStoreReady, Status: status, Reason: reason, Message: msg, ObservedGeneration: p.Generation})
	s.Conditions = []metav1.Condition{*meta.FindStatusCondition(conds, v1alpha1.ConditionStoreReady)}
}

// Ready sums the other conditions up, and nothing else: the store's
// (written here) and the sidecars' (written by the policy stream), so both
// writers agree on it. A SidecarsSynced of an older generation says what
// the sidecars enforced before the last spec edit, not now: it counts as
// not observed, so kubectl wait --for=condition=Ready (or a GitOps health
// check) never passes on the previous spec's sync.
func Ready(generation int64, conds []metav1.Condition, deleting string) metav1.Condition {
	c := metav1.Condition{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonReady,
		Message: "the policy is enforced by every sidecar that uses it", ObservedGeneration: generation}
	store := meta.FindStatusCondition(conds, v1alpha1.ConditionStoreReady)
	sidecars := meta.FindStatusCondition(conds, v1alpha1.ConditionSidecarsSynced)
	switch {
	case deleting != "":
		c.Status, c.Reason, c.Message = metav1.ConditionFalse, v1alpha1.ReasonPolicyInUse, deleting
	case store != nil && store.Reason == v1alpha1.ReasonInvalidSpec:
		c.Status, c.Reason, c.Message = metav1.ConditionFalse, v1alpha1.ReasonInvalidSpec, store.Message
	case store == nil || store.Status != metav1.ConditionTrue:
		msg := "the store is not checked yet"
		if store != nil {
			msg = "the store is not ready: " + store.Message
		}
		c.Status, c.Reason, c.Message = metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady, msg
	case sidecars == nil:
		c.Status, c.Reason, c.Message = metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved, "the store is ready; what the sidecars enforce is not reported yet"
	case sidecars.ObservedGeneration < generation:
		c.Status, c.Reason = metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved
		c.Message = fmt.Sprintf("the store is ready; the sidecars have not reported generation %d of the policy yet (their last report is of generation %d)", generation, sidecars.ObservedGeneration)
	case sidecars.Status == metav1.ConditionFalse:
		c.Status, c.Reason, c.Message = metav1.ConditionFalse, v1alpha1.ReasonSidecarsNotSynced, "the sidecars are not synced: "+sidecars.Message
	case sidecars.Status != metav1.ConditionTrue:
		c.Status, c.Reason, c.Message = metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved, "the store is ready; whether the sidecars enforce this policy is not observed: "+sidecars.Message
	}
	return c
}

// writeStatus applies the owned status with server-side apply.
func (r *IdempotencyPolicyReconciler) writeStatus(ctx context.Context, p *v1alpha1.IdempotencyPolicy, st ownedStatus) error {
	conds := slices.Clone(p.Status.Conditions)
	for _, c := range st.Conditions {
		meta.SetStatusCondition(&conds, c)
	}
	meta.SetStatusCondition(&conds, Ready(p.Generation, conds, st.deleting))
	st.Conditions = append(st.Conditions, *meta.FindStatusCondition(conds, v1alpha1.ConditionReady))
	for i := range st.Conditions {
		// The backstop: a message the API server refuses would freeze the
		// whole status, observedGeneration included.
		st.Conditions[i].Message = bounded.Message(st.Conditions[i].Message)
	}

	status, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&st)
	if err != nil {
		return err
	}
	u := &unstructured.Unstructured{Object: map[string]any{"status": status}}
	u.SetGroupVersionKind(v1alpha1.GroupVersion.WithKind("IdempotencyPolicy"))
	u.SetNamespace(p.Namespace)
	u.SetName(p.Name)
	err = r.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner(FieldManager), client.ForceOwnership)
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("applying the status of %s: %w", klog.KObj(p), err)
	}
	return nil
}

// conflictError is an object idemcp would create that exists and is not
// its own.
type conflictError struct{ kind, namespace, name, owner string }

func (e *conflictError) Error() string {
	owner := "it has no controller"
	if e.owner != "" {
		owner = "it is controlled by " + e.owner
	}
	return fmt.Sprintf("%s %s/%s exists and is not owned by this policy (%s); idemcp never adopts objects it did not create: delete or rename it, or rename the policy",
		e.kind, e.namespace, e.name, owner)
}

func newConflict(kind string, obj client.Object) *conflictError {
	e := &conflictError{kind: kind, namespace: obj.GetNamespace(), name: obj.GetName()}
	if ref := metav1.GetControllerOf(obj); ref != nil {
		e.owner = ref.Kind + "/" + ref.Name
	}
	return e
}

func kindOf(obj client.Object) string {
	k := fmt.Sprintf("%T", obj)
	return k[strings.LastIndex(k, ".")+1:]
}

// ensure creates or updates a child owned by the policy. It adopts one
// that is the policy's by managedFor but lost its controller reference (a
// policy of this name deleted without its finalizer: the namespace, its
// other owner, kept it), refuses any other existing object the policy
// does not control, and records an event when it creates, adopts or
// changes one.
func (r *IdempotencyPolicyReconciler) ensure(ctx context.Context, p *v1alpha1.IdempotencyPolicy, obj client.Object, mutate func()) error {
	kind := kindOf(obj)
	key := client.ObjectKeyFromObject(obj)
	err := r.Get(ctx, key, obj)
	switch {
	case apierrors.IsNotFound(err):
		mutate()
		if err := controllerutil.SetControllerReference(p, obj, r.Scheme); err != nil {
			return err
		}
		err := r.Create(ctx, obj)
		if apierrors.IsAlreadyExists(err) {
			// Either not in the cache yet, or not labelled as idemcp's
			// (the cache holds only those): ask the API server whose it is.
			live := obj.DeepCopyObject().(client.Object)
			if err := r.APIReader.Get(ctx, key, live); err != nil {
				return fmt.Errorf("reading %s %s: %w", kind, key, err)
			}
			switch {
			case metav1.IsControlledBy(live, p):
				return nil
			case managedFor(live, p):
				// Adopted once the cache has it.
				return fmt.Errorf("%s %s exists, left by an earlier policy %s, and is not in the cache yet", kind, key, p.Name)
			}
			return newConflict(kind, live)
		}
		if err != nil {
			return fmt.Errorf("creating %s %s: %w", kind, key, err)
		}
		log.FromContext(ctx).Info("Created managed Redis object", "kind", kind, "name", obj.GetName())
		r.Recorder.Eventf(p, obj, corev1.EventTypeNormal, "Created", "Provision", "Created %s %s", kind, obj.GetName())
		return nil
	case err != nil:
		return fmt.Errorf("reading %s %s: %w", kind, key, err)
	}
	before := obj.DeepCopyObject()
	adopted := false
	if !metav1.IsControlledBy(obj, p) {
		if !managedFor(obj, p) {
			return newConflict(kind, obj)
		}
		// Names are unique: a controller reference to a policy of this
		// name with another UID is to one that is gone.
		var refs []metav1.OwnerReference
		for _, ref := range obj.GetOwnerReferences() {
			if ref.Controller == nil || !*ref.Controller {
				refs = append(refs, ref)
			}
		}
		obj.SetOwnerReferences(refs)
		if err := controllerutil.SetControllerReference(p, obj, r.Scheme); err != nil {
			return err
		}
		adopted = true
	}
	mutate()
	if equalObjects(before, obj) {
		return nil
	}
	if err := r.Update(ctx, obj); err != nil {
		return fmt.Errorf("updating %s %s: %w", kind, key, err)
	}
	if adopted {
		log.FromContext(ctx).Info("Adopted managed Redis object", "kind", kind, "name", obj.GetName())
		r.Recorder.Eventf(p, obj, corev1.EventTypeNormal, "Adopted", "Provision", "Adopted %s %s, left by an earlier policy %s (deleted without its finalizer)", kind, obj.GetName(), p.Name)
		return nil
	}
	r.Recorder.Eventf(p, obj, corev1.EventTypeNormal, "Updated", "Provision", "Updated %s %s", kind, obj.GetName())
	return nil
}

// deleteOwned deletes obj if it is the policy's (managedFor).
func (r *IdempotencyPolicyReconciler) deleteOwned(ctx context.Context, p *v1alpha1.IdempotencyPolicy, obj client.Object) error {
	if err := r.Get(ctx, client.ObjectKeyFromObject(obj), obj); err != nil {
		return client.IgnoreNotFound(err)
	}
	if !managedFor(obj, p) {
		return nil
	}
	if err := r.Delete(ctx, obj, client.PropagationPolicy(metav1.DeletePropagationBackground)); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting %s %s: %w", kindOf(obj), obj.GetName(), err)
	}
	r.Recorder.Eventf(p, obj, corev1.EventTypeNormal, "Deleted", "Provision", "Deleted %s %s", kindOf(obj), obj.GetName())
	return nil
}

// removeManagedRedis cleans up after a policy that no longer asks for a
// managed Redis. The Secret stays (owned by the policy, gone with it) so
// switching back reuses the password, but no longer holds a finalizer.
func (r *IdempotencyPolicyReconciler) removeManagedRedis(ctx context.Context, p *v1alpha1.IdempotencyPolicy) error {
	meta := metav1.ObjectMeta{Name: RedisName(p.Name), Namespace: p.Namespace}
	for _, obj := range []client.Object{
		&appsv1.StatefulSet{ObjectMeta: meta}, &appsv1.Deployment{ObjectMeta: meta}, &corev1.Service{ObjectMeta: meta},
		&policyv1.PodDisruptionBudget{ObjectMeta: meta}, &networkingv1.NetworkPolicy{ObjectMeta: meta},
	} {
		if err := r.deleteOwned(ctx, p, obj); err != nil {
			return err
		}
	}
	return r.releaseRedisSecret(ctx, p)
}

// SetupWithManager registers the reconciler: it owns the managed Redis
// objects, and watches the pods that use a policy and the Secrets opted in
// to idemcp (metadata only).
func (r *IdempotencyPolicyReconciler) SetupWithManager(mgr ctrl.Manager) error {
	secrets := &metav1.PartialObjectMetadata{}
	secrets.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Secret"))
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1alpha1.IdempotencyPolicy{}, builder.WithPredicates(predicate.Or[client.Object](
			predicate.GenerationChangedPredicate{}, deletionOrSidecarsChanged{}))).
		Owns(&appsv1.StatefulSet{}).
		Owns(&appsv1.Deployment{}).
		Owns(&corev1.Service{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		Owns(&networkingv1.NetworkPolicy{}).
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(podToPolicy),
			builder.WithPredicates(predicate.NewPredicateFuncs(func(o client.Object) bool {
				_, ok := o.GetLabels()[v1alpha1.LabelPolicy]
				return ok
			}))).
		WatchesMetadata(secrets, handler.EnqueueRequestsFromMapFunc(r.secretToPolicies)).
		Named("idempotencypolicy").
		Complete(r)
}

// deletionOrSidecarsChanged lets through the policy updates that change
// no generation but change the status: a deletion, or SidecarsSynced
// (written by the policy stream), on which Ready depends, including its
// observedGeneration alone (the same "3/3 synced", now of the new spec).
type deletionOrSidecarsChanged struct{ predicate.Funcs }

func (deletionOrSidecarsChanged) Update(e event.UpdateEvent) bool {
	o, ok1 := e.ObjectOld.(*v1alpha1.IdempotencyPolicy)
	n, ok2 := e.ObjectNew.(*v1alpha1.IdempotencyPolicy)
	if !ok1 || !ok2 {
		return false
	}
	if o.DeletionTimestamp.IsZero() != n.DeletionTimestamp.IsZero() || len(o.Finalizers) != len(n.Finalizers) {
		return true
	}
	oc := meta.FindStatusCondition(o.Status.Conditions, v1alpha1.ConditionSidecarsSynced)
	nc := meta.FindStatusCondition(n.Status.Conditions, v1alpha1.ConditionSidecarsSynced)
	return (oc == nil) != (nc == nil) || (oc != nil && (oc.Status != nc.Status || oc.Reason != nc.Reason || oc.Message != nc.Message || oc.ObservedGeneration != nc.ObservedGeneration))
}

func podToPolicy(_ context.Context, o client.Object) []reconcile.Request {
	name := o.GetLabels()[v1alpha1.LabelPolicy]
	if name == "" {
		return nil
	}
	return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: name}}}
}

// secretToPolicies maps a Secret to the policies of its namespace that
// use it (credentials.Refs) or make it.
func (r *IdempotencyPolicyReconciler) secretToPolicies(ctx context.Context, o client.Object) []reconcile.Request {
	var list v1alpha1.IdempotencyPolicyList
	if err := r.List(ctx, &list, client.InNamespace(o.GetNamespace())); err != nil {
		log.FromContext(ctx).Error(err, "Listing policies for a Secret", "secret", klog.KObj(o))
		return nil
	}
	var out []reconcile.Request
	for i := range list.Items {
		p := &list.Items[i]
		names := []string{RedisName(p.Name), SealName(p.Name)}
		for _, ref := range credentials.Refs(p) {
			names = append(names, ref.Name)
		}
		if slices.Contains(names, o.GetName()) {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(p)})
		}
	}
	return out
}
