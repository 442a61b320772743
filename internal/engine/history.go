package engine

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/claim"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/tracing"
)

// A live policy change must never make a retry of a stored call run
// again. A change of keyScope or of a tool's ignoreArguments moves the
// call's key (or, for an explicit key, its fingerprint), so the engine
// remembers the policies it enforced before, for as long as records made
// under them are kept, and a call first looks for its result under the
// keys it had then. Only calls whose key the change moved pay for it: one
// Reserve (and, when nothing is there, one Release) per earlier policy.

// maxEarlierPolicies bounds the policies remembered: a policy changed in
// a loop must not grow the work of every call.
const maxEarlierPolicies = 8

// earlierPolicy is a policy replaced at a moment.
type earlierPolicy struct {
	policy   *policy.Policy
	replaced time.Time
}

// earlierKey is where a call's record may be under an earlier policy, or
// in the other key space (legacy.go).
type earlierKey struct {
	key, fingerprint string
	lease            time.Duration
	takeOver         bool
	// legacy: the key is in the other key space.
	legacy bool
	// conflicts: the fingerprint is the call's own now, so a record of
	// other arguments under the key is the explicit key reused, refused
	// as under the key now. Under an earlier policy, other arguments may
	// be the same call's (ignoreArguments changed): the key now decides.
	conflicts bool
}

// remember keeps p, replaced at now, and forgets the policies whose
// records have all expired.
func (e *Engine) remember(p *policy.Policy, now time.Time) {
	for {
		cur := e.earlier.Load()
		next := []earlierPolicy{{policy: p, replaced: now}}
		if cur != nil {
			for _, ep := range *cur {
				if len(next) < maxEarlierPolicies && now.Sub(ep.replaced) < longestRetention(ep.policy) {
					next = append(next, ep)
				}
			}
		}
		if e.earlier.CompareAndSwap(cur, &next) {
			return
		}
	}
}

// longestRetention is the longest any record made under p is kept: the
// longest ttl of its rules (explicit keys, and claims under onAbandoned:
// Error) bounds every retryWindow too.
func longestRetention(p *policy.Policy) time.Duration {
	longest := p.TTL
	for _, r := range p.Spec.Tools {
		if r.TTL != nil {
			longest = max(longest, r.TTL.Duration)
		}
	}
	return longest + p.LeaseDuration
}

// earlierKeys are the keys and fingerprints the call had under the
// earlier policies, and in the other key space when alt (legacy.go),
// where they differ from its key now (derived in space) and records made
// there may still be kept.
func (e *Engine) earlierKeys(tc *ToolCall, c Caller, explicit, space, other string, alt bool) []earlierKey {
	list := e.earlier.Load()
	if list == nil && !alt {
		return nil
	}
	now := time.Now()
	var out []earlierKey
	seen := map[string]bool{}
	p := e.policy.Load()
	cur := p.RuleFor(tc.Name)
	curFP, _ := Fingerprint(tc.Name, tc.Arguments, cur.IgnoreArguments)
	seen[deriveKey(space, cur, c, explicit, curFP)+"\x00"+curFP] = true
	spaces := []string{space}
	if alt {
		// The policy now, in the other key space: the fingerprint is the
		// call's own, so a record of other arguments under its explicit
		// key is a conflict there as here.
		k := deriveKey(other, cur, c, explicit, curFP)
		seen[k+"\x00"+curFP] = true
		out = append(out, earlierKey{key: k, fingerprint: curFP, lease: p.LeaseDuration,
			takeOver: cur.OnAbandoned != v1alpha1.AbandonedError, legacy: true, conflicts: true})
		spaces = append(spaces, other)
	}
	if list == nil {
		return out
	}
	for _, ep := range *list {
		r := ep.policy.RuleFor(tc.Name)
		if r.Mode == v1alpha1.ModePassthrough {
			continue // nothing was stored
		}
		keep := r.TTL
		if explicit == "" && r.OnAbandoned != v1alpha1.AbandonedError && r.RetryWindow > 0 {
			keep = min(r.RetryWindow, r.TTL)
		}
		if now.Sub(ep.replaced) >= keep+ep.policy.LeaseDuration {
			continue
		}
		if explicit == "" && unscopedCall(r, c) || explicit != "" && !explicitScoped(r, c) {
			continue
		}
		fp, err := Fingerprint(tc.Name, tc.Arguments, r.IgnoreArguments)
		if err != nil {
			continue
		}
		for i, ks := range spaces {
			k := deriveKey(ks, r, c, explicit, fp)
			if seen[k+"\x00"+fp] {
				continue
			}
			seen[k+"\x00"+fp] = true
			out = append(out, earlierKey{key: k, fingerprint: fp, lease: ep.policy.LeaseDuration,
				takeOver: r.OnAbandoned != v1alpha1.AbandonedError, legacy: i > 0})
		}
	}
	return out
}

