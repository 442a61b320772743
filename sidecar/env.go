package sidecar

import (
	"errors"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
)

// LoadPolicy compiles the policy given as a file or inline (the webhook's
// snapshot), or returns the defaults when neither is given.
func LoadPolicy(file, inline string) (*policy.Policy, error) {
	switch {
	case file != "" && inline != "":
		return nil, errors.New("--policy-file and --policy (IDEMCP_POLICY) both given; use one")
	case file != "":
		p, err := policy.LoadFile(file)
		if err != nil {
			return nil, fmt.Errorf("--policy-file %s: %w", file, err)
		}
		return p, nil
	case inline != "":
		p, err := policy.Parse([]byte(inline))
		if err != nil {
			return nil, fmt.Errorf("--policy (IDEMCP_POLICY): %w", err)
		}
		return p, nil
	}
	return policy.Default(), nil
}

// RetryWindowFlag documents --retry-window, which `idemcp sidecar` and
// `idemcp wrap` share.
const RetryWindowFlag = "how long an identical call with a derived key (no explicit idempotency key) counts as a retry and is replayed, overriding the policy's spec.retryWindow; at most its ttl (0: the policy's, 10m by default). For use without a manager: a pushed policy brings its own"

// WithRetryWindow returns p with spec.retryWindow set to d (0: p as it
// is), checked as the policy's own would be.
func WithRetryWindow(p *policy.Policy, d time.Duration) (*policy.Policy, error) {
	if d == 0 {
		return p, nil
	}
	spec := *p.Spec.DeepCopy()
	spec.RetryWindow = &metav1.Duration{Duration: d}
	q, err := policy.Compile(spec)
	if err != nil {
		return nil, fmt.Errorf("--retry-window %s: %w", d, err)
	}
	q.Name, q.Namespace = p.Name, p.Namespace
	return q, nil
}

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
