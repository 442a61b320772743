package controllers

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/bounded"
)

// annotationPasswordReset on the managed Secret records when a lost
// Secret was replaced by one with a new password: pods created before
// then hold the old one.
const annotationPasswordReset = "idemcp.io/password-reset-at"

// annotationPasswordHash on the managed Secret is a short hash of the
// password it was last seen with: a different one was written by hand,
// and the pods created before then hold the old one.
// annotationPasswordResetCause says why the password changed: lost (the
// Secret was recreated), edited, or missing (its key was removed).
const (
	annotationPasswordHash       = "idemcp.io/password-hash"
	annotationPasswordResetCause = "idemcp.io/password-reset-cause"
	resetLost                    = "lost"
	resetEdited                  = "edited"
	resetMissing                 = "missing"
)

// ReasonRedisSecretRepaired is the Event of a managed Redis Secret whose
// keys were put back.
const ReasonRedisSecretRepaired = "RedisSecretRepaired"

// replacingRecheck is how often a policy whose old Redis is shutting down
// looks again.
const replacingRecheck = 2 * time.Second

func equalObjects(a, b runtime.Object) bool { return equality.Semantic.DeepEqual(a, b) }

func (r *IdempotencyPolicyReconciler) reconcileManagedRedis(ctx context.Context, p *v1alpha1.IdempotencyPolicy, pods *policyPods) (storeState, time.Duration, error) {
	m := p.Spec.Store.Redis.Managed
	name := RedisName(p.Name)
	objMeta := metav1.ObjectMeta{Name: name, Namespace: p.Namespace}
	st := storeState{endpoint: RedisEndpoint(p)}

	sts := &appsv1.StatefulSet{ObjectMeta: objMeta}
	stsExists := true
	if err := r.Get(ctx, client.ObjectKeyFromObject(sts), sts); apierrors.IsNotFound(err) {
		stsExists = false
	} else if err != nil {
		return st, 0, fmt.Errorf("reading StatefulSet %s/%s: %w", p.Namespace, name, err)
	}

	// The image: the policy's, else the one this Redis already runs, else
	// the manager's default. A manager upgrade never restarts a Redis.
	image := m.Image
	if image == "" && stsExists {
		image = containerImage(sts.Spec.Template.Spec.Containers)
	}

	// An earlier idemcp ran Redis without a volume as a Deployment: it
	// goes first, and the StatefulSet starts only once its pods are gone,
	// so two Redis never split the records.
	legacy := &appsv1.Deployment{ObjectMeta: objMeta}
	if err := r.Get(ctx, client.ObjectKeyFromObject(legacy), legacy); err == nil && metav1.IsControlledBy(legacy, p) {
		if image == "" {
			image = containerImage(legacy.Spec.Template.Spec.Containers)
		}
		if err := r.deleteOwned(ctx, p, legacy); err != nil {
			return st, 0, err
		}
	} else if err != nil && !apierrors.IsNotFound(err) {
		return st, 0, fmt.Errorf("reading Deployment %s/%s: %w", p.Namespace, name, err)
	}
	if image == "" {
		image = r.RedisImage
	}
	if image == "" {
		image = DefaultRedisImage
	}
	st.image = image
	if !stsExists {
		var old corev1.PodList
		if err := r.List(ctx, &old, client.InNamespace(p.Namespace), client.MatchingLabels(redisSelector(p))); err != nil {
			return st, 0, fmt.Errorf("listing Redis pods of %s: %w", p.Name, err)
		}
		if len(old.Items) > 0 {
			st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonRedisReplacing
			st.message = fmt.Sprintf("the earlier managed Redis (pod %s) is shutting down; the new StatefulSet %s starts once it is gone, so two never run at once", old.Items[0].Name, name)
			return st, replacingRecheck, nil
		}
		if !m.Ephemeral {
			if err := r.checkClaim(ctx, p); err != nil {
				return st, 0, err
			}
		}
	}

	secret, reset, err := r.ensureRedisSecret(ctx, p, stsExists)
	if err != nil {
		return st, 0, err
	}
	hash := configHash(secret.Data)
	hold, err := r.namespaceOwner(ctx, p.Namespace)
	if err != nil {
		return st, 0, err
	}
	if err := r.ensure(ctx, p, sts, func() {
		// The image this Redis runs is read again from the object being
		// updated: one edited since the read above (by hand, or by an
		// earlier manager) is kept, not put back to what that read said.
		if m.Image == "" {
			if running := containerImage(sts.Spec.Template.Spec.Containers); running != "" {
				image = running
			}
		}
		mutateRedisStatefulSet(sts, p, image, hash)
		holdBy(sts, hold)
	}); err != nil {
		return st, 0, err
	}
	st.image = image
	for _, child := range []struct {
		obj    client.Object
		mutate func(client.Object)
	}{
		{&corev1.Service{ObjectMeta: objMeta}, func(o client.Object) { mutateRedisService(o.(*corev1.Service), p) }},
		{&policyv1.PodDisruptionBudget{ObjectMeta: objMeta}, func(o client.Object) { mutateRedisPDB(o.(*policyv1.PodDisruptionBudget), p) }},
		{&networkingv1.NetworkPolicy{ObjectMeta: objMeta}, func(o client.Object) { mutateRedisNetworkPolicy(o.(*networkingv1.NetworkPolicy), p) }},
	} {
		if err := r.ensure(ctx, p, child.obj, func() { child.mutate(child.obj); holdBy(child.obj, hold) }); err != nil {
			return st, 0, err
		}
	}

	if stale := stalePods(pods, secret, reset); len(stale) > 0 {
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonRedisPasswordReset
		why := fmt.Sprintf("the Secret %s was deleted before idemcp protected it, so Redis restarted with a new password", name)
		switch secret.Annotations[annotationPasswordResetCause] {
		case resetEdited:
			st.reason = v1alpha1.ReasonRedisPasswordChanged
			why = fmt.Sprintf("the password in Secret %s was changed by hand, so Redis restarted with it", name)
		case resetMissing:
			why = fmt.Sprintf("the Secret %s lost its password key, so Redis restarted with a new password", name)
		}
		st.message = fmt.Sprintf("%s; %s still hold the old one in their sidecar's environment, and every store call of theirs fails: restart them (%s)",
			why, bounded.Count(len(stale), "pod", "pods", stale), restartHint(p.Namespace, pods, stale))
		return st, 0, nil
	}
	if sts.Status.ReadyReplicas > 0 && sts.Status.ObservedGeneration >= sts.Generation {
		st.status, st.reason = metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable
		st.message = fmt.Sprintf("managed Redis %s (%s, maxmemory %d bytes) is ready at %s", name, image, redisMaxMemory(redisResources(m)), st.endpoint)
		if m.Ephemeral {
			st.message += "; it keeps its data in an emptyDir (ephemeral: true), so a restart of its pod loses stored results and claims in flight"
		}
	} else {
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonRedisProvisioning
		st.message = fmt.Sprintf("managed Redis %s has no ready replica yet; see kubectl -n %s describe pods -l app.kubernetes.io/instance=%s", name, p.Namespace, name)
	}
	if !secret.DeletionTimestamp.IsZero() {
		st.message += fmt.Sprintf("; its Secret %s is being deleted and stays, with the same password, while this Redis runs (finalizer %s)", name, v1alpha1.FinalizerInUse)
	}
	return st, 0, nil
}

