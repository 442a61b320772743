package engine

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync"

	"github.com/idemcp/idemcp/sidecar/mcpmsg"
)

// Default bounds on duplicates waiting for a call in flight. A waiter holds
// a goroutine, a client connection and a store subscription until the
// first call ends: without a bound, one caller retrying a slow call in a
// loop would hold as many as it cares to open.
const (
	DefaultMaxWaitersPerKey       = 1024
	DefaultMaxWaitersPerPrincipal = 4096
)

// Labels of idemcp_over_limit_total.
const (
	LimitWaitersPerKey       = "waiters_per_key"
	LimitWaitersPerPrincipal = "waiters_per_principal"
	LimitStreamsPerPrincipal = "streams_per_principal"
	LimitStreamsTotal        = "streams_total"
)

// Tenant names who a caller is for the bounds that keep one caller from
// starving the others (waiters, streams, the memory store's room): a hash
// of its principal, never the raw value. Callers with no principal are one
// tenant, "", whatever their sessions: a session costs nothing to open, so
// anonymous callers share the anonymous share.
func Tenant(principal string) string {
	if principal == "" {
		return ""
	}
	h := sha256.Sum256([]byte("tenant\x00" + principal))
	return hex.EncodeToString(h[:16])
}

// waiters counts the duplicates waiting on calls in flight, by key and by
// tenant.
type waiters struct {
	mu        sync.Mutex
	byKey     map[string]int
	byTenant  map[string]int
	maxKey    int
	maxTenant int
}

func newWaiters(maxKey, maxTenant int) *waiters {
	if maxKey == 0 {
		maxKey = DefaultMaxWaitersPerKey
	}
	if maxTenant == 0 {
		maxTenant = DefaultMaxWaitersPerPrincipal
	}
	return &waiters{byKey: make(map[string]int), byTenant: make(map[string]int), maxKey: maxKey, maxTenant: maxTenant}
}

// acquire takes a waiter's slot, or returns the limit it is over (a
// negative bound is no bound).
func (w *waiters) acquire(key, tenant string) (release func(), over string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.maxKey > 0 && w.byKey[key] >= w.maxKey {
		return nil, LimitWaitersPerKey
	}
	if w.maxTenant > 0 && w.byTenant[tenant] >= w.maxTenant {
		return nil, LimitWaitersPerPrincipal
	}
	w.byKey[key]++
	w.byTenant[tenant]++
	return sync.OnceFunc(func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.byKey[key]--; w.byKey[key] == 0 {
			delete(w.byKey, key)
		}
		if w.byTenant[tenant]--; w.byTenant[tenant] == 0 {
			delete(w.byTenant, tenant)
		}
	}), ""
}

// Waiting reports how many duplicates wait on calls in flight.
func (e *Engine) Waiting() int {
	e.waiters.mu.Lock()
	defer e.waiters.mu.Unlock()
	n := 0
	for _, c := range e.waiters.byKey {
		n += c
	}
	return n
}

func (e *Engine) tooManyWaiters(p *Plan, limit string) error {
	e.countCall(OutcomeRejected, p.Tool)
	e.metrics.OverLimit.WithLabelValues(limit).Inc()
	var msg string
	if limit == LimitWaitersPerKey {
		msg = fmt.Sprintf("too many calls are already waiting for the call to %q with this key (%d, --max-waiters-per-key); it is still running and was not run again: retry later to get its result", p.Tool, e.waiters.maxKey)
	} else {
		msg = fmt.Sprintf("this caller already has too many calls waiting for calls in flight (%d, --max-waiters-per-principal); the call to %q was not run: retry later", e.waiters.maxTenant, p.Tool)
	}
	return &Error{Code: mcpmsg.CodeOverloaded, Message: msg}
}
