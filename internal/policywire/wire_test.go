package policywire

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestAReplacedPolicyIsNeverOlder: across UIDs the creation times (from
// API servers whose clocks may be skewed) decide nothing: a policy deleted
// and created again is not Older than the one it replaced, whichever was
// stamped first. Within one UID the generation decides.
func TestAReplacedPolicyIsNeverOlder(t *testing.T) {
	t0 := time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC)
	old := Order{UID: "old", Created: t0, Generation: 5}
	replaced := Order{UID: "new", Created: t0.Add(-2 * time.Second), Generation: 1}
	if Older(replaced, old) {
		t.Error("the replacing object, stamped earlier by a skewed clock, is Older than the one it replaced")
	}
	if Older(old, replaced) {
		t.Error("orders of different UIDs are compared by creation time")
	}
	if !Older(Order{UID: "new", Generation: 1}, Order{UID: "new", Generation: 2}) {
		t.Error("an earlier generation of the same object is not Older")
	}
	if Older(Order{UID: "new", Generation: 2}, Order{UID: "new", Generation: 2}) {
		t.Error("the same generation is Older")
	}
}

// TestStoreIdentityLeavesOutWhatAppliesLive: a change of external Redis's
// minReplicas or minReplicasTimeout is applied by a running sidecar, so it
// asks for no restart; a change of the addresses does.
func TestStoreIdentityLeavesOutWhatAppliesLive(t *testing.T) {
	spec := func(addr string, n int32, timeout time.Duration) v1alpha1.StoreSpec {
		ext := &v1alpha1.ExternalRedis{Addresses: []string{addr}, MinReplicas: n}
		if timeout > 0 {
			ext.MinReplicasTimeout = &metav1.Duration{Duration: timeout}
		}
		return v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: ext}}
	}
	base := StoreIdentity(spec("redis:6379", 0, 0))
	if got := StoreIdentity(spec("redis:6379", 2, 3*time.Second)); got != base {
		t.Errorf("minReplicas 2 (timeout 3s) changed the store identity: %s, was %s", got, base)
	}
	if got := StoreIdentity(spec("other:6379", 0, 0)); got == base {
		t.Errorf("another address kept the store identity %s", got)
	}
	s := spec("redis:6379", 2, time.Second)
	_ = StoreIdentity(s)
	if s.Redis.External.MinReplicas != 2 || s.Redis.External.MinReplicasTimeout == nil {
		t.Errorf("StoreIdentity changed the spec it was given: %+v", s.Redis.External)
	}
}
