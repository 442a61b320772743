package policystream

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/bounded"
)

// tally is what the streams of one policy say, at one moment.
type tally struct {
	Version         string
	Connected       int32
	Synced          int32
	RestartRequired int32
	RestartPods     []string
	Rejected        int32
	RejectReason    string
	// Unconnected are the injected pods that hold no stream.
	Unconnected []string
}

// maxRejectReason bounds the reason a sidecar gave for a NACK.
const maxRejectReason = 512

// SidecarsStatus computes status.sidecars and the SidecarsSynced condition
// from the counts: a pure function, so every reason is tested without a
// cluster. workloads are what to restart for RestartRequired. It is True
// only when every injected pod holds a stream and acknowledged the
// current hash (or no pod uses the policy): a pod without a stream may
// enforce any older policy.
func SidecarsStatus(namespace string, injected int32, t tally, workloads []string) (v1alpha1.SidecarsStatus, metav1.Condition) {
	st := v1alpha1.SidecarsStatus{
		Injected: injected, Connected: t.Connected, Synced: t.Synced, RestartRequired: t.RestartRequired,
		Ratio: fmt.Sprintf("%d/%d", t.Synced, injected), SyncedHash: t.Version,
	}
	c := metav1.Condition{Type: v1alpha1.ConditionSidecarsSynced}
	unconnected := ""
	if n := len(t.Unconnected); n > 0 {
		unconnected = fmt.Sprintf("; %s hold no policy stream (starting, or unable to reach the manager: see kubectl -n %s logs POD -c idemcp-proxy), so what they enforce is not known: the policy they started with or last had",
			bounded.Count(n, "injected pod", "injected pods", t.Unconnected), namespace)
	}
	switch {
	case injected == 0 && t.Connected == 0:
		c.Status, c.Reason = metav1.ConditionTrue, v1alpha1.ReasonNoInjectedPods
		c.Message = "no running pod uses this policy: nothing to sync"
	case t.RestartRequired > 0:
		c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonRestartRequired
		c.Message = fmt.Sprintf("%d pods applied policy %s but keep the store they started with, because a running sidecar cannot switch stores; until they restart, they and new pods use different stores and a retry that crosses them runs again. Restart them: %s",
			t.RestartRequired, t.Version, restartCommand(namespace, workloads))
	case t.Rejected > 0:
		c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonPolicyRejected
		c.Message = fmt.Sprintf("%d sidecars rejected policy %s and keep enforcing their last good policy: %s", t.Rejected, t.Version, bounded.Cut(t.RejectReason, maxRejectReason))
	case t.Synced < t.Connected:
		c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonSyncing
		c.Message = fmt.Sprintf("%d of %d connected sidecars applied policy %s%s", t.Synced, t.Connected, t.Version, unconnected)
	case len(t.Unconnected) > 0:
		c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonSidecarsNotConnected
		c.Message = fmt.Sprintf("%d of %d connected sidecars applied policy %s%s", t.Synced, t.Connected, t.Version, unconnected)
	default:
		c.Status, c.Reason = metav1.ConditionTrue, v1alpha1.ReasonAllSynced
		c.Message = fmt.Sprintf("%d of %d connected sidecars applied policy %s, and every injected pod is connected", t.Synced, t.Connected, t.Version)
	}
	c.Message = bounded.Message(c.Message)
	return st, c
}

func restartCommand(namespace string, workloads []string) string {
	if len(workloads) == 0 {
		return "delete their pods"
	}
	cmds := make([]string, 0, len(workloads))
	more := 0
	if len(workloads) > bounded.Names {
		workloads, more = workloads[:bounded.Names], len(workloads)-bounded.Names
	}
	for _, w := range workloads {
		if strings.HasPrefix(w, "pod/") {
			cmds = append(cmds, fmt.Sprintf("kubectl -n %s delete %s", namespace, w))
			continue
		}
		cmds = append(cmds, fmt.Sprintf("kubectl -n %s rollout restart %s", namespace, w))
	}
	if more > 0 {
		cmds = append(cmds, fmt.Sprintf("and %d more workloads", more))
	}
	return strings.Join(cmds, "; ")
}

