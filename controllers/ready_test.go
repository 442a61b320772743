package controllers_test

import (
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/controllers"
)

// TestReadySumsUpTheOtherConditions: Ready depends on the other conditions
// alone, so the controller and the policy stream, each writing its own,
// agree on it.
func TestReadySumsUpTheOtherConditions(t *testing.T) {
	store := func(s metav1.ConditionStatus, reason string) metav1.Condition {
		return metav1.Condition{Type: v1alpha1.ConditionStoreReady, Status: s, Reason: reason, Message: "store says"}
	}
	synced := func(s metav1.ConditionStatus) metav1.Condition {
		return metav1.Condition{Type: v1alpha1.ConditionSidecarsSynced, Status: s, Reason: "x", Message: "2/3 synced"}
	}
	tests := []struct {
		name     string
		conds    []metav1.Condition
		deleting string
		want     metav1.ConditionStatus
		reason   string
	}{
		{"nothing yet", nil, "", metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady},
		// Ready says True only when someone saw the sidecars apply it.
		{"store ready, sidecars not reported", []metav1.Condition{store(metav1.ConditionTrue, v1alpha1.ReasonMemoryStore)}, "", metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved},
		{"sidecars not observed", []metav1.Condition{store(metav1.ConditionTrue, v1alpha1.ReasonMemoryStore), synced(metav1.ConditionUnknown)}, "", metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved},
		{"store ready with a warning", []metav1.Condition{store(metav1.ConditionTrue, v1alpha1.ReasonStoreSharedByWorkloads), synced(metav1.ConditionTrue)}, "", metav1.ConditionTrue, v1alpha1.ReasonReady},
		{"store not ready", []metav1.Condition{store(metav1.ConditionFalse, v1alpha1.ReasonSecretNotFound)}, "", metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady},
		{"invalid spec", []metav1.Condition{store(metav1.ConditionUnknown, v1alpha1.ReasonInvalidSpec)}, "", metav1.ConditionFalse, v1alpha1.ReasonInvalidSpec},
		{"sidecars behind", []metav1.Condition{store(metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable), synced(metav1.ConditionFalse)}, "", metav1.ConditionFalse, v1alpha1.ReasonSidecarsNotSynced},
		{"sidecars synced", []metav1.Condition{store(metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable), synced(metav1.ConditionTrue)}, "", metav1.ConditionTrue, v1alpha1.ReasonReady},
		{"deleting while in use", []metav1.Condition{store(metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable)}, "2 pods", metav1.ConditionFalse, v1alpha1.ReasonPolicyInUse},
	}
	for _, tt := range tests {
		got := controllers.Ready(7, tt.conds, tt.deleting)
		if got.Status != tt.want || got.Reason != tt.reason || got.ObservedGeneration != 7 || got.Type != v1alpha1.ConditionReady {
			t.Errorf("%s: Ready = %s/%s (gen %d), want %s/%s", tt.name, got.Status, got.Reason, got.ObservedGeneration, tt.want, tt.reason)
		}
	}
}
