package policysync

import (
	"testing"
	"time"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
)

// TestApplyLegacyKeys: a snapshot's legacyKeys reach the engine, with
// the same policy as before too; a snapshot without them (a manager
// before them) leaves them; an empty one clears them.
func TestApplyLegacyKeys(t *testing.T) {
	start := policy.Default()
	start.Namespace, start.Name = "shop", "pay"
	eng := engine.New(engine.Options{Policy: start, KeySpace: "Deployment/api"})
	c, err := New(Options{Endpoint: "https://manager", Namespace: "shop", Name: "pay", Token: func() (string, error) { return "t", nil }, Engine: eng})
	if err != nil {
		t.Fatal(err)
	}
	spec := v1alpha1.IdempotencyPolicySpec{}
	until := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	for _, step := range []struct {
		name string
		l    *policywire.LegacyKeys
		want engine.LegacyKeys
	}{
		{"writers", &policywire.LegacyKeys{Writers: true}, engine.LegacyKeys{Writers: true}},
		{"a manager before legacy keys", nil, engine.LegacyKeys{Writers: true}},
		{"the deadline, same policy", &policywire.LegacyKeys{Until: until}, engine.LegacyKeys{Until: until}},
		{"none", &policywire.LegacyKeys{}, engine.LegacyKeys{}},
	} {
		snap := snapshotOf(t, spec, "")
		snap.LegacyKeys = step.l
		if _, nack := c.apply(snap); nack != "" {
			t.Fatalf("%s: NACK %q", step.name, nack)
		}
		if got := eng.LegacyKeys(); got.Writers != step.want.Writers || !got.Until.Equal(step.want.Until) {
			t.Errorf("%s: the engine has legacy keys %+v, want %+v", step.name, got, step.want)
		}
	}
}