// workloadOf names what owns a pod, as kubectl rollout restart takes it.
func workloadOf(pod *corev1.Pod) string {
	for _, ref := range pod.OwnerReferences {
		if ref.Controller == nil || !*ref.Controller {
			continue
		}
		switch ref.Kind {
		case "ReplicaSet":
			if h := pod.Labels["pod-template-hash"]; h != "" && strings.HasSuffix(ref.Name, "-"+h) {
				return "deployment/" + strings.TrimSuffix(ref.Name, "-"+h)
			}
			return "replicaset/" + ref.Name
		case "StatefulSet":
			return "statefulset/" + ref.Name
		case "DaemonSet":
			return "daemonset/" + ref.Name
		}
	}
	return "pod/" + pod.Name
}

// flush writes the status of every policy whose streams or pods changed
// since the last flush: one server-side apply per policy, whatever the
// number of sidecars behind it.
func (s *Server) flush(ctx context.Context) {
	type job struct {
		key        types.NamespacedName
		generation int64
		t          tally
		restart    map[string]bool
		connected  map[string]bool
		tools      map[string]*toolReport // by pod
	}
	var jobs []job
	s.mu.Lock()
	for key, st := range s.policies {
		if !st.dirty || st.snap == nil {
			continue
		}
		st.dirty = false
		j := job{key: key, generation: st.generation, t: tally{Version: st.snap.version}, restart: map[string]bool{}, connected: map[string]bool{}, tools: map[string]*toolReport{}}
		for c := range st.streams {
			j.t.Connected++
			j.connected[c.pod] = true
			rep := c.report
			if len(rep.Tools) > 0 || rep.ToolsOmitted > 0 {
				j.tools[c.pod] = &toolReport{workload: "pod/" + c.pod, tools: rep.Tools, omitted: rep.ToolsOmitted}
			}
			switch {
			case rep.Version == st.snap.version && rep.RestartRequired != "":
				j.t.RestartRequired++
				j.restart[c.pod] = true
			case rep.Version == st.snap.version:
				j.t.Synced++
			case rep.Error != "" && rep.Nonce != "" && rep.Nonce == c.lastNonce:
				j.t.Rejected++
				j.t.RejectReason = rep.Error
			}
		}
		jobs = append(jobs, j)
	}
	s.mu.Unlock()

	for _, j := range jobs {
		var pods corev1.PodList
		// Read-only: no deep copy of every pod at every flush.
		if err := s.pods.List(ctx, &pods, client.InNamespace(j.key.Namespace), client.MatchingLabels{v1alpha1.LabelPolicy: j.key.Name}, client.UnsafeDisableDeepCopy); err != nil {
			s.redo(j.key)
			log.FromContext(ctx).Error(err, "Counting the pods of a policy failed", "policy", klog.KRef(j.key.Namespace, j.key.Name))
			continue
		}
		var injected int32
		var workloads []string
		for i := range pods.Items {
			p := &pods.Items[i]
			if p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
				continue
			}
			// The managed Redis's pod carries the policy label too, but no
			// sidecar: counting it kept Synced at 2/3 with two sidecars.
			if p.Labels[v1alpha1.LabelComponent] == "redis" {
				continue
			}
			injected++
			if tr := j.tools[p.Name]; tr != nil {
				tr.workload = workloadOf(p)
			}
			if !j.connected[p.Name] {
				j.t.Unconnected = append(j.t.Unconnected, p.Name)
			}
			if j.restart[p.Name] {
				if w := workloadOf(p); !slices.Contains(workloads, w) {
					workloads = append(workloads, w)
				}
			}
		}
		slices.Sort(workloads)
		slices.Sort(j.t.Unconnected)
		sidecars, cond := SidecarsStatus(j.key.Namespace, injected, j.t, workloads)
		s.mu.Lock()
		// A policy deleted since the tally has no counts any more.
		if st := s.policies[j.key]; st != nil && st.snap != nil {
			setSidecarsGauge(j.key, sidecars.Injected, sidecars.Connected, sidecars.Synced)
		}
		s.mu.Unlock()
		reports := make([]toolReport, 0, len(j.tools))
		for _, tr := range j.tools {
			reports = append(reports, *tr)
		}
		tools, omitted, toolsCond := ToolsStatus(reports)
		if err := s.writeStatus(ctx, j.key, j.generation, streamStatus{sidecars: sidecars, synced: cond, tools: tools, toolsOmitted: omitted, toolsCond: toolsCond}); err != nil {
			s.redo(j.key)
			log.FromContext(ctx).Error(err, "Writing the sidecars' status failed", "policy", klog.KRef(j.key.Namespace, j.key.Name))
		}
	}
}

func (s *Server) redo(key types.NamespacedName) {
	s.mu.Lock()
	if st := s.policies[key]; st != nil {
		st.dirty = true
	}
	s.mu.Unlock()
}

