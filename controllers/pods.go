package controllers

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/bounded"
)

// workload is a pod's top-level owner, such as Deployment/api.
type workload struct{ kind, name string }

func (w workload) String() string { return w.kind + "/" + w.name }

// policyPods is what the controller knows of the pods that use a policy:
// only pods the webhook injected count, never the managed Redis.
type policyPods struct {
	// live are injected pods that have not finished (terminating ones
	// included: their calls still use the store).
	live []*corev1.Pod
	// workloads maps each top-level workload to its pods' revisions and,
	// for each revision, how many of its pods are ready and not
	// terminating.
	workloads map[workload]map[string]int
	// top is each live pod's top-level workload, by pod name.
	top map[string]workload
	// ownKeySpace are the workloads of IdempotentProxies: each keeps its
	// records under a prefix of its own, so it shares no key space.
	ownKeySpace map[workload]bool
	// spaceless are the workloads with pods injected by an idemcp that
	// gave sidecars no key space (--key-space): their keys are the
	// policy's, shared with every other such workload.
	spaceless map[workload]bool
}

// sharingKeys names, sorted, the workloads that share the policy's key
// space although they are different MCP servers: those with pods injected
// before sidecars had a key space of their own. Workloads that share one
// by idemcp.io/key-space asked to, and are not named; nor are
// IdempotentProxies, whose prefix is their own.
func (pp *policyPods) sharingKeys() []string {
	var out []string
	for _, w := range pp.sorted() {
		if pp.spaceless[w] && !pp.ownKeySpace[w] {
			out = append(out, w.String())
		}
	}
	return out
}

// hasKeySpace reports whether the webhook gave the pod's sidecar a key
// space of its own (its status annotation names it).
func hasKeySpace(pod *corev1.Pod) bool {
	var st struct {
		KeySpace string `json:"keySpace"`
	}
	return json.Unmarshal([]byte(pod.Annotations[v1alpha1.AnnotationStatus]), &st) == nil && st.KeySpace != ""
}

// sorted returns the workloads in a stable order.
func (pp *policyPods) sorted() []workload {
	return slices.SortedFunc(maps.Keys(pp.workloads), func(a, b workload) int { return strings.Compare(a.String(), b.String()) })
}

// names returns the workloads, sorted.
func (pp *policyPods) names() []string {
	var out []string
	for _, w := range pp.sorted() {
		out = append(out, w.String())
	}
	return out
}

// serving is how many replicas serve at once: per workload, the ready
// pods of its largest revision, so the overlap of old and new pods during
// a rollout of one replica counts as one.
func (pp *policyPods) serving() (total int, detail []string) {
	for _, w := range pp.sorted() {
		var best int
		for _, n := range pp.workloads[w] {
			best = max(best, n)
		}
		if best > 0 {
			total += best
			detail = append(detail, fmt.Sprintf("%s (%d ready)", w, best))
		}
	}
	return total, detail
}

// injected reports whether the webhook injected the pod for a policy: the
// pod has the webhook's status mark, and it is not idemcp's own Redis.
func injected(pod *corev1.Pod) bool {
	if _, ok := pod.Labels[v1alpha1.LabelComponent]; ok {
		return false
	}
	_, ok := pod.Annotations[v1alpha1.AnnotationStatus]
	return ok
}

