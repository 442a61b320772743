package policystream

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
)

// TestSnapshotsAreOrdered: every snapshot says where its policy stands
// (UID, creation, generation), never goes back, and moves on when the
// spec does, even to a spec it had before: a sidecar that refused an
// older snapshot from another replica must be sent the newer one.
func TestSnapshotsAreOrdered(t *testing.T) {
	key := types.NamespacedName{Namespace: "shop", Name: "payments"}
	s := &Server{policies: map[types.NamespacedName]*policyState{}}
	created := metav1.NewTime(time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC))
	dedup := v1alpha1.IdempotencyPolicySpec{DefaultMode: v1alpha1.ModeDeduplicate}
	pass := v1alpha1.IdempotencyPolicySpec{DefaultMode: v1alpha1.ModePassthrough}
	obj := func(uid string, created metav1.Time, gen int64, spec v1alpha1.IdempotencyPolicySpec) *v1alpha1.IdempotencyPolicy {
		return &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name,
			UID: types.UID(uid), CreationTimestamp: created, Generation: gen, ResourceVersion: "1"}, Spec: spec}
	}
	hash := func(spec v1alpha1.IdempotencyPolicySpec) string {
		p, err := policy.Compile(spec)
		if err != nil {
			t.Fatal(err)
		}
		return p.Hash
	}
	sent := func() policywire.Snapshot {
		t.Helper()
		s.mu.Lock()
		defer s.mu.Unlock()
		enc, err := s.state(key).encoded("", &s.nonce)
		if err != nil {
			t.Fatal(err)
		}
		var snap policywire.Snapshot
		if err := policywire.Decode(enc.line, &snap); err != nil {
			t.Fatal(err)
		}
		return snap
	}
	check := func(step string, spec v1alpha1.IdempotencyPolicySpec, uid string, gen int64) {
		t.Helper()
		snap := sent()
		if snap.Version != hash(spec) {
			t.Errorf("%s: the snapshot is %s, want %s", step, snap.Version, hash(spec))
		}
		if snap.Order == nil || snap.Order.UID != uid || snap.Order.Generation != gen {
			t.Errorf("%s: the snapshot's order is %+v, want generation %d of %s", step, snap.Order, gen, uid)
		}
	}

	s.observePolicy(obj("x", created, 2, dedup))
	check("generation 2", dedup, "x", 2)
	s.observePolicy(obj("x", created, 1, pass))
	check("a late event of generation 1", dedup, "x", 2)
	s.observePolicy(obj("x", created, 4, dedup))
	check("generation 4, back to the spec of generation 2", dedup, "x", 4)

	// The policy deleted and created again: its fresh read may come
	// before the cache's last events about the old one.
	later := metav1.NewTime(created.Add(time.Hour))
	s.observePolicy(obj("y", later, 1, pass))
	check("the policy created again", pass, "y", 1)
	s.observePolicy(obj("x", created, 5, dedup))
	check("a late event of the deleted policy", pass, "y", 1)
	s.observePolicy(obj("x", created, 6, pass))
	check("another late event of the deleted policy", pass, "y", 1)
	s.forgetPolicy(obj("x", created, 6, pass))
	check("the deleted policy's late delete", pass, "y", 1)
	s.observePolicy(obj("y", later, 2, dedup))
	check("generation 2 of the policy created again", dedup, "y", 2)
}

// TestReplacedPolicyIsSentWhateverItsCreationTime: kubectl replace --force
// on API servers with skewed clocks can stamp the new object earlier than
// the one it replaced. The manager sends the new one (the sidecars apply
// it), whether it learns of it before or after the old one's delete.
func TestReplacedPolicyIsSentWhateverItsCreationTime(t *testing.T) {
	key := types.NamespacedName{Namespace: "shop", Name: "payments"}
	created := metav1.NewTime(time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC))
	earlier := metav1.NewTime(created.Add(-2 * time.Second))
	obj := func(uid string, created metav1.Time, gen int64, mode v1alpha1.ToolMode) *v1alpha1.IdempotencyPolicy {
		return &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name,
			UID: types.UID(uid), CreationTimestamp: created, Generation: gen, ResourceVersion: "1"},
			Spec: v1alpha1.IdempotencyPolicySpec{DefaultMode: mode}}
	}
	for _, deleteFirst := range []bool{true, false} {
		s := &Server{policies: map[types.NamespacedName]*policyState{}}
		s.observePolicy(obj("old", created, 5, v1alpha1.ModeDeduplicate))
		if deleteFirst {
			s.forgetPolicy(obj("old", created, 5, v1alpha1.ModeDeduplicate))
		}
		s.observePolicy(obj("new", earlier, 1, v1alpha1.ModePassthrough))
		s.mu.Lock()
		snap := s.state(key).snap
		s.mu.Unlock()
		if snap == nil || snap.order.UID != "new" {
			t.Errorf("delete first %v: the snapshot is %+v, want the new object's", deleteFirst, snap)
		}
	}
}