// namespaceOwner is the policy's namespace as an owner of the managed
// Redis's StatefulSet, Service, PodDisruptionBudget and NetworkPolicy,
// beside the policy. While an owner that is not being deleted remains, the
// garbage collector deletes nothing, whatever the propagation of the
// policy's deletion (with foreground it only removes the policy's
// reference): so the store outlives every pod that uses it, and the
// controller deletes these objects itself once none does (finalize). A
// namespace's own deletion still takes them, with its pods.
func (r *IdempotencyPolicyReconciler) namespaceOwner(ctx context.Context, ns string) (metav1.OwnerReference, error) {
	var m metav1.PartialObjectMetadata
	m.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Namespace"))
	if err := r.APIReader.Get(ctx, client.ObjectKey{Name: ns}, &m); err != nil {
		return metav1.OwnerReference{}, fmt.Errorf("reading Namespace %s: %w", ns, err)
	}
	return metav1.OwnerReference{APIVersion: "v1", Kind: "Namespace", Name: ns, UID: m.UID}, nil
}

// holdBy makes hold one of obj's owners (not its controller, and not
// blocking: the namespace never waits for it).
func holdBy(obj client.Object, hold metav1.OwnerReference) {
	var refs []metav1.OwnerReference
	for _, ref := range obj.GetOwnerReferences() {
		if ref.UID == hold.UID {
			return // no update for an object already held
		}
		if ref.Kind == "Namespace" && ref.APIVersion == "v1" {
			continue // a namespace of the same name before
		}
		refs = append(refs, ref)
	}
	obj.SetOwnerReferences(append(refs, hold))
}