func podReady(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// listPolicyPods finds the injected pods of a policy and their top-level
// workloads, following owner references through ReplicaSets and Jobs.
func (r *IdempotencyPolicyReconciler) listPolicyPods(ctx context.Context, p *v1alpha1.IdempotencyPolicy) (*policyPods, error) {
	var pods corev1.PodList
	if err := r.List(ctx, &pods, client.InNamespace(p.Namespace), client.MatchingLabels{v1alpha1.LabelPolicy: p.Name}); err != nil {
		return nil, fmt.Errorf("listing pods of %s: %w", klog.KObj(p), err)
	}
	out := &policyPods{workloads: map[workload]map[string]int{}, top: map[string]workload{}, ownKeySpace: map[workload]bool{}, spaceless: map[workload]bool{}}
	owners := map[workload]workload{} // intermediate owner -> top-level
	for i := range pods.Items {
		pod := &pods.Items[i]
		if !injected(pod) || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
			continue
		}
		out.live = append(out.live, pod)
		top, rev, err := r.topOwner(ctx, pod, owners)
		if err != nil {
			return nil, err
		}
		out.top[pod.Name] = top
		if pod.Labels[v1alpha1.LabelProxy] != "" {
			out.ownKeySpace[top] = true
		}
		if !hasKeySpace(pod) {
			out.spaceless[top] = true
		}
		revs := out.workloads[top]
		if revs == nil {
			revs = map[string]int{}
			out.workloads[top] = revs
		}
		if podReady(pod) && pod.DeletionTimestamp == nil {
			revs[rev]++
		} else if _, ok := revs[rev]; !ok {
			revs[rev] = 0
		}
	}
	return out, nil
}

// intermediateOwners are kinds whose own controller is the workload a
// person names: a Deployment's ReplicaSet, a CronJob's Job.
var intermediateOwners = map[string]schema.GroupVersionKind{
	"ReplicaSet": {Group: "apps", Version: "v1", Kind: "ReplicaSet"},
	"Job":        {Group: "batch", Version: "v1", Kind: "Job"},
}

// topOwner returns the pod's top-level workload and the revision the pod
// belongs to within it.
func (r *IdempotencyPolicyReconciler) topOwner(ctx context.Context, pod *corev1.Pod, seen map[workload]workload) (workload, string, error) {
	ref := metav1.GetControllerOf(pod)
	if ref == nil {
		return workload{"Pod", pod.Name}, pod.Name, nil
	}
	direct := workload{ref.Kind, ref.Name}
	rev := ref.Name
	if h := pod.Labels["controller-revision-hash"]; h != "" {
		rev = h
	}
	gvk, ok := intermediateOwners[ref.Kind]
	if !ok || !strings.HasPrefix(ref.APIVersion, gvk.Group+"/") {
		return direct, rev, nil
	}
	if top, ok := seen[direct]; ok {
		return top, rev, nil
	}
	// Metadata only, read once per owner and reconcile.
	var m metav1.PartialObjectMetadata
	m.SetGroupVersionKind(gvk)
	top := direct
	switch err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: pod.Namespace, Name: ref.Name}, &m); {
	case apierrors.IsNotFound(err):
	case err != nil:
		return workload{}, "", fmt.Errorf("reading the owner %s of pod %s: %w", direct, klog.KObj(pod), err)
	default:
		if up := metav1.GetControllerOf(&m); up != nil {
			top = workload{up.Kind, up.Name}
		}
	}
	seen[direct] = top
	return top, rev, nil
}

// restartHint is the kubectl commands that restart the named pods: a
// rollout restart of each workload they belong to (a Deployment, a
// StatefulSet, a DaemonSet), else a delete of the pod; bounded.
func restartHint(ns string, pods *policyPods, names []string) string {
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	var cmds []string
	seen := map[string]bool{}
	for _, pod := range pods.live {
		if !want[pod.Name] {
			continue
		}
		cmd := fmt.Sprintf("kubectl -n %s delete pod %s", ns, pod.Name)
		switch w := pods.top[pod.Name]; w.kind {
		case "Deployment", "StatefulSet", "DaemonSet":
			cmd = fmt.Sprintf("kubectl -n %s rollout restart %s/%s", ns, strings.ToLower(w.kind), w.name)
		}
		if !seen[cmd] {
			seen[cmd] = true
			cmds = append(cmds, cmd)
		}
	}
	slices.Sort(cmds)
	return bounded.ListN(cmds, 5)
}
