package controllers

import (
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/event"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestReadyIsRecomputedWhenTheSidecarsReportANewGeneration: the policy
// stream's SidecarsSynced of the new generation, with the same status and
// message as the old one ("3/3 synced"), still wakes the reconciler, or
// Ready would stay "not reported yet" after every spec edit.
func TestReadyIsRecomputedWhenTheSidecarsReportANewGeneration(t *testing.T) {
	policy := func(gen int64) *v1alpha1.IdempotencyPolicy {
		p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "shop", Generation: 2}}
		p.Status.Conditions = []metav1.Condition{{Type: v1alpha1.ConditionSidecarsSynced, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonAllSynced, Message: "3/3 synced", ObservedGeneration: gen}}
		return p
	}
	if !(deletionOrSidecarsChanged{}).Update(event.UpdateEvent{ObjectOld: policy(1), ObjectNew: policy(2)}) {
		t.Error("SidecarsSynced moving from generation 1 to 2 does not reach the reconciler")
	}
	if (deletionOrSidecarsChanged{}).Update(event.UpdateEvent{ObjectOld: policy(2), ObjectNew: policy(2)}) {
		t.Error("an unchanged SidecarsSynced reaches the reconciler")
	}
}
