package controllers

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/bounded"
	"github.com/idemcp/idemcp/internal/credentials"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
)

// The seal Secret of a policy holds, under SealKeysKey, the keyring that
// seals every result its sidecars store in a shared store: base64 keys,
// one a line, the current one first. The webhook gives it to each sidecar
// as IDEMCP_SEAL_KEYS (a secretKeyRef), so a sidecar reads its keys when it
// starts, and a rotation reaches it when its pod restarts.
//
// A rotation, asked for with the annotation AnnotationRotateSealKey on the
// Secret, goes in three steps, each waiting until no pod that started
// before it runs, so that no sidecar ever meets a result it cannot open:
//
//  1. staged: a new key is added after the current one; pods started from
//     now on can open results sealed with it, and still seal with the old;
//  2. promoted: once every pod holds the new key, it moves first; pods
//     started from now on seal with it;
//  3. retiring: once no pod seals with the old key any more, it is kept for
//     the longest retention it sealed under (see annotationSealRetention),
//     plus the lease and the clock-skew grace of opening, then dropped.
const (
	// SealKeysKey is the key of the Secret's data that holds the keyring.
	SealKeysKey = credentials.SealKeysKey
	// AnnotationRotateSealKey on the seal Secret asks for a rotation; the
	// controller removes it when the rotation starts.
	AnnotationRotateSealKey = "idemcp.io/rotate-seal-key"
	// annotationSealStage and annotationSealSince record a rotation in
	// progress; annotationSealRetireAfter when the old key may go.
	annotationSealStage       = "idemcp.io/seal-rotation-stage"
	annotationSealSince       = "idemcp.io/seal-rotation-since"
	annotationSealRetireAfter = "idemcp.io/seal-retire-after"
	// annotationSealRetention records, by key id, the longest TTL and the
	// longest lease of the policy seen while the key sealed: a record
	// sealed with the key lives that long whatever the policy says when
	// the key retires (a TTL shortened meanwhile does not shorten records
	// stored before). JSON: {"KEYID": {"ttl": "72h0m0s", "lease": "30s"}}.
	annotationSealRetention = "idemcp.io/seal-key-retention"

	sealStaged   = "staged"
	sealPromoted = "promoted"
	sealRetiring = "retiring"

	sealRecheck = 30 * time.Second

	// ReasonSealKeysRepaired is the Warning Event of a seal Secret whose
	// keyring was emptied or lost its key, and got a new key.
	ReasonSealKeysRepaired = "SealKeysRepaired"
)

// sealSkewGrace is added to the time a retiring key stays: a record opens
// until that long past its sealed expiry, which the sealing sidecar's
// clock set (store.SealExpiryGrace).
var sealSkewGrace = store.SealExpiryGrace

// SealName is the name of a policy's seal Secret.
func SealName(policy string) string { return credentials.SealSecretName(policy) }

// sharedStore reports whether a policy's results live outside the sidecars
// (Redis, Postgres): those are sealed.
func sharedStore(p *v1alpha1.IdempotencyPolicy) bool {
	switch p.Spec.Store.Type {
	case v1alpha1.StoreRedis:
		return p.Spec.Store.Redis != nil
	case v1alpha1.StorePostgres:
		return p.Spec.Store.Postgres != nil
	}
	return false
}

func newSealKey() (string, error) {
	b := make([]byte, store.SealKeyBytes)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return base64.StdEncoding.EncodeToString(b), nil
}

func sealKeys(secret *corev1.Secret) []string {
	return strings.Fields(string(secret.Data[SealKeysKey]))
}

func joinKeys(keys ...string) []byte { return []byte(strings.Join(keys, "\n") + "\n") }