// managedFor reports whether obj is the policy's own: controlled by it,
// or labelled as its and controlled by no live policy: without a
// controller (the garbage collector removes a deleted policy's reference
// while the namespace, the other owner, remains), or by an earlier policy
// of this name (names are unique in a namespace, so another UID is one
// that is gone; the garbage collector has not removed it yet).
func managedFor(obj client.Object, p *v1alpha1.IdempotencyPolicy) bool {
	if metav1.IsControlledBy(obj, p) {
		return true
	}
	l := obj.GetLabels()
	if l["app.kubernetes.io/managed-by"] != managedBy || l[v1alpha1.LabelPolicy] != p.Name || l[v1alpha1.LabelComponent] != redisComponent {
		return false
	}
	ref := metav1.GetControllerOf(obj)
	return ref == nil || (ref.Kind == "IdempotencyPolicy" && ref.APIVersion == v1alpha1.GroupVersion.String() && ref.Name == p.Name)
}

// heldObjects names what a policy being deleted keeps for its pods.
func heldObjects(p *v1alpha1.IdempotencyPolicy) string {
	if r := p.Spec.Store.Redis; p.Spec.Store.Type == v1alpha1.StoreRedis && r != nil && r.Managed != nil {
		n := RedisName(p.Name)
		return fmt.Sprintf("StatefulSet, Service, PodDisruptionBudget, NetworkPolicy and Secret %s, Secret %s", n, SealName(p.Name))
	}
	if sharedStore(p) {
		return "Secret " + SealName(p.Name)
	}
	return "each pod's memory"
}

func containerImage(cs []corev1.Container) string {
	for _, c := range cs {
		if c.Name == redisContainer {
			return c.Image
		}
	}
	return ""
}

// checkClaim refuses to start a StatefulSet whose volume claim name is
// already taken by a claim idemcp did not make: the StatefulSet would
// mount it.
func (r *IdempotencyPolicyReconciler) checkClaim(ctx context.Context, p *v1alpha1.IdempotencyPolicy) error {
	var pvc corev1.PersistentVolumeClaim
	err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: p.Namespace, Name: RedisClaimName(p.Name)}, &pvc)
	switch {
	case apierrors.IsNotFound(err):
		return nil
	case err != nil:
		return fmt.Errorf("reading PersistentVolumeClaim %s/%s: %w", p.Namespace, RedisClaimName(p.Name), err)
	}
	l := pvc.Labels
	if l["app.kubernetes.io/managed-by"] == managedBy && l[v1alpha1.LabelPolicy] == p.Name && l[v1alpha1.LabelComponent] == redisComponent {
		return nil // this policy's own, kept by an earlier StatefulSet
	}
	return newConflict("PersistentVolumeClaim", &pvc)
}

