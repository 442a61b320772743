package policystream

import (
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

func TestSidecarsStatus(t *testing.T) {
	for _, tc := range []struct {
		name     string
		injected int32
		t        tally
		status   metav1.ConditionStatus
		reason   string
		ratio    string
		says     string
	}{
		{"no pods", 0, tally{Version: "h"}, metav1.ConditionTrue, v1alpha1.ReasonNoInjectedPods, "0/0", "no running pod uses this policy"},
		// Not "True, nothing is out of date": a pod without a stream may
		// enforce any older policy.
		{"nobody connected", 2, tally{Version: "h", Unconnected: []string{"mcp-a", "mcp-b"}}, metav1.ConditionFalse, v1alpha1.ReasonSidecarsNotConnected, "0/2", "2 injected pods (mcp-a, mcp-b) hold no policy stream"},
		{"one of two connected", 2, tally{Version: "h", Connected: 1, Synced: 1, Unconnected: []string{"mcp-b"}}, metav1.ConditionFalse, v1alpha1.ReasonSidecarsNotConnected, "1/2", "1 injected pod (mcp-b) hold"},
		{"all synced", 3, tally{Version: "h", Connected: 3, Synced: 3}, metav1.ConditionTrue, v1alpha1.ReasonAllSynced, "3/3", "3 of 3 connected sidecars applied policy h, and every injected pod is connected"},
		{"one behind", 3, tally{Version: "h", Connected: 3, Synced: 2}, metav1.ConditionFalse, v1alpha1.ReasonSyncing, "2/3", "2 of 3"},
		{"a NACK", 3, tally{Version: "h", Connected: 3, Synced: 2, Rejected: 1, RejectReason: "does not compile"}, metav1.ConditionFalse, v1alpha1.ReasonPolicyRejected, "2/3", "does not compile"},
		{"store changed", 2, tally{Version: "h", Connected: 2, RestartRequired: 2}, metav1.ConditionFalse, v1alpha1.ReasonRestartRequired, "0/2", "kubectl -n shop rollout restart deployment/mcp"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, c := SidecarsStatus("shop", tc.injected, tc.t, []string{"deployment/mcp"})
			if c.Status != tc.status || c.Reason != tc.reason || st.Ratio != tc.ratio || !strings.Contains(c.Message, tc.says) {
				t.Fatalf("got %s/%s %q ratio %s, want %s/%s containing %q ratio %s", c.Status, c.Reason, c.Message, st.Ratio, tc.status, tc.reason, tc.says, tc.ratio)
			}
		})
	}
}

// TestSidecarsStatusIsBounded: a thousand unconnected pods and workloads
// to restart still make a message the API server takes.
func TestSidecarsStatusIsBounded(t *testing.T) {
	var pods, workloads []string
	for i := range 1000 {
		pods = append(pods, fmt.Sprintf("a-rather-long-pod-name-of-some-workload-%04d-7d9f8c6b5-x2x2x", i))
		workloads = append(workloads, fmt.Sprintf("deployment/a-rather-long-workload-name-%04d", i))
	}
	for _, tl := range []tally{
		{Version: "h", Unconnected: pods},
		{Version: "h", Connected: 1000, RestartRequired: 1000},
		{Version: "h", Connected: 1000, Rejected: 1, RejectReason: strings.Repeat("x", 100000)},
	} {
		_, c := SidecarsStatus("shop", 1000, tl, workloads)
		if len(c.Message) > 4096 || !strings.Contains(c.Message, "more") && !strings.Contains(c.Message, "(cut)") {
			t.Errorf("%s: a message of %d bytes: %.200s", c.Reason, len(c.Message), c.Message)
		}
	}
}

func TestWorkloadOf(t *testing.T) {
	pod := func(kind, owner string, labels map[string]string) *corev1.Pod {
		p := &corev1.Pod{}
		p.Name, p.Labels = "p-1", labels
		if kind != "" {
			p.OwnerReferences = []metav1.OwnerReference{{Kind: kind, Name: owner, Controller: ptr.To(true)}}
		}
		return p
	}
	for _, tc := range []struct {
		pod  *corev1.Pod
		want string
	}{
		{pod("ReplicaSet", "mcp-7d9f", map[string]string{"pod-template-hash": "7d9f"}), "deployment/mcp"},
		{pod("ReplicaSet", "mcp-rs", nil), "replicaset/mcp-rs"},
		{pod("StatefulSet", "mcp", nil), "statefulset/mcp"},
		{pod("", "", nil), "pod/p-1"},
	} {
		if got := workloadOf(tc.pod); got != tc.want {
			t.Errorf("workloadOf = %s, want %s", got, tc.want)
		}
	}
}