// reconcileSealKey makes sure a policy with a shared store has its seal
// Secret, and moves a rotation on. It returns when to look again.
func (r *IdempotencyPolicyReconciler) reconcileSealKey(ctx context.Context, p *v1alpha1.IdempotencyPolicy, compiled *policy.Policy, pods *policyPods) (time.Duration, error) {
	if !sharedStore(p) {
		return 0, r.releaseSecret(ctx, p, SealName(p.Name))
	}
	name := SealName(p.Name)
	var secret corev1.Secret
	err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: p.Namespace, Name: name}, &secret)
	if apierrors.IsNotFound(err) {
		return 0, r.createSealSecret(ctx, p)
	}
	if err != nil {
		return 0, fmt.Errorf("reading Secret %s/%s: %w", p.Namespace, name, err)
	}
	before := secret.DeepCopy()
	adopted, err := r.adoptSecret(p, &secret)
	if err != nil {
		return 0, err
	}
	if !adopted && !metav1.IsControlledBy(&secret, p) {
		return 0, newConflict("Secret", &secret)
	}
	if secret.DeletionTimestamp.IsZero() && !controllerutil.ContainsFinalizer(&secret, v1alpha1.FinalizerInUse) {
		// Losing the key would make every stored result unreadable, so
		// every retry within the TTL would run again.
		controllerutil.AddFinalizer(&secret, v1alpha1.FinalizerInUse)
	}
	repaired, err := repairSealKeys(&secret, pods)
	if err != nil {
		return 0, err
	}
	requeue, msg, err := rotateSealKey(&secret, compiled, pods, time.Now())
	if err != nil {
		return 0, err
	}
	if equalObjects(before, &secret) {
		return requeue, nil
	}
	if err := r.Patch(ctx, &secret, client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{})); err != nil {
		return 0, fmt.Errorf("updating Secret %s/%s: %w", p.Namespace, name, err)
	}
	if repaired != "" {
		log.FromContext(ctx).Info("Repaired the seal Secret", "secret", name, "repair", repaired)
		r.Recorder.Eventf(p, &secret, corev1.EventTypeWarning, ReasonSealKeysRepaired, "Provision", "%s", repaired)
	}
	if msg != "" {
		log.FromContext(ctx).Info("Seal key rotation", "secret", name, "step", msg)
		r.Recorder.Eventf(p, &secret, corev1.EventTypeNormal, "SealKeyRotation", "Rotate", "%s", msg)
	}
	return requeue, nil
}

func (r *IdempotencyPolicyReconciler) createSealSecret(ctx context.Context, p *v1alpha1.IdempotencyPolicy) error {
	key, err := newSealKey()
	if err != nil {
		return fmt.Errorf("generating the seal key: %w", err)
	}
	labels := map[string]string{
		"app.kubernetes.io/managed-by": managedBy,
		v1alpha1.LabelPolicy:           p.Name,
		v1alpha1.LabelCredentials:      "true",
	}
	secret := corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: SealName(p.Name), Namespace: p.Namespace, Labels: labels, Finalizers: []string{v1alpha1.FinalizerInUse}},
		Type:       corev1.SecretTypeOpaque,
		Data:       map[string][]byte{SealKeysKey: joinKeys(key)},
	}
	if err := controllerutil.SetControllerReference(p, &secret, r.Scheme); err != nil {
		return err
	}
	if err := r.Create(ctx, &secret); err != nil {
		if apierrors.IsAlreadyExists(err) {
			return nil // made by an earlier reconcile; the next one reads it
		}
		return fmt.Errorf("creating Secret %s/%s: %w", p.Namespace, secret.Name, err)
	}
	r.Recorder.Eventf(p, &secret, corev1.EventTypeNormal, "Created", "Provision", "Created Secret %s with the key that seals stored results", secret.Name)
	return nil
}

// repairSealKeys gives a seal Secret whose keyring is empty, or whose key
// is gone, a new key, and says what that means; "" when it had keys. The
// Secret cannot simply be made again: its finalizer keeps a deleted one
// (Terminating), and a new pod could not start without the key. The lost
// key is lost: results sealed under it no longer open, so a retry of such
// a call runs again, once; pods started before hold the old keyring.
func repairSealKeys(secret *corev1.Secret, pods *policyPods) (string, error) {
	if len(sealKeys(secret)) > 0 {
		return "", nil
	}
	key, err := newSealKey()
	if err != nil {
		return "", fmt.Errorf("generating the seal key: %w", err)
	}
	if secret.Data == nil {
		secret.Data = map[string][]byte{}
	}
	secret.Data[SealKeysKey] = joinKeys(key)
	for _, a := range []string{annotationSealStage, annotationSealSince, annotationSealRetireAfter} {
		delete(secret.Annotations, a)
	}
	msg := fmt.Sprintf("Secret %s had no seal keys under %q; made a new key %s: results stored under the lost key cannot be opened, so a retry of such a call runs again, once", secret.Name, SealKeysKey, keyID(key))
	if n := len(pods.live); n > 0 {
		names := make([]string, 0, n)
		for _, pod := range pods.live {
			names = append(names, pod.Name)
		}
		slices.Sort(names)
		msg += fmt.Sprintf("; the pods of this policy that run now hold the old keyring until they restart, and neither side opens the other's results: restart them (kubectl rollout restart): %s", bounded.Count(n, "pod", "pods", names))
	}
	return msg, nil
}

