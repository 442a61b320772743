package policystream

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
)

// policyState is one policy's current snapshot and the streams that hold it.
type policyState struct {
	snap       *snapshot
	generation int64
	// gone are the UIDs of objects of this name deleted or replaced by
	// another (the last few): their late events, from a cache behind a
	// fresh read, never come back. Creation times are not compared: API
	// servers' clocks may be skewed.
	gone    []string
	streams map[*stream]struct{}
	dirty   bool
	written string // the last status written, to skip identical writes
	// toolsWarned is the ToolsAnnotated message last sent as a Warning
	// event, so each new list of unannotated tools is one event.
	toolsWarned string
	enc         *encodedSnapshot
}

type snapshot struct {
	version string
	policy  *v1alpha1.IdempotencyPolicy
	order   policywire.Order
	// legacy is the policy's status.legacyKeys: not part of the version
	// (the spec's hash), so a change of it alone is sent as the same
	// version again.
	legacy policywire.LegacyKeys
}

// encodedSnapshot is a snapshot as it goes on the wire, encoded once for
// every stream: its nonce names the content (version and CA bundle), so
// a NACK is matched to what the stream was sent.
type encodedSnapshot struct {
	version, ca, nonce string
	order              policywire.Order
	legacy             policywire.LegacyKeys
	line               []byte
}

// encoded returns st's snapshot with ca, encoding it if it changed; the
// caller holds Server.mu.
func (st *policyState) encoded(ca string, nonces *atomic.Uint64) (*encodedSnapshot, error) {
	if e := st.enc; e != nil && e.version == st.snap.version && e.ca == ca && e.order.Equal(st.snap.order) && sameLegacy(e.legacy, st.snap.legacy) {
		return e, nil
	}
	nonce := strconv.FormatUint(nonces.Add(1), 10)
	order := st.snap.order
	legacy := st.snap.legacy
	line, err := json.Marshal(policywire.Snapshot{Version: st.snap.version, Nonce: nonce, Policy: st.snap.policy, CABundle: ca, Order: &order, LegacyKeys: &legacy})
	if err != nil {
		return nil, err
	}
	st.enc = &encodedSnapshot{version: st.snap.version, ca: ca, nonce: nonce, order: order, legacy: legacy, line: append(line, '\n')}
	return st.enc, nil
}

// watch feeds policy and pod changes from the manager's cache.
func (s *Server) watch(ctx context.Context) error {
	pi, err := s.cache.GetInformer(ctx, &v1alpha1.IdempotencyPolicy{})
	if err != nil {
		return fmt.Errorf("policy stream: watching policies: %w", err)
	}
	if _, err := pi.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.observePolicy(o) },
		UpdateFunc: func(_, o any) { s.observePolicy(o) },
		DeleteFunc: func(o any) { s.forgetPolicy(o) },
	}); err != nil {
		return err
	}
	podi, err := s.cache.GetInformer(ctx, &corev1.Pod{})
	if err != nil {
		return fmt.Errorf("policy stream: watching pods: %w", err)
	}
	if _, err := podi.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.podChanged(o, false) },
		UpdateFunc: func(_, o any) { s.podChanged(o, false) },
		DeleteFunc: func(o any) { s.podChanged(o, true) },
	}); err != nil {
		return err
	}
	go func() {
		if s.cache.WaitForCacheSync(ctx) {
			s.synced.Store(true)
		}
	}()
	return nil
}

func (s *Server) notifyAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, st := range s.policies {
		for c := range st.streams {
			poke(c.notify)
		}
	}
}

