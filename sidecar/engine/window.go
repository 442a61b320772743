package engine

import "time"

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