// ensureRedisSecret returns the managed Redis's Secret, creating it with a
// new password if there is none. It carries a finalizer, so deleting it
// while Redis runs leaves it in place with the same password. reset is
// true when a Secret had to be made for a Redis that already ran.
func (r *IdempotencyPolicyReconciler) ensureRedisSecret(ctx context.Context, p *v1alpha1.IdempotencyPolicy, redisRuns bool) (*corev1.Secret, bool, error) {
	name := RedisName(p.Name)
	var secret corev1.Secret
	err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: p.Namespace, Name: name}, &secret)
	if err == nil {
		before := secret.DeepCopy()
		adopted, err := r.adoptSecret(p, &secret)
		if err != nil {
			return nil, false, err
		}
		if !adopted && !metav1.IsControlledBy(&secret, p) {
			return nil, false, newConflict("Secret", &secret)
		}
		// Secrets made by an earlier idemcp lack the label (the watch sees
		// only labelled Secrets) and the finalizer.
		secret.Labels = mergeLabels(secret.Labels, map[string]string{v1alpha1.LabelCredentials: "true"})
		if secret.DeletionTimestamp.IsZero() {
			controllerutil.AddFinalizer(&secret, v1alpha1.FinalizerInUse)
		}
		repairs, err := repairRedisSecret(&secret, redisRuns, time.Now())
		if err != nil {
			return nil, false, err
		}
		if equalObjects(before, &secret) {
			return &secret, false, nil
		}
		if err := r.Patch(ctx, &secret, client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{})); err != nil {
			return nil, false, fmt.Errorf("updating Secret %s/%s: %w", p.Namespace, name, err)
		}
		for _, msg := range repairs {
			log.FromContext(ctx).Info("Repaired the managed Redis's Secret", "secret", name, "repair", msg)
			r.Recorder.Eventf(p, &secret, corev1.EventTypeWarning, ReasonRedisSecretRepaired, "Provision", "%s", msg)
		}
		return &secret, false, nil
	}
	if !apierrors.IsNotFound(err) {
		return nil, false, fmt.Errorf("reading Secret %s/%s: %w", p.Namespace, name, err)
	}
	password, err := newRedisPassword()
	if err != nil {
		return nil, false, fmt.Errorf("generating the Redis password: %w", err)
	}
	labels := redisLabels(p)
	labels[v1alpha1.LabelCredentials] = "true"
	secret = corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: p.Namespace, Labels: labels, Finalizers: []string{v1alpha1.FinalizerInUse}},
		Type:       corev1.SecretTypeOpaque,
		Data:       redisSecretData(password),
	}
	secret.Annotations = map[string]string{annotationPasswordHash: passwordHash([]byte(password))}
	if redisRuns {
		secret.Annotations[annotationPasswordReset] = time.Now().UTC().Format(time.RFC3339Nano)
		secret.Annotations[annotationPasswordResetCause] = resetLost
	}
	if err := controllerutil.SetControllerReference(p, &secret, r.Scheme); err != nil {
		return nil, false, err
	}
	if err := r.Create(ctx, &secret); err != nil {
		return nil, false, fmt.Errorf("creating Secret %s/%s: %w", p.Namespace, name, err)
	}
	if redisRuns {
		r.Recorder.Eventf(p, &secret, corev1.EventTypeWarning, v1alpha1.ReasonRedisPasswordReset, "Provision",
			"Secret %s was lost; made a new password and restarting Redis with it; pods that use this policy need a restart", name)
	} else {
		r.Recorder.Eventf(p, &secret, corev1.EventTypeNormal, "Created", "Provision", "Created Secret %s with the Redis password", name)
	}
	return &secret, redisRuns, nil
}

func passwordHash(pw []byte) string {
	sum := sha256.Sum256(pw)
	return hex.EncodeToString(sum[:8])
}

// passwordFromConf reads the requirepass line of a redis.conf idemcp wrote.
func passwordFromConf(conf []byte) string {
	for _, line := range strings.Split(string(conf), "\n") {
		if pw, ok := strings.CutPrefix(strings.TrimSpace(line), "requirepass "); ok {
			return strings.TrimSpace(pw)
		}
	}
	return ""
}

