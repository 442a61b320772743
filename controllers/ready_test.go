package controllers_test

import (
	"strings"
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
		return metav1.Condition{Type: v1alpha1.ConditionStoreReady, Status: s, Reason: reason, Message: "store says", ObservedGeneration: 7}
	}
	synced := func(s metav1.ConditionStatus) metav1.Condition {
		return metav1.Condition{Type: v1alpha1.ConditionSidecarsSynced, Status: s, Reason: "x", Message: "2/3 synced", ObservedGeneration: 7}
	}
	// SidecarsSynced as the policy stream wrote it before the spec edit
	// that made generation 7.
	before := func(s metav1.ConditionStatus) metav1.Condition {
		c := synced(s)
		c.ObservedGeneration = 6
		return c
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
		// After a spec edit, the previous generation's sync says nothing
		// of what the sidecars enforce now.
		{"sidecars synced the previous generation", []metav1.Condition{store(metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable), before(metav1.ConditionTrue)}, "", metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved},
		{"sidecars behind on the previous generation", []metav1.Condition{store(metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable), before(metav1.ConditionFalse)}, "", metav1.ConditionUnknown, v1alpha1.ReasonSyncNotObserved},
		{"deleting while in use", []metav1.Condition{store(metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable)}, "2 pods", metav1.ConditionFalse, v1alpha1.ReasonPolicyInUse},
	}
	for _, tt := range tests {
		got := controllers.Ready(7, tt.conds, tt.deleting)
		if got.Status != tt.want || got.Reason != tt.reason || got.ObservedGeneration != 7 || got.Type != v1alpha1.ConditionReady {
			t.Errorf("%s: Ready = %s/%s (gen %d), want %s/%s", tt.name, got.Status, got.Reason, got.ObservedGeneration, tt.want, tt.reason)
		}
	}
}

// TestReadyWaitsForTheSidecarsToReportTheNewGeneration: right after a spec
// edit, Ready at the new generation says the sidecars have not reported
// it, instead of True from the previous generation's "all synced" (what
// kubectl wait --for=condition=Ready would have passed on).
func TestReadyWaitsForTheSidecarsToReportTheNewGeneration(t *testing.T) {
	conds := []metav1.Condition{
		{Type: v1alpha1.ConditionStoreReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonRedisAvailable, ObservedGeneration: 2},
		{Type: v1alpha1.ConditionSidecarsSynced, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonAllSynced, Message: "3/3 synced", ObservedGeneration: 1},
	}
	got := controllers.Ready(2, conds, "")
	want := "the sidecars have not reported generation 2 of the policy yet (their last report is of generation 1)"
	if got.Status != metav1.ConditionUnknown || got.Reason != v1alpha1.ReasonSyncNotObserved || !strings.Contains(got.Message, want) {
		t.Errorf("Ready = %s/%s %q, want Unknown/%s saying %q", got.Status, got.Reason, got.Message, v1alpha1.ReasonSyncNotObserved, want)
	}
	conds[1].ObservedGeneration = 2
	if got := controllers.Ready(2, conds, ""); got.Status != metav1.ConditionTrue {
		t.Errorf("Ready once the sidecars report generation 2 = %s/%s %q, want True", got.Status, got.Reason, got.Message)
	}
}
