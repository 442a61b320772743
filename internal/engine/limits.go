package engine

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync"

	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// Default bounds on duplicates waiting for a call in flight. A waiter holds
// a goroutine, a client connection and a store subscription until the
// first call ends: without a bound, one caller retrying a slow call in a
// loop would hold as many as it cares to open.
const (
	DefaultMaxWaitersPerKey       = 1024
	DefaultMaxWaitersPerPrincipal = 4096
)

// Default bounds on the deduplicated calls running upstream at once. A
// call runs detached from its client (design rule 3): a client that starts
// a call and hangs up at once frees its stream, while the call goes on
// holding a goroutine, a connection to the MCP server, its request and up
// to maxResultBytes of response. Without a bound, one caller looping on
// start-and-hang-up would hold as many as it cares to start. The total
// matters as much as the per-principal one: a principal is a header value,
// and a caller that sends a new one each time is a new principal. A call
// running costs the sidecar about 110 KiB (TestHostileCallers), so the
// default total keeps them within about 56 MiB of the injected sidecar's
// 128Mi limit.
const (
	DefaultMaxRunningPerPrincipal = 128
	DefaultMaxRunning             = 512
)

// Labels of idemcp_over_limit_total.
const (
	LimitWaitersPerKey       = "waiters_per_key"
	LimitWaitersPerPrincipal = "waiters_per_principal"
	LimitStreamsPerPrincipal = "streams_per_principal"
	LimitStreamsTotal        = "streams_total"
	LimitRunningPerPrincipal = "running_per_principal"
	LimitRunningTotal        = "running_total"
	LimitToolsListBuffers    = "tools_list_buffers"
	// LimitToolsListContexts: a listing in a caller's context not made
	// because the listings in flight were at their bound.
	LimitToolsListContexts = "tools_list_contexts"
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

// running counts the calls running upstream (claims won, and calls
// forwarded undeduplicated under FailOpen), by tenant and in all.
type running struct {
	mu        sync.Mutex
	byTenant  map[string]int
	total     int
	maxTenant int
	maxTotal  int
}

func newRunning(maxTenant, maxTotal int) *running {
	if maxTenant == 0 {
		maxTenant = DefaultMaxRunningPerPrincipal
	}
	if maxTotal == 0 {
		maxTotal = DefaultMaxRunning
	}
	return &running{byTenant: make(map[string]int), maxTenant: maxTenant, maxTotal: maxTotal}
}

// acquire takes a running call's slot, or returns the limit it is over (a
// negative bound is no bound).
func (r *running) acquire(tenant string) (release func(), over string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.maxTenant > 0 && r.byTenant[tenant] >= r.maxTenant {
		return nil, LimitRunningPerPrincipal
	}
	if r.maxTotal > 0 && r.total >= r.maxTotal {
		return nil, LimitRunningTotal
	}
	r.byTenant[tenant]++
	r.total++
	return sync.OnceFunc(func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.byTenant[tenant]--; r.byTenant[tenant] == 0 {
			delete(r.byTenant, tenant)
		}
		r.total--
	}), ""
}

// Running reports how many deduplicated calls run upstream, detached ones
// included.
func (e *Engine) Running() int {
	e.running.mu.Lock()
	defer e.running.mu.Unlock()
	return e.running.total
}

// startRunning takes a running slot for p, or returns the -32017 error to
// answer (counted) when its caller or the sidecar is over its bound.
func (e *Engine) startRunning(p *Plan) (func(), error) {
	release, over := e.running.acquire(p.Tenant)
	if over == "" {
		e.metrics.Running.Inc()
		return sync.OnceFunc(func() { release(); e.metrics.Running.Dec() }), nil
	}
	e.countCall(OutcomeRejected, p.Tool)
	e.metrics.OverLimit.WithLabelValues(over).Inc()
	msg := fmt.Sprintf("this caller already has %d calls running through the idemcp sidecar (--max-running-per-principal), counting those its clients left; the call to %q was not run: retry later", e.running.maxTenant, p.Tool)
	if over == LimitRunningTotal {
		msg = fmt.Sprintf("the idemcp sidecar already has %d calls running (--max-running), counting those their clients left; the call to %q was not run: retry later", e.running.maxTotal, p.Tool)
	}
	return nil, &Error{Code: mcpmsg.CodeOverloaded, Message: msg}
}