// findEarlier looks for the call's result under its earlier keys. found
// reports that the call is answered: with the stored result, or with the
// error the earlier record calls for. A key with nothing there is let go
// at once, and the call goes on under its key now.
func (e *Engine) findEarlier(ctx context.Context, p *Plan, fwd Forward) (out Outcome, err error, found bool) {
	for _, ek := range p.earlier {
		owner := e.instance + "-" + strconv.FormatUint(e.seq.Add(1), 36)
		c := store.Claim{Key: ek.key, Fingerprint: ek.fingerprint, Owner: owner, Lease: ek.lease, Retention: ek.lease,
			TakeOver: ek.takeOver, Tenant: p.Tenant, Tool: p.Tool, Pod: e.pod}
		// Waits on an earlier key count against the same bounds as
		// Execute's on its key.
		w := e.waits(p, ek.key)
		r, rerr := e.claims.Reserve(ctx, c, w)
		switch {
		case rerr == nil:
		case errors.Is(rerr, claim.ErrConflict) && ek.conflicts:
			e.countCall(OutcomeRejected, p.Tool)
			traceOutcome(ctx, tracing.OutcomeConflict)
			return Outcome{}, keyConflict(p.Tool), true
		case errors.Is(rerr, claim.ErrConflict):
			// Another call's record (an explicit key reused with other
			// arguments): the key now decides.
			continue
		case errors.Is(rerr, claim.ErrInFlight) || errors.Is(rerr, claim.ErrWaitTimeout):
			e.countCall(OutcomeRejected, p.Tool)
			made := "made before the policy changed"
			if ek.legacy {
				made = "stored under its key of the other key derivation (an upgrade from an idemcp without key spaces is under way)"
			}
			return Outcome{}, &Error{Code: mcpmsg.CodeInFlight, Message: "a call to " + strconv.Quote(p.Tool) +
				" with this key, " + made + ", is still running; retry later to get its result"}, true
		default:
			// The store failed, or ctx ended: nothing says the earlier key
			// holds no result, so going on under the key now could run
			// the call again. Answer as Execute does for its own key.
			if unavailable := (*claim.UnavailableError)(nil); errors.As(rerr, &unavailable) {
				if unavailable.Held {
					return Outcome{}, e.stillRunning(p, unavailable.Err), true
				}
				out, err := e.storeUnavailable(ctx, p, fwd, unavailable.Err)
				return out, err, true
			}
			return Outcome{}, rerr, true
		}
		switch r.State {
		case store.Won:
			// Nothing under this key: let it go.
			if rel := e.claims.Release(context.WithoutCancel(ctx), ek.key, owner, func() {}); rel != nil {
				e.storeWriteFailed("release", p, rel)
			}
		case store.Completed:
			session, resp := taskSession(r.Response)
			if session != "" && session != sessionHash(p.caller) {
				e.countCall(OutcomeRejected, p.Tool)
				return Outcome{}, &Error{Code: mcpmsg.CodeTaskElsewhere, Message: "the first call to " + strconv.Quote(p.Tool) +
					" with this key created a task in another MCP session, and a task can be read only in the session that created it; it is not run again"}, true
			}
			e.countCall(OutcomeReplayed, p.Tool)
			if ek.legacy {
				e.metrics.LegacyReplays.Inc()
			} else {
				e.metrics.EarlierReplays.Inc()
			}
			return Outcome{Kind: Replayed, Response: resp}, nil, true
		default: // store.Abandoned
			e.countCall(OutcomeRejected, p.Tool)
			return Outcome{}, &Error{Code: mcpmsg.CodeOutcomeUnknown, Message: "outcome unknown: the first call to " + strconv.Quote(p.Tool) +
				" with this key stopped mid-call (its sidecar died) and onAbandoned is Error, so it is not run again; check whether it took effect"}, true
		}
	}
	return Outcome{}, nil, false
}