// repairRedisSecret keeps a managed Redis's Secret whole and consistent,
// in secret: the password key is the truth, and redis.conf is made from
// it. A removed password is taken back from redis.conf (Redis runs with
// it), else made anew; a password edited by hand is kept, and recorded as
// a reset, so that the pods that hold the old one are named. It returns
// what it repaired, for Events.
func repairRedisSecret(secret *corev1.Secret, redisRuns bool, now time.Time) ([]string, error) {
	if secret.Data == nil {
		secret.Data = map[string][]byte{}
	}
	if secret.Annotations == nil {
		secret.Annotations = map[string]string{}
	}
	var repairs []string
	cause := ""
	pw := secret.Data[redisPasswordKey]
	if len(pw) == 0 {
		if old := passwordFromConf(secret.Data[redisConfigKey]); old != "" {
			pw = []byte(old)
			repairs = append(repairs, fmt.Sprintf("Secret %s had no key %q; put it back with the password of its %s, which Redis runs with", secret.Name, redisPasswordKey, redisConfigKey))
		} else {
			fresh, err := newRedisPassword()
			if err != nil {
				return nil, fmt.Errorf("generating the Redis password: %w", err)
			}
			pw = []byte(fresh)
			repairs = append(repairs, fmt.Sprintf("Secret %s had no key %q and no usable %s; made a new password, and Redis restarts with it; pods that use this policy need a restart", secret.Name, redisPasswordKey, redisConfigKey))
			if redisRuns {
				cause = resetMissing
			}
		}
		secret.Data[redisPasswordKey] = pw
	}
	if want := redisSecretData(string(pw))[redisConfigKey]; string(secret.Data[redisConfigKey]) != string(want) {
		if len(repairs) == 0 {
			repairs = append(repairs, fmt.Sprintf("Secret %s's %s did not match its %q key (the password is the truth); wrote it again from the password", secret.Name, redisConfigKey, redisPasswordKey))
		}
		secret.Data[redisConfigKey] = want
	}
	hash := passwordHash(pw)
	if seen, ok := secret.Annotations[annotationPasswordHash]; ok && seen != hash && cause == "" && redisRuns {
		cause = resetEdited
		repairs = append(repairs, fmt.Sprintf("the password in Secret %s was changed by hand; Redis restarts with it, and the pods that use this policy keep the old one until they restart", secret.Name))
	}
	secret.Annotations[annotationPasswordHash] = hash
	if cause != "" {
		secret.Annotations[annotationPasswordReset] = now.UTC().Format(time.RFC3339Nano)
		secret.Annotations[annotationPasswordResetCause] = cause
	}
	return repairs, nil
}

// stalePods are the pods created before the password was reset: their
// sidecars got the old password.
func stalePods(pods *policyPods, secret *corev1.Secret, reset bool) []string {
	at, ok := secret.Annotations[annotationPasswordReset]
	if !ok && !reset {
		return nil
	}
	since, err := time.Parse(time.RFC3339Nano, at)
	if err != nil {
		since = secret.CreationTimestamp.Time
	}
	var out []string
	for _, pod := range pods.live {
		// Creation times have whole seconds: a pod of the same second as
		// the reset may hold either password, so it counts as stale.
		if !pod.CreationTimestamp.After(since) {
			out = append(out, pod.Name)
		}
	}
	slices.Sort(out)
	return out
}

// releaseRedisSecret removes the finalizer from the managed Redis's Secret.
func (r *IdempotencyPolicyReconciler) releaseRedisSecret(ctx context.Context, p *v1alpha1.IdempotencyPolicy) error {
	return r.releaseSecret(ctx, p, RedisName(p.Name))
}

// adoptSecret makes a managed Secret controlled by an earlier policy of
// p's name (deleted without its finalizer, so nobody released the Secret)
// controlled by p, and reports whether it did. Names are unique in a
// namespace: a controller reference to another UID of this name is to a
// policy that is gone.
func (r *IdempotencyPolicyReconciler) adoptSecret(p *v1alpha1.IdempotencyPolicy, secret *corev1.Secret) (bool, error) {
	ref := metav1.GetControllerOf(secret)
	l := secret.Labels
	if ref == nil || ref.UID == p.UID || ref.Kind != "IdempotencyPolicy" || ref.APIVersion != v1alpha1.GroupVersion.String() || ref.Name != p.Name ||
		l["app.kubernetes.io/managed-by"] != managedBy || l[v1alpha1.LabelPolicy] != p.Name {
		return false, nil
	}
	var refs []metav1.OwnerReference
	for _, o := range secret.OwnerReferences {
		if o.Controller == nil || !*o.Controller {
			refs = append(refs, o)
		}
	}
	secret.OwnerReferences = refs
	if err := controllerutil.SetControllerReference(p, secret, r.Scheme); err != nil {
		return false, err
	}
	r.Recorder.Eventf(p, secret, corev1.EventTypeNormal, "Adopted", "Provision", "Adopted Secret %s, left by an earlier policy %s (deleted without its finalizer)", secret.Name, p.Name)
	return true, nil
}
