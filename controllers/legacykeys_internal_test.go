package controllers

import (
	"testing"
	"time"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestNextLegacyKeysWhileStaleWritersLive: with no writer left but stale
// ones (pods whose sidecar still has IDEMCP_LEGACY_KEYS=writers), a
// deadline that is reached moves on a retention from now; once they are
// gone it is kept, then dropped when it passes.
func TestNextLegacyKeysWhileStaleWritersLive(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	const retention = time.Hour
	until := func(l *v1alpha1.LegacyKeysStatus) time.Time {
		if l == nil || l.Until == nil {
			return time.Time{}
		}
		return l.Until.Time
	}
	l := nextLegacyKeys(&v1alpha1.LegacyKeysStatus{Writers: 1}, 0, 1, retention, t0)
	if got := until(l); got.Before(t0.Add(retention)) {
		t.Fatalf("the last writer gone: until %v, want %v or later", got, t0.Add(retention))
	}
	later := t0.Add(2 * time.Hour) // the deadline passed, a stale writer lives
	l = nextLegacyKeys(l, 0, 1, retention, later)
	if got := until(l); got.Before(later.Add(retention)) {
		t.Errorf("a stale writer living at the deadline: until %v, want %v or later", got, later.Add(retention))
	}
	kept := until(l)
	l = nextLegacyKeys(l, 0, 0, 10*time.Minute, later.Add(time.Minute))
	if got := until(l); !got.Equal(kept) {
		t.Errorf("stale writers gone, ttl lowered: until %v, want it kept at %v", got, kept)
	}
	if l = nextLegacyKeys(l, 0, 0, retention, kept.Add(time.Second)); l != nil {
		t.Errorf("past the deadline: %+v, want none", l)
	}
	if l := nextLegacyKeys(nil, 0, 3, retention, t0); l != nil {
		t.Errorf("a fresh install: %+v, want none", l)
	}
}
