package sidecar

import (
	"fmt"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policywire"
)

// LegacyWriters is the --legacy-keys (IDEMCP_LEGACY_KEYS) of a sidecar
// injected while pods without key spaces run under its policy.
const LegacyWriters = policywire.LegacyWritersFlag

// ParseLegacyKeys reads --legacy-keys: LegacyWriters, an RFC 3339 time
// (the deadline of the lookups under keys without the key space), or
// empty (none).
func ParseLegacyKeys(v string) (engine.LegacyKeys, error) {
	switch v {
	case "":
		return engine.LegacyKeys{}, nil
	case LegacyWriters:
		return engine.LegacyKeys{Writers: true}, nil
	}
	until, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return engine.LegacyKeys{}, fmt.Errorf("--legacy-keys: %q is neither %q nor an RFC 3339 time, such as 2026-12-02T03:00:00Z", v, LegacyWriters)
	}
	return engine.LegacyKeys{Until: until}, nil
}
