// Package controllers holds the IdempotencyPolicy reconciler: it compiles
// each policy, provisions the Redis it asks for, and reports what a person
// needs to know in the policy's status.
package controllers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/sidecar/policy"
)

// secretRecheck is how soon a policy whose Secret is missing looks again:
// Secrets are not watched, so the controller needs no list/watch on them.
const secretRecheck = 10 * time.Second

// IdempotencyPolicyReconciler reconciles IdempotencyPolicy objects.
type IdempotencyPolicyReconciler struct {
	client.Client
	// APIReader reads Secrets straight from the API server: the manager
	// caches no Secrets (it may only get and create them).
	APIReader client.Reader
	Scheme    *runtime.Scheme
	Recorder  events.EventRecorder
	// RedisImage runs a managed Redis whose policy names no image.
	RedisImage string
	// SecretRecheck is how soon a policy whose Secret is missing looks
	// again (default 10s).
	SecretRecheck time.Duration
}

// +kubebuilder:rbac:groups=idemcp.io,resources=idempotencypolicies,verbs=get;list;watch
// +kubebuilder:rbac:groups=idemcp.io,resources=idempotencypolicies/status,verbs=get;update;patch
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;create
// +kubebuilder:rbac:groups="",resources=services,verbs=get;list;watch;create;update;patch
// +kubebuilder:rbac:groups=apps,resources=deployments;statefulsets,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Reconcile brings one policy's children and status in line with its spec.
func (r *IdempotencyPolicyReconciler) Reconcile(ctx context.Context, req ctrl.Request) (result ctrl.Result, retErr error) {
	var p v1alpha1.IdempotencyPolicy
	if err := r.Get(ctx, req.NamespacedName, &p); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	logger := log.FromContext(ctx).WithValues("policy", klog.KObj(&p))
	ctx = log.IntoContext(ctx, logger)

	before := p.DeepCopy()
	defer func() {
		p.Status.ObservedGeneration = p.Generation
		if err := r.Status().Patch(ctx, &p, client.MergeFrom(before)); err != nil && !apierrors.IsNotFound(err) {
			retErr = errors.Join(retErr, fmt.Errorf("patching status of %s: %w", klog.KObj(&p), err))
		}
	}()

	compiled, err := policy.Compile(p.Spec)
	if err != nil {
		r.setCondition(&p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonInvalidSpec, err.Error())
		return ctrl.Result{}, nil
	}
	p.Status.PolicyHash = compiled.Hash

	store, requeue, err := r.reconcileStore(ctx, &p)
	if err != nil {
		r.setCondition(&p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonProvisioningFailed, err.Error())
		r.setCondition(&p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady, "the store is not ready: "+err.Error())
		return ctrl.Result{}, err
	}
	r.setCondition(&p, v1alpha1.ConditionStoreReady, store.status, store.reason, store.message)
	p.Status.Store = &v1alpha1.StoreStatus{Endpoint: store.endpoint}
	if store.status == metav1.ConditionTrue {
		r.setCondition(&p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonReady, "the policy is enforced by every sidecar that uses it")
	} else {
		r.setCondition(&p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady, "the store is not ready: "+store.message)
	}
	return ctrl.Result{RequeueAfter: requeue}, nil
}

func (r *IdempotencyPolicyReconciler) setCondition(p *v1alpha1.IdempotencyPolicy, typ string, status metav1.ConditionStatus, reason, msg string) {
	meta.SetStatusCondition(&p.Status.Conditions, metav1.Condition{
		Type: typ, Status: status, Reason: reason, Message: msg, ObservedGeneration: p.Generation,
	})
}

// storeState is what the store part of the status should say.
type storeState struct {
	status   metav1.ConditionStatus
	reason   string
	message  string
	endpoint string
}

func (r *IdempotencyPolicyReconciler) reconcileStore(ctx context.Context, p *v1alpha1.IdempotencyPolicy) (storeState, time.Duration, error) {
	switch {
	case p.Spec.Store.Type == v1alpha1.StoreRedis && p.Spec.Store.Redis != nil && p.Spec.Store.Redis.Managed != nil:
		return r.reconcileManagedRedis(ctx, p)
	case p.Spec.Store.Type == v1alpha1.StoreRedis && p.Spec.Store.Redis != nil && p.Spec.Store.Redis.External != nil:
		return r.reconcileExternalRedis(ctx, p)
	default:
		return r.reconcileMemory(ctx, p)
	}
}