// rotateSealKey moves a rotation one step on, in secret. It returns when
// to look again and what it did (empty: nothing).
func rotateSealKey(secret *corev1.Secret, compiled *policy.Policy, pods *policyPods, now time.Time) (time.Duration, string, error) {
	keys := sealKeys(secret)
	ann := secret.Annotations
	stage := ann[annotationSealStage]
	since, _ := time.Parse(time.RFC3339Nano, ann[annotationSealSince])
	set := func(kv ...string) {
		if secret.Annotations == nil {
			secret.Annotations = map[string]string{}
		}
		for i := 0; i < len(kv); i += 2 {
			if kv[i+1] == "" {
				delete(secret.Annotations, kv[i])
			} else {
				secret.Annotations[kv[i]] = kv[i+1]
			}
		}
	}
	stamp := now.UTC().Format(time.RFC3339Nano)
	retention := recordRetention(secret, keys, stage, compiled)
	switch {
	case len(keys) == 0:
		return 0, "", fmt.Errorf("the seal Secret %s/%s has no keys under %q", secret.Namespace, secret.Name, SealKeysKey) // repairSealKeys runs first

	case stage == "" && ann[AnnotationRotateSealKey] != "":
		key, err := newSealKey()
		if err != nil {
			return 0, "", err
		}
		secret.Data[SealKeysKey] = joinKeys(append(keys, key)...)
		set(AnnotationRotateSealKey, "", annotationSealStage, sealStaged, annotationSealSince, stamp)
		return sealRecheck, fmt.Sprintf("added seal key %s, for opening only; restart the pods of this policy so that every one holds it (%d run now), and it becomes the sealing key", keyID(key), len(pods.live)), nil

	case stage == sealStaged && len(keys) >= 2:
		if n := startedBefore(pods, since); n > 0 {
			return sealRecheck, "", nil
		}
		newest := keys[len(keys)-1]
		rest := keys[:len(keys)-1]
		secret.Data[SealKeysKey] = joinKeys(append([]string{newest}, rest...)...)
		set(annotationSealStage, sealPromoted, annotationSealSince, stamp)
		return sealRecheck, fmt.Sprintf("seal key %s now seals, in pods started from now on; restart the pods of this policy (%d run now) so that none seals with %s", keyID(newest), len(pods.live), keyID(keys[0])), nil

	case stage == sealPromoted:
		if n := startedBefore(pods, since); n > 0 {
			return sealRecheck, "", nil
		}
		// The old keys sealed until now: the policy as it is now counts
		// too, and recordRetention has taken it in.
		var longest sealRetention
		for _, k := range keys[1:] {
			r := retention[keyID(k)]
			longest.TTL, longest.Lease = max(longest.TTL, r.TTL), max(longest.Lease, r.Lease)
		}
		keep := longest.TTL + longest.Lease + sealSkewGrace
		after := now.Add(keep)
		set(annotationSealStage, sealRetiring, annotationSealRetireAfter, after.UTC().Format(time.RFC3339Nano))
		return keep, fmt.Sprintf("no pod seals with the previous key any more; it stays for opening until %s (the longest TTL it sealed under, %v, plus the lease, %v, and %v for clock skew), then goes",
			after.UTC().Format(time.RFC3339), longest.TTL, longest.Lease, sealSkewGrace), nil

	case stage == sealRetiring:
		after, err := time.Parse(time.RFC3339Nano, ann[annotationSealRetireAfter])
		if err == nil && now.Before(after) {
			return after.Sub(now), "", nil
		}
		secret.Data[SealKeysKey] = joinKeys(keys[0])
		set(annotationSealStage, "", annotationSealSince, "", annotationSealRetireAfter, "")
		retention = map[string]sealRetention{keyID(keys[0]): retention[keyID(keys[0])]}
		writeRetention(secret, retention)
		return 0, fmt.Sprintf("dropped the previous seal keys; %s alone seals and opens", keyID(keys[0])), nil
	}
	return 0, "", nil
}

