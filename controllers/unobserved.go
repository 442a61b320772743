package controllers

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/controllers/policystream"
	"github.com/idemcp/idemcp/internal/bounded"
)

// snapshotHash is the policyHash the webhook gave a pod's sidecar at
// admission (the idemcp.io/status annotation).
func snapshotHash(pod *corev1.Pod) string {
	var s struct {
		PolicyHash string `json:"policyHash"`
	}
	_ = json.Unmarshal([]byte(pod.Annotations[v1alpha1.AnnotationStatus]), &s)
	return s.PolicyHash
}

// UnobservedSidecars is status.sidecars and SidecarsSynced when no policy
// stream runs: nobody hears what a sidecar applied, so the condition is
// Unknown, never True, while pods use the policy. What is known is said:
// each sidecar enforces the snapshot its pod started with, and the pods
// whose snapshot is older are named.
func UnobservedSidecars(namespace, hash string, pods []*corev1.Pod) (v1alpha1.SidecarsStatus, metav1.Condition) {
	var stale []string
	var injected int32
	for _, pod := range pods {
		if pod.DeletionTimestamp != nil {
			continue
		}
		injected++
		if snapshotHash(pod) != hash {
			stale = append(stale, pod.Name)
		}
	}
	slices.Sort(stale)
	st := v1alpha1.SidecarsStatus{Injected: injected, Ratio: fmt.Sprintf("?/%d", injected)}
	c := metav1.Condition{Type: v1alpha1.ConditionSidecarsSynced}
	if injected == 0 {
		c.Status, c.Reason = metav1.ConditionTrue, v1alpha1.ReasonNoInjectedPods
		c.Message = "no running pod uses this policy: nothing to sync"
		st.Ratio = "0/0"
	} else {
		c.Status, c.Reason = metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved
		c.Message = fmt.Sprintf("the manager runs without the policy stream (--policy-stream-bind-address=0), so no sidecar reports what it applied: each enforces the snapshot its pod started with, and a policy change reaches a pod only when it restarts; %d of %d injected pods started with policy %s",
			int(injected)-len(stale), injected, hash)
		if len(stale) > 0 {
			c.Message += fmt.Sprintf(", %s with an older one: restart them to apply this one", bounded.Count(len(stale), "pod", "pods", stale))
		}
	}
	c.Message = bounded.Message(c.Message)
	return st, c
}

// writeUnobservedSidecars writes UnobservedSidecars under the policy
// stream's field manager (the fields are the stream's whenever one runs),
// and into p, so that Ready is computed from it.
func (r *IdempotencyPolicyReconciler) writeUnobservedSidecars(ctx context.Context, p *v1alpha1.IdempotencyPolicy, hash string, pods *policyPods) error {
	sidecars, cond := UnobservedSidecars(p.Namespace, hash, pods.live)
	cond.ObservedGeneration = p.Generation
	old := meta.FindStatusCondition(p.Status.Conditions, cond.Type)
	if old != nil && old.Status == cond.Status && old.Reason == cond.Reason && old.Message == cond.Message && old.ObservedGeneration == cond.ObservedGeneration &&
		p.Status.Sidecars != nil && equality.Semantic.DeepEqual(*p.Status.Sidecars, sidecars) {
		return nil
	}
	meta.SetStatusCondition(&p.Status.Conditions, cond)
	cond = *meta.FindStatusCondition(p.Status.Conditions, cond.Type)
	p.Status.Sidecars = &sidecars
	err := policystream.ApplyStatus(ctx, r.Client, client.ObjectKeyFromObject(p), sidecars, cond)
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("applying the sidecars' status of %s: %w", klog.KObj(p), err)
	}
	return nil
}