func (r *IdempotencyPolicyReconciler) reconcileMemory(ctx context.Context, p *v1alpha1.IdempotencyPolicy) (storeState, time.Duration, error) {
	st := storeState{status: metav1.ConditionTrue, reason: v1alpha1.ReasonMemoryStore, endpoint: "memory",
		message: "each sidecar keeps its own records in memory"}
	var pods corev1.PodList
	if err := r.List(ctx, &pods, client.InNamespace(p.Namespace), client.MatchingLabels{v1alpha1.LabelPolicy: p.Name}); err != nil {
		return st, 0, fmt.Errorf("listing pods of %s: %w", klog.KObj(p), err)
	}
	n := 0
	for i := range pods.Items {
		if pods.Items[i].DeletionTimestamp == nil && pods.Items[i].Status.Phase != corev1.PodSucceeded && pods.Items[i].Status.Phase != corev1.PodFailed {
			n++
		}
	}
	if n > 1 {
		st.reason = v1alpha1.ReasonMemoryStoreShared
		st.message = fmt.Sprintf("%d pods use this policy with the Memory store: each keeps its own records, so a retry that reaches another replica runs again; use store.type: Redis to share them", n)
		if !meta.IsStatusConditionPresentAndEqual(p.Status.Conditions, v1alpha1.ConditionStoreReady, metav1.ConditionTrue) ||
			meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady).Reason != v1alpha1.ReasonMemoryStoreShared {
			r.Recorder.Eventf(p, nil, corev1.EventTypeWarning, v1alpha1.ReasonMemoryStoreShared, "CheckStore", st.message)
		}
	}
	return st, 0, nil
}

func (r *IdempotencyPolicyReconciler) reconcileExternalRedis(ctx context.Context, p *v1alpha1.IdempotencyPolicy) (storeState, time.Duration, error) {
	ext := p.Spec.Store.Redis.External
	st := storeState{status: metav1.ConditionTrue, reason: v1alpha1.ReasonExternalRedis,
		endpoint: strings.Join(ext.Addresses, ","), message: "sidecars connect to " + strings.Join(ext.Addresses, ",")}
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
		st.message = fmt.Sprintf("Secret %s/%s named by spec.store.redis.external.passwordSecretRef does not exist; create it with the Redis password under key %q", p.Namespace, ref.Name, ref.Key)
		r.warnOnce(p, st)
		return st, r.recheck(), nil
	case err != nil:
		return st, 0, fmt.Errorf("reading Secret %s/%s: %w", p.Namespace, ref.Name, err)
	}
	if _, ok := secret.Data[ref.Key]; !ok {
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonSecretKeyMissing
		st.message = fmt.Sprintf("Secret %s/%s has no key %q (spec.store.redis.external.passwordSecretRef.key); add the Redis password under that key", p.Namespace, ref.Name, ref.Key)
		r.warnOnce(p, st)
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

// warnOnce records a Warning event when the store condition changes to st.
func (r *IdempotencyPolicyReconciler) warnOnce(p *v1alpha1.IdempotencyPolicy, st storeState) {
	if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady); c != nil && c.Reason == st.reason && c.Status == st.status {
		return
	}
	r.Recorder.Eventf(p, nil, corev1.EventTypeWarning, st.reason, "CheckStore", st.message)
}

func (r *IdempotencyPolicyReconciler) reconcileManagedRedis(ctx context.Context, p *v1alpha1.IdempotencyPolicy) (storeState, time.Duration, error) {
	name := RedisName(p.Name)
	if err := r.ensureRedisSecret(ctx, p); err != nil {
		return storeState{}, 0, err
	}
	image := r.RedisImage
	if image == "" {
		image = DefaultRedisImage
	}
	var available bool
	if p.Spec.Store.Redis.Managed.Storage != nil {
		sts := &appsv1.StatefulSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: p.Namespace}}
		if err := r.apply(ctx, p, sts, func() { mutateRedisStatefulSet(sts, p, image) }); err != nil {
			return storeState{}, 0, err
		}
		if err := r.deleteOwned(ctx, p, &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: p.Namespace}}); err != nil {
			return storeState{}, 0, err
		}
		available = sts.Status.AvailableReplicas > 0 && sts.Status.ObservedGeneration >= sts.Generation
	} else {
		dep := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: p.Namespace}}
		if err := r.apply(ctx, p, dep, func() { mutateRedisDeployment(dep, p, image) }); err != nil {
			return storeState{}, 0, err
		}
		if err := r.deleteOwned(ctx, p, &appsv1.StatefulSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: p.Namespace}}); err != nil {
			return storeState{}, 0, err
		}
		available = dep.Status.AvailableReplicas > 0
	}
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: p.Namespace}}
	if err := r.apply(ctx, p, svc, func() { mutateRedisService(svc, p) }); err != nil {
		return storeState{}, 0, err
	}
	st := storeState{endpoint: RedisEndpoint(p)}
	if available {
		st.status, st.reason, st.message = metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable, "managed Redis "+name+" is available at "+st.endpoint
		if p.Spec.Store.Redis.Managed.Storage == nil {
			st.message += "; it has no persistent volume, so a restart of its pod loses stored results and claims in flight: set store.redis.managed.storage to keep them"
		}
	} else {
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonRedisProvisioning
		st.message = fmt.Sprintf("managed Redis %s has no available replica yet; see kubectl -n %s describe pods -l app.kubernetes.io/instance=%s", name, p.Namespace, name)
	}
	return st, 0, nil
}

