package policy

import (
	"errors"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Load compiles the policy given to `idemcp sidecar` or `idemcp wrap` as
// a file (--policy-file) or inline (--policy, the webhook's snapshot), or
// returns the defaults when neither is given.
func Load(file, inline string) (*Policy, error) {
	switch {
	case file != "" && inline != "":
		return nil, errors.New("--policy-file and --policy (IDEMCP_POLICY) both given; use one")
	case file != "":
		p, err := LoadFile(file)
		if err != nil {
			return nil, fmt.Errorf("--policy-file %s: %w", file, err)
		}
		return p, nil
	case inline != "":
		p, err := Parse([]byte(inline))
		if err != nil {
			return nil, fmt.Errorf("--policy (IDEMCP_POLICY): %w", err)
		}
		return p, nil
	}
	return Default(), nil
}

// RetryWindowFlag documents --retry-window, which `idemcp sidecar` and
// `idemcp wrap` share.
const RetryWindowFlag = "how long an identical call with a derived key (no explicit idempotency key) counts as a retry and is replayed, overriding the policy's spec.retryWindow; at most its ttl (0: the policy's, 10m by default). For use without a manager: a pushed policy brings its own"

// WithRetryWindow returns p with spec.retryWindow set to d (0: p as it
// is), checked as the policy's own would be.
func WithRetryWindow(p *Policy, d time.Duration) (*Policy, error) {
	if d == 0 {
		return p, nil
	}
	spec := *p.Spec.DeepCopy()
	spec.RetryWindow = &metav1.Duration{Duration: d}
	q, err := Compile(spec)
	if err != nil {
		return nil, fmt.Errorf("--retry-window %s: %w", d, err)
	}
	q.Name, q.Namespace = p.Name, p.Namespace
	return q, nil
}
