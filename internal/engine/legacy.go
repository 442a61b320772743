package engine

import "time"

// Pods injected by an idemcp before key spaces derive every key without
// one (deriveKey with keySpace ""). Upgrading must not make a retry that
// a rollout moves between such a pod and a new one run again, so the
// controller tells the sidecars (LegacyKeys) whether such pods still run,
// and once none does, until when their records may be kept. The key
// without the key space is then one more earlier key (history.go): a call
// not found under its key looks there, as under an earlier policy's.

// LegacyKeys is what the engine knows of keys without its key space. The
// zero value: none are wanted (a fresh install, or the upgrade is over).
type LegacyKeys struct {
	// Writers says pods without key spaces still run under the policy:
	// keys are derived without the key space, as theirs are, and a call
	// not found there looks under its key with the key space, where a
	// sidecar told of the end of the writers before this one stored it.
	Writers bool
	// Until, without Writers, is when the last record a pod without key
	// spaces made has expired: until then, a call not found under its key
	// looks under its key without the key space.
	Until time.Time
}

// SetLegacyKeys says what the engine is to do with keys without its key
// space; calls already planned keep the keys they were planned with.
func (e *Engine) SetLegacyKeys(l LegacyKeys) {
	if !l.Writers && l.Until.IsZero() {
		e.legacy.Store(nil)
		return
	}
	e.legacy.Store(&l)
}

// LegacyKeys returns what SetLegacyKeys last said.
func (e *Engine) LegacyKeys() LegacyKeys {
	if l := e.legacy.Load(); l != nil {
		return *l
	}
	return LegacyKeys{}
}

// keySpaces returns the key space a call's key is derived in now, and the
// other one its record may be under (alt says whether there is one). An
// engine without a key space has only the one.
func (e *Engine) keySpaces(now time.Time) (space, other string, alt bool) {
	l := e.legacy.Load()
	switch {
	case e.keySpace == "" || l == nil:
		return e.keySpace, "", false
	case l.Writers:
		return "", e.keySpace, true
	case now.Before(l.Until):
		return e.keySpace, "", true
	}
	return e.keySpace, "", false
}