// ensureRedisSecret creates the managed Redis's password once. It is never
// updated: a new password would lock out every running sidecar.
func (r *IdempotencyPolicyReconciler) ensureRedisSecret(ctx context.Context, p *v1alpha1.IdempotencyPolicy) error {
	name := RedisName(p.Name)
	var existing corev1.Secret
	err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: p.Namespace, Name: name}, &existing)
	if err == nil {
		if !metav1.IsControlledBy(&existing, p) {
			return fmt.Errorf("secret %s/%s exists and is not owned by this policy; delete or rename it so idemcp can create the Redis password", p.Namespace, name)
		}
		return nil
	}
	if !apierrors.IsNotFound(err) {
		return fmt.Errorf("reading Secret %s/%s: %w", p.Namespace, name, err)
	}
	password, err := newRedisPassword()
	if err != nil {
		return fmt.Errorf("generating the Redis password: %w", err)
	}
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: p.Namespace, Labels: redisLabels(p)},
		Type:       corev1.SecretTypeOpaque,
		Data:       redisSecretData(password),
	}
	if err := controllerutil.SetControllerReference(p, secret, r.Scheme); err != nil {
		return err
	}
	if err := r.Create(ctx, secret); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating Secret %s/%s: %w", p.Namespace, name, err)
	}
	r.Recorder.Eventf(p, secret, corev1.EventTypeNormal, "Created", "Provision", "Created Secret %s with the Redis password", name)
	return nil
}

// apply creates or updates a child owned by the policy, and records an
// event when it had to create one.
func (r *IdempotencyPolicyReconciler) apply(ctx context.Context, p *v1alpha1.IdempotencyPolicy, obj client.Object, mutate func()) error {
	op, err := controllerutil.CreateOrUpdate(ctx, r.Client, obj, func() error {
		mutate()
		return controllerutil.SetControllerReference(p, obj, r.Scheme)
	})
	kind := fmt.Sprintf("%T", obj)
	kind = kind[strings.LastIndex(kind, ".")+1:]
	if err != nil {
		return fmt.Errorf("applying %s %s/%s: %w", kind, obj.GetNamespace(), obj.GetName(), err)
	}
	switch op {
	case controllerutil.OperationResultCreated:
		log.FromContext(ctx).Info("Created managed Redis object", "kind", kind, "name", obj.GetName())
		r.Recorder.Eventf(p, obj, corev1.EventTypeNormal, "Created", "Provision", "Created %s %s", kind, obj.GetName())
	case controllerutil.OperationResultUpdated:
		r.Recorder.Eventf(p, obj, corev1.EventTypeNormal, "Updated", "Provision", "Updated %s %s", kind, obj.GetName())
	}
	return nil
}

func (r *IdempotencyPolicyReconciler) deleteOwned(ctx context.Context, p *v1alpha1.IdempotencyPolicy, obj client.Object) error {
	if err := r.Get(ctx, client.ObjectKeyFromObject(obj), obj); err != nil {
		return client.IgnoreNotFound(err)
	}
	if !metav1.IsControlledBy(obj, p) {
		return nil
	}
	if err := r.Delete(ctx, obj); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting %s: %w", obj.GetName(), err)
	}
	return nil
}

// SetupWithManager registers the reconciler: it owns the managed Redis
// objects and watches the pods that use a policy.
func (r *IdempotencyPolicyReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1alpha1.IdempotencyPolicy{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Owns(&appsv1.Deployment{}).
		Owns(&appsv1.StatefulSet{}).
		Owns(&corev1.Service{}).
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(podToPolicy),
			builder.WithPredicates(predicate.NewPredicateFuncs(func(o client.Object) bool {
				_, ok := o.GetLabels()[v1alpha1.LabelPolicy]
				return ok
			}))).
		Named("idempotencypolicy").
		Complete(r)
}

func podToPolicy(_ context.Context, o client.Object) []reconcile.Request {
	name := o.GetLabels()[v1alpha1.LabelPolicy]
	if name == "" {
		return nil
	}
	return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: name}}}
}
