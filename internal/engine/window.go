package engine

import (
	"time"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// keepFor is how long the call's record is kept once settled. An explicit
// key is the caller's promise that its calls are one operation: ttl. A
// derived key is only a guess that an identical call soon after is a
// retry: retryWindow, after which the same call runs again. A claim in
// flight lives as long as its lease is renewed, whatever this says.
func (p *Plan) keepFor() time.Duration {
	if p.Explicit || p.Rule.RetryWindow <= 0 {
		return p.Rule.TTL
	}
	return min(p.Rule.RetryWindow, p.Rule.TTL)
}

// pendingRetention is how long the claim's record is kept from its
// reservation while it is unsettled; Complete sets keepFor, Release drops
// it. Under onAbandoned: Error an owner that dies leaves an outcome nobody
// knows, which must answer "outcome unknown" rather than run again: a
// renewal only extends the record to one lease ahead, so a call that ran
// longer than its retryWindow would lapse with its lease, and the next
// retry would run it. Such a claim is kept for the ttl, as a promise is.
func (p *Plan) pendingRetention() time.Duration {
	keep := p.keepFor()
	if p.Rule.OnAbandoned == v1alpha1.AbandonedError {
		keep = p.Rule.TTL
	}
	return max(keep, p.Policy.LeaseDuration)
}