// streamStatus is what the policy stream owns of a policy's status.
type streamStatus struct {
	sidecars     v1alpha1.SidecarsStatus
	synced       metav1.Condition
	tools        []v1alpha1.ToolStatus
	toolsOmitted int32
	toolsCond    metav1.Condition
}

// writeStatus applies status.sidecars, status.tools and the
// SidecarsSynced and ToolsAnnotated conditions under the stream's own
// field manager, unless they are what it last wrote; a new list of tools
// Auto deduplicates for want of annotations is also a Warning event.
func (s *Server) writeStatus(ctx context.Context, key types.NamespacedName, generation int64, ss streamStatus) error {
	ss.synced.ObservedGeneration = generation
	ss.toolsCond.ObservedGeneration = generation
	fingerprint, _ := json.Marshal([]any{ss.sidecars, ss.synced, ss.tools, ss.toolsOmitted, ss.toolsCond})
	s.mu.Lock()
	st := s.policies[key]
	same := st != nil && st.written == string(fingerprint)
	s.mu.Unlock()
	if same {
		return nil
	}
	var current v1alpha1.IdempotencyPolicy
	if err := s.pods.Get(ctx, key, &current); err != nil {
		return client.IgnoreNotFound(err)
	}
	now := metav1.NewTime(time.Now())
	for _, c := range []*metav1.Condition{&ss.synced, &ss.toolsCond} {
		c.LastTransitionTime = now
		if old := meta.FindStatusCondition(current.Status.Conditions, c.Type); old != nil && old.Status == c.Status {
			c.LastTransitionTime = old.LastTransitionTime
		}
	}
	err := applyStreamStatus(ctx, s.client, key, ss)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("applying the status of %s: %w", key, err)
	}
	s.mu.Lock()
	warn := false
	if st := s.policies[key]; st != nil {
		st.written = string(fingerprint)
		if ss.toolsCond.Status == metav1.ConditionFalse && st.toolsWarned != ss.toolsCond.Message {
			warn = true
		}
		st.toolsWarned = ""
		if ss.toolsCond.Status == metav1.ConditionFalse {
			st.toolsWarned = ss.toolsCond.Message
		}
	}
	s.mu.Unlock()
	if warn && s.opts.Recorder != nil {
		s.opts.Recorder.Eventf(&current, nil, corev1.EventTypeWarning, v1alpha1.ReasonToolsUnannotated, "ClassifyTools", "%s", bounded.Note(ss.toolsCond.Message))
	}
	return nil
}

// ApplyStatus writes a policy's status.sidecars and one condition
// (SidecarsSynced) with server-side apply under the policy stream's field
// manager, the fields' one owner: the stream's sessions write them (with
// the tools), and the reconciler does when no stream runs
// (--policy-stream-bind-address=0), when no sidecar reports its tools.
func ApplyStatus(ctx context.Context, c client.Client, key types.NamespacedName, sidecars v1alpha1.SidecarsStatus, cond metav1.Condition) error {
	return applyStreamStatus(ctx, c, key, streamStatus{sidecars: sidecars, synced: cond})
}

func applyStreamStatus(ctx context.Context, c client.Client, key types.NamespacedName, ss streamStatus) error {
	sc, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&ss.sidecars)
	if err != nil {
		return err
	}
	conds := []any{}
	for _, cond := range []metav1.Condition{ss.synced, ss.toolsCond} {
		if cond.Type == "" {
			continue
		}
		cc, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&cond)
		if err != nil {
			return err
		}
		conds = append(conds, cc)
	}
	status := map[string]any{"sidecars": sc, "conditions": conds}
	if len(ss.tools) > 0 {
		tools := make([]any, 0, len(ss.tools))
		for i := range ss.tools {
			t, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&ss.tools[i])
			if err != nil {
				return err
			}
			tools = append(tools, t)
		}
		status["tools"] = tools
	}
	if ss.toolsOmitted > 0 {
		status["toolsOmitted"] = int64(ss.toolsOmitted)
	}
	u := &unstructured.Unstructured{Object: map[string]any{"status": status}}
	u.SetAPIVersion(v1alpha1.GroupVersion.String())
	u.SetKind("IdempotencyPolicy")
	u.SetNamespace(key.Namespace)
	u.SetName(key.Name)
	return c.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner(v1alpha1.FieldManagerPolicyStream), client.ForceOwnership)
}