func poke(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

func (s *Server) state(key types.NamespacedName) *policyState {
	st := s.policies[key]
	if st == nil {
		st = &policyState{streams: map[*stream]struct{}{}}
		s.policies[key] = st
	}
	return st
}

// observePolicy takes a policy from the cache or a fresh read; an older
// one than the one known (an earlier generation, or an object since
// deleted or replaced, whose last events come after the fresh read of the
// new one) never replaces it. A newer generation of the same spec moves
// the snapshot's order on: a sidecar that refused an older one from
// another replica must get it.
func (s *Server) observePolicy(o any) {
	p, ok := o.(*v1alpha1.IdempotencyPolicy)
	if !ok {
		return
	}
	compiled, err := policy.Compile(p.Spec)
	key := types.NamespacedName{Namespace: p.Namespace, Name: p.Name}
	order := policywire.Order{UID: string(p.UID), Created: p.CreationTimestamp.Time, Generation: p.Generation}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.state(key)
	st.dirty = true
	if slices.Contains(st.gone, order.UID) {
		return
	}
	if err != nil || (st.snap != nil && policywire.Older(order, st.snap.order)) || (st.snap == nil && p.Generation < st.generation) {
		// A spec that does not compile is the reconciler's to report
		// (InvalidSpec); sidecars keep the last good one.
		return
	}
	if st.snap != nil && st.snap.order.UID != order.UID {
		st.forget(st.snap.order.UID) // replaced: deleted and created again
	}
	st.generation = p.Generation
	legacy := policywire.LegacyKeysOf(p.Status.LegacyKeys)
	if st.snap != nil && st.snap.version == compiled.Hash {
		if !st.snap.order.Equal(order) || !sameLegacy(st.snap.legacy, legacy) {
			st.snap = &snapshot{version: st.snap.version, policy: st.snap.policy, order: order, legacy: legacy}
			for c := range st.streams {
				poke(c.notify)
			}
		}
		return
	}
	st.snap = &snapshot{version: compiled.Hash, order: order, legacy: legacy, policy: &v1alpha1.IdempotencyPolicy{
		TypeMeta:   p.TypeMeta,
		ObjectMeta: objectMeta(p),
		Spec:       compiled.Spec,
	}}
	st.snap.policy.APIVersion, st.snap.policy.Kind = v1alpha1.GroupVersion.String(), "IdempotencyPolicy"
	for c := range st.streams {
		poke(c.notify)
	}
}

// sameLegacy reports whether a and b say the same of legacy keys.
func sameLegacy(a, b policywire.LegacyKeys) bool {
	return a.Writers == b.Writers && a.Until.Equal(b.Until)
}

func (s *Server) forgetPolicy(o any) {
	if d, ok := o.(toolscache.DeletedFinalStateUnknown); ok {
		o = d.Obj
	}
	p, ok := o.(*v1alpha1.IdempotencyPolicy)
	if !ok {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.state(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
	st.forget(string(p.UID))
	if st.snap != nil && st.snap.order.UID != string(p.UID) {
		return // the late delete of an object already replaced
	}
	// Sidecars keep their last policy; nothing newer will come.
	st.snap, st.generation, st.written = nil, 0, ""
	forgetSidecarsGauge(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
}

// forget records that the object uid is deleted or replaced.
func (st *policyState) forget(uid string) {
	if uid == "" || slices.Contains(st.gone, uid) {
		return
	}
	if len(st.gone) == maxGone {
		st.gone = st.gone[1:]
	}
	st.gone = append(st.gone, uid)
}

func (s *Server) podChanged(o any, gone bool) {
	if d, ok := o.(toolscache.DeletedFinalStateUnknown); ok {
		o = d.Obj
	}
	pod, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	name := pod.Labels[v1alpha1.LabelPolicy]
	gone = gone || pod.DeletionTimestamp != nil
	s.mu.Lock()
	defer s.mu.Unlock()
	// A stream lasts only as long as authorize would admit it: its pod
	// deleted, replaced or labelled for another policy, it ends. A live pod
	// of its name but another UID replaced its pod; a going one of another
	// UID is the pod it replaced, whose last events may come late.
	for key, st := range s.policies {
		if key.Namespace != pod.Namespace {
			continue
		}
		for c := range st.streams {
			same := c.uid == string(pod.UID)
			if c.pod == pod.Name && (same && (gone || key.Name != name) || !same && !gone) {
				c.cancel()
			}
		}
	}
	if name != "" {
		s.state(types.NamespacedName{Namespace: pod.Namespace, Name: name}).dirty = true
	}
}

// refresh reads the policy from the API server, not the cache, before a
// new stream gets its first snapshot: connections arriving together share
// one read.
func (s *Server) refresh(ctx context.Context, key types.NamespacedName) error {
	ch := s.fresh.DoChan(key.String(), func() (any, error) {
		// Not the first caller's context: the callers who joined must not
		// fail because that one went away.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refreshTimeout)
		defer cancel()
		var p v1alpha1.IdempotencyPolicy
		if err := s.apiReader.Get(rctx, key, &p); err != nil {
			return nil, err
		}
		s.observePolicy(&p)
		return nil, nil
	})
	select {
	case r := <-ch:
		return r.Err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// objectMeta is what a sidecar needs of the policy's metadata: its name
// and namespace scope the store's keys. Annotations and managed fields stay
// behind.
func objectMeta(p *v1alpha1.IdempotencyPolicy) metav1.ObjectMeta {
	return metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace}
}