// sealRetention is how long records sealed with a key may live: the
// longest TTL and lease of the policy while the key sealed.
type sealRetention struct {
	TTL   time.Duration `json:"ttl"`
	Lease time.Duration `json:"lease"`
}

func (r sealRetention) MarshalJSON() ([]byte, error) {
	return json.Marshal(map[string]string{"ttl": r.TTL.String(), "lease": r.Lease.String()})
}

func (r *sealRetention) UnmarshalJSON(b []byte) error {
	var m map[string]string
	if err := json.Unmarshal(b, &m); err != nil {
		return err
	}
	var err error
	if r.TTL, err = time.ParseDuration(m["ttl"]); err != nil {
		return err
	}
	r.Lease, err = time.ParseDuration(m["lease"])
	return err
}

// recordRetention takes the compiled policy into the retention of every
// key that seals now, writes it into secret's annotations if it grew, and
// returns it by key id. A key seals while it is first; during the
// promoted step the previous keys still seal too, in pods started before
// the promotion. Only what a reconcile sees is recorded: a key whose
// record began with this version of the controller starts from the
// policy of its first reconcile.
func recordRetention(secret *corev1.Secret, keys []string, stage string, compiled *policy.Policy) map[string]sealRetention {
	retention := map[string]sealRetention{}
	// An annotation that does not parse is replaced: the policy as it is
	// now is all there is to go by.
	_ = json.Unmarshal([]byte(secret.Annotations[annotationSealRetention]), &retention)
	held := map[string]bool{}
	for _, k := range keys {
		held[keyID(k)] = true
	}
	maps.DeleteFunc(retention, func(id string, _ sealRetention) bool { return !held[id] })
	sealing := keys
	if stage != sealPromoted && len(keys) > 0 {
		sealing = keys[:1]
	}
	ttl, lease := compiled.LongestTTL(), compiled.LeaseDuration
	for _, k := range sealing {
		id := keyID(k)
		r := retention[id]
		retention[id] = sealRetention{TTL: max(r.TTL, ttl), Lease: max(r.Lease, lease)}
	}
	writeRetention(secret, retention)
	return retention
}

func writeRetention(secret *corev1.Secret, retention map[string]sealRetention) {
	b, err := json.Marshal(retention)
	if err != nil || string(b) == secret.Annotations[annotationSealRetention] {
		return
	}
	if secret.Annotations == nil {
		secret.Annotations = map[string]string{}
	}
	secret.Annotations[annotationSealRetention] = string(b)
}

func keyID(b64 string) string {
	raw, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return "(unreadable)"
	}
	return store.SealKeyID(raw)
}

// startedBefore counts the pods of the policy that started before t: their
// sidecars read the Secret as it was then.
func startedBefore(pods *policyPods, t time.Time) int {
	n := 0
	for _, pod := range pods.live {
		// Creation times have whole seconds: a pod of the same second may
		// hold either version.
		if !pod.CreationTimestamp.After(t) {
			n++
		}
	}
	return n
}

// releaseSecret removes idemcp's finalizer from a Secret of the policy.
func (r *IdempotencyPolicyReconciler) releaseSecret(ctx context.Context, p *v1alpha1.IdempotencyPolicy, name string) error {
	var secret metav1.PartialObjectMetadata
	secret.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Secret"))
	if err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: p.Namespace, Name: name}, &secret); err != nil {
		return client.IgnoreNotFound(err)
	}
	if !metav1.IsControlledBy(&secret, p) || !controllerutil.ContainsFinalizer(&secret, v1alpha1.FinalizerInUse) {
		return nil
	}
	before := secret.DeepCopy()
	controllerutil.RemoveFinalizer(&secret, v1alpha1.FinalizerInUse)
	if err := r.Patch(ctx, &secret, client.MergeFrom(before)); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("releasing Secret %s/%s: %w", p.Namespace, name, err)
	}
	return nil
}
