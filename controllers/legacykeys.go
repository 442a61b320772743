package controllers

import (
	"encoding/json"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/webhook"
)

// Pods injected by an idemcp before key spaces derive their keys without
// one. While any runs, status.legacyKeys.writers counts them, and every
// sidecar derives its keys as they do; once none is left, until says how
// long sidecars still look under those keys: as long as the policy keeps
// a record, from then. The sidecars get it on the policy stream, and a new
// pod from the webhook (IDEMCP_LEGACY_KEYS).

// legacyWriters counts the pods whose sidecar derives keys without a key
// space and shares the policy's store prefix (an IdempotentProxy's pods
// have a prefix of their own).
// A pod counts only if it runs the sidecar container: a pod that merely
// carries the label and a status annotation (copied from an old pod's
// YAML) writes no keys, and must not keep every workload of the policy
// sharing keys.
func legacyWriters(pods *policyPods) int32 {
	var n int32
	for _, pod := range pods.live {
		if pod.Labels[v1alpha1.LabelProxy] == "" && !hasKeySpace(pod) && sidecarContainer(pod) != nil {
			n++
		}
	}
	return n
}

// staleWriters counts the pods injected while legacy writers ran, whose
// sidecar container still carries IDEMCP_LEGACY_KEYS=writers: restarted
// while the manager is away (or before its first snapshot), such a
// sidecar derives keys without its key space again, so the others keep
// looking under those keys while any of them lives.
func staleWriters(pods *policyPods) int32 {
	var n int32
	for _, pod := range pods.live {
		c := sidecarContainer(pod)
		if c == nil || pod.Labels[v1alpha1.LabelProxy] != "" {
			continue
		}
		for _, e := range c.Env {
			if e.Name == webhook.EnvLegacyKeys && e.Value == policywire.LegacyWritersFlag {
				n++
				break
			}
		}
	}
	return n
}

// sidecarContainer is the pod's idemcp sidecar (a container, or a native
// sidecar among the init containers), or nil.
// The webhook's status mark names the container it injected.
func sidecarContainer(pod *corev1.Pod) *corev1.Container {
	var st struct {
		Container string `json:"container"`
	}
	_ = json.Unmarshal([]byte(pod.Annotations[v1alpha1.AnnotationStatus]), &st)
	for _, cs := range [][]corev1.Container{pod.Spec.Containers, pod.Spec.InitContainers} {
		for i := range cs {
			if cs[i].Name == webhook.ContainerName || st.Container != "" && cs[i].Name == st.Container {
				return &cs[i]
			}
		}
	}
	return nil
}

// legacyRetention is the longest a record of p is kept, its lease
// included; the margin covers the clocks of the manager and the sidecars,
// which compare the deadline.
func legacyRetention(p *policy.Policy) time.Duration {
	return p.LongestTTL() + p.LeaseDuration + legacyClockMargin
}

// legacyClockMargin is added to the deadline of the lookups under legacy
// keys: a sidecar whose clock is ahead must not stop before the last
// record expires.
const legacyClockMargin = time.Minute

// nextLegacyKeys is status.legacyKeys, given what it was, the writers
// running now and the policy's retention: writers while there are any;
// the deadline set once, when the last one is seen gone; nothing once the
// deadline has passed, or if no writer was ever seen (a fresh install
// never looks under another key).
//
// While stale writers (staleWriters) live the deadline stays a retention
// ahead, moved on at each reconcile (and at the deadline, which requeues).
func nextLegacyKeys(prev *v1alpha1.LegacyKeysStatus, writers, stale int32, retention time.Duration, now time.Time) *v1alpha1.LegacyKeysStatus {
	switch {
	case writers > 0:
		return &v1alpha1.LegacyKeysStatus{Writers: writers}
	case prev == nil:
		return nil
	case prev.Writers > 0 || stale > 0 && prev.Until != nil:
		// The status keeps whole seconds: round up. A deadline is never
		// moved earlier (a ttl lowered since keeps the longer one).
		until := metav1.NewTime(now.Add(retention + time.Second).Truncate(time.Second))
		if prev.Until != nil && prev.Until.After(until.Time) {
			until = *prev.Until.DeepCopy()
		}
		return &v1alpha1.LegacyKeysStatus{Until: &until}
	case prev.Until != nil && now.Before(prev.Until.Time):
		return &v1alpha1.LegacyKeysStatus{Until: prev.Until.DeepCopy()}
	}
	return nil
}

// legacyRequeue is how soon the status must drop a deadline that will
// have passed (0: none to drop).
func legacyRequeue(l *v1alpha1.LegacyKeysStatus, now time.Time) time.Duration {
	if l == nil || l.Until == nil {
		return 0
	}
	return max(l.Until.Sub(now)+time.Second, time.Second)
}
