package policystream

import (
	"context"
	"encoding/json"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
)

// leader is the part of the server that runs on the elected replica only.
type leader struct{ s *Server }

func (l *leader) NeedLeaderElection() bool { return true }

func (l *leader) Start(ctx context.Context) error {
	s := l.s
	s.leading.Store(true)
	defer func() {
		s.leading.Store(false)
		// Only the leader counts sidecars: a replica that was one must not
		// keep serving its last counts.
		sidecarsGauge.Reset()
		// Streams end with the leadership: a sidecar must not keep taking
		// policies from a replica that may no longer watch them.
		s.mu.Lock()
		for _, st := range s.policies {
			for c := range st.streams {
				c.cancel()
			}
		}
		s.mu.Unlock()
	}()
	s.mu.Lock()
	for _, st := range s.policies {
		st.dirty, st.written = true, ""
	}
	s.mu.Unlock()
	// Without the label the stream's Service has no endpoint: retry until
	// it is set.
	for wait := 250 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
		s.labelMu.Lock()
		err := s.labelSelf(ctx, true)
		s.labelMu.Unlock()
		if err == nil {
			break
		}
		log.FromContext(ctx).Error(err, "Labelling the manager's pod as the policy stream's leader failed; retrying", "in", wait)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
	defer func() {
		unlabel, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.labelMu.Lock()
		_ = s.labelSelf(unlabel, false)
		s.labelMu.Unlock()
	}()
	return s.flushLoop(log.IntoContext(ctx, log.FromContext(ctx).WithName("policy-stream")))
}

func (s *Server) flushLoop(ctx context.Context) error {
	t := time.NewTicker(s.opts.FlushInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if !s.synced.Load() {
			continue
		}
		s.flush(ctx)
	}
}

// labelSelf sets or removes LabelLeader on the manager's own pod and, when
// it takes the lead, removes it from any other pod that still has it (a
// replica that died without cleaning up).
func (s *Server) labelSelf(ctx context.Context, leader bool) error {
	if s.opts.PodName == "" || s.opts.PodNamespace == "" {
		return nil
	}
	var value any
	if leader {
		value = "leader"
		var pods corev1.PodList
		if err := s.apiReader.List(ctx, &pods, client.InNamespace(s.opts.PodNamespace), client.MatchingLabels{LabelLeader: "leader"}); err == nil {
			for i := range pods.Items {
				if pods.Items[i].Name != s.opts.PodName {
					_ = s.client.Patch(ctx, &pods.Items[i], client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"`+LabelLeader+`":null}}}`)))
				}
			}
		}
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{LabelLeader: value}}})
	if err != nil {
		return err
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: s.opts.PodNamespace, Name: s.opts.PodName}}
	return client.IgnoreNotFound(s.client.Patch(ctx, pod, client.RawPatch(types.MergePatchType, patch)))
}
