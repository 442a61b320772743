package policywire

import (
	"testing"
	"time"
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
