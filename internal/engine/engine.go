// Package engine is the deduplication engine: it decides which tools/call
// requests are deduplicated, derives their keys, claims them in a store,
// runs the first call detached from its client and replays the stored
// response to every retry. Transports (Streamable HTTP, legacy SSE, stdio)
// parse messages and move bytes; all decisions are made here.
package engine

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/claim"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/tracing"
)

// Error is an idemcp error answered to the client as a JSON-RPC error.
// Nothing was forwarded upstream when an Error is returned.
type Error struct {
	Code    int
	Message string
}

func (e *Error) Error() string { return e.Message }

// ErrDetached is returned when the client went away while the call it
// started goes on upstream; its result is stored for the retry.
var ErrDetached = errors.New("client went away; the call goes on and its result is kept for the retry")

// Engine is safe for concurrent use. Its policy can be swapped at any time.
type Engine struct {
	policy  atomic.Pointer[policy.Policy]
	store   store.Store
	claims  *claim.Protocol
	hints   *ToolHints
	metrics *Metrics
	log     *slog.Logger
	tracing Tracing

	instance string
	pod      string
	seq      atomic.Uint64
	// keySpace is the MCP server the keys belong to (see Options.KeySpace).
	keySpace string
	// earlier are the policies in force before the current one, newest
	// first, while records made under them may still be kept (history.go).
	earlier atomic.Pointer[[]earlierPolicy]
	// legacy is what the controller said of keys without the key space
	// (nil: none are wanted; legacy.go).
	legacy atomic.Pointer[LegacyKeys]

	unscoped     atomic.Uint64
	unscopedOnce sync.Once

	waiters *waiters
	running *running
}

// Options configure an Engine.
type Options struct {
	Policy  *policy.Policy
	Store   store.Store
	Metrics *Metrics
	Logger  *slog.Logger
	// MaxWaitersPerKey and MaxWaitersPerPrincipal bound the duplicates
	// waiting on calls in flight (inFlight: Wait): for one key, and for
	// one principal (callers with no principal count as one). Over either
	// bound a call is answered mcpmsg.CodeOverloaded and nothing runs.
	// 0 means the defaults; a negative value, no bound.
	MaxWaitersPerKey       int
	MaxWaitersPerPrincipal int
	// Pod names this sidecar's pod in the claims it makes, for kubectl
	// idemcp keys ("" outside a pod).
	Pod string
	// MaxRunningPerPrincipal and MaxRunning bound the calls running
	// upstream, those whose client left included: for one principal, and
	// for all callers. Over either bound a call that won its claim
	// releases it unrun and is answered mcpmsg.CodeOverloaded. 0 means
	// the defaults; a negative value, no bound.
	MaxRunningPerPrincipal int
	MaxRunning             int
	// KeySpace names the MCP server whose calls these are: a workload
	// (Deployment/api), or the name several workloads share as one server
	// (idemcp.io/key-space). It is part of every key, so two servers under
	// one policy and one store never replay each other's results. "": the
	// keys of a sidecar with no workload (run by hand, whose store prefix
	// names its upstream instead).
	KeySpace string
	// Tracing says which calls get a span, and where it goes (none: no
	// call).
	Tracing Tracing
}

// New returns an engine.
func New(o Options) *Engine {
	e := &Engine{store: o.Store, hints: NewToolHints(), metrics: o.Metrics, log: o.Logger, pod: o.Pod, keySpace: o.KeySpace, tracing: o.Tracing,
		waiters: newWaiters(o.MaxWaitersPerKey, o.MaxWaitersPerPrincipal),
		running: newRunning(o.MaxRunningPerPrincipal, o.MaxRunning)}
	if e.metrics == nil {
		e.metrics = NewMetrics(nil)
	}
	if e.log == nil {
		e.log = slog.New(slog.DiscardHandler)
	}
	p := o.Policy
	if p == nil {
		p = policy.Default()
	}
	e.policy.Store(p)
	e.claims = claim.New(claim.Options{
		Store:      e.store,
		Log:        e.log,
		StoreError: func(op string) { e.metrics.StoreErrors.WithLabelValues(op).Inc() },
		Panicked:   e.panicked,
		PanicAnswer: func(h claim.Held, _ any) error {
			// Whatever ran upstream, its outcome is unknown: the claim is
			// neither stored nor released, its lease runs out and
			// onAbandoned decides what a retry gets.
			e.log.Error("A call's outcome is unknown: its claim is kept until its lease runs out, then onAbandoned decides", "tool", h.Tool)
			return &Error{Code: mcpmsg.CodeInternalError, Message: fmt.Sprintf(
				"idemcp failed while relaying or storing the call to %q, so its outcome is unknown; a retry after leaseDuration (%s) is decided by onAbandoned", h.Tool, h.Lease)}
		},
	})
	var b [8]byte
	_, _ = rand.Read(b[:])
	e.instance = hex.EncodeToString(b[:])
	return e
}

// Policy returns the policy in force.
func (e *Engine) Policy() *policy.Policy { return e.policy.Load() }

// SetPolicy swaps the policy atomically; calls already planned finish
// under the policy they started with. The policy replaced is remembered
// while records made under it may be kept, so that a retry whose key the
// change moved still finds its first call's result (history.go).
func (e *Engine) SetPolicy(p *policy.Policy) {
	old := e.policy.Swap(p)
	if old != nil && old.Hash != p.Hash {
		e.remember(old, time.Now())
	}
}

// KeySpace is the MCP server the engine's keys belong to.
func (e *Engine) KeySpace() string { return e.keySpace }

// Hints are the tool annotations learned from tools/list.
func (e *Engine) Hints() *ToolHints { return e.hints }

// Metrics returns the engine's counters.
func (e *Engine) Metrics() *Metrics { return e.metrics }

// Deduplicates reports whether calls to tool are deduplicated under the
// policy in force, resolving Auto with the server's annotations (see
// classify). A call it passes through is counted by reason here, as it
// never reaches Plan.
func (e *Engine) Deduplicates(tool string) bool {
	dedup, reason := e.classify(e.policy.Load().RuleFor(tool), tool, nil)
	if !dedup {
		e.countClassified(dedup, reason)
	}
	return dedup
}

// CountPassthrough counts a tools/call to tool forwarded without
// deduplication that the transport did not hand to Plan (Plan counts its own).
func (e *Engine) CountPassthrough(tool string) { e.countCall(OutcomePassthrough, tool) }

// countCall counts a tools/call to tool in idemcp_tool_calls_total and, by
// tool, in idemcp_tool_calls_by_tool_total.
func (e *Engine) countCall(outcome, tool string) {
	e.metrics.Calls.WithLabelValues(outcome).Inc()
	e.metrics.CallsByTool.WithLabelValues(e.metrics.toolLabel(tool, e.hints.Known(tool)), outcome).Inc()
}

// Unscoped reports how many calls were forwarded without deduplication
// because their key would have had no scope (see Plan).
func (e *Engine) Unscoped() uint64 { return e.unscoped.Load() }

// UnscopedCalls is Unscoped for the policy stream's acknowledgement, which
// reports it to the operator (policysync.UnscopedCounter).
func (e *Engine) UnscopedCalls() uint64 { return e.Unscoped() }

// unscopedCall reports whether a key derived from arguments would have no
// scope: under Session scope a caller with neither session nor principal,
// under Principal scope a caller with no principal. Such a key would be
// shared by every anonymous caller, so two different agents would get one
// execution between them.
func unscopedCall(r *policy.Rule, c Caller) bool {
	switch r.KeyScope {
	case v1alpha1.ScopeGlobal:
		return false
	case v1alpha1.ScopePrincipal:
		return c.Principal == ""
	default:
		return c.Principal == "" && c.Session == ""
	}
}

// explicitScoped reports whether an explicit key has a scope: a caller
// with neither principal nor session would share it with every other
// anonymous caller, who could then read its result by guessing the key.
func explicitScoped(r *policy.Rule, c Caller) bool {
	_, ok := explicitScope(r, c)
	return ok
}

func (e *Engine) countUnscoped(p *policy.Policy, r *policy.Rule, tool string, session bool) {
	e.unscoped.Add(1)
	e.countCall(OutcomeUnscoped, tool)
	e.unscopedOnce.Do(func() {
		who := "A call with no session and no principal"
		if r.KeyScope == v1alpha1.ScopePrincipal && session {
			// A session does not scope a derived key under keyScope:
			// Principal (it does scope an explicit one).
			who = "A call with no principal (keyScope: Principal; a session does not scope its derived key)"
		}
		e.log.Warn(who+" was forwarded without deduplication: two anonymous callers must never share one execution. "+
			"Send the "+p.PrincipalHeader+" header (or set principalHeader to a header your gateway sets), or choose keyScope: Global knowingly (an explicit idempotency key needs a principal or a session too); "+
			"further such calls are only counted in idemcp_tool_calls_total{outcome=\"unscoped\"}",
			"tool", tool, "keyScope", r.KeyScope)
	})
}

// waits are how a call waits for a claim on key that another holds: the
// policy's waitTimeout and inFlight, and admission under the waiter bounds
// (maxWaitersPerKey, maxWaitersPerPrincipal), whichever key it waits on.
func (e *Engine) waits(p *Plan, key string) claim.Waits {
	return claim.Waits{
		Timeout: p.Policy.WaitTimeout,
		Reject:  p.Policy.InFlight == v1alpha1.InFlightReject,
		Admit: func() (func(), error) {
			stopWaiting, over := e.waiters.acquire(key, p.Tenant)
			if over != "" {
				return nil, e.tooManyWaiters(p, over)
			}
			return stopWaiting, nil
		},
	}
}

// Plan is a tools/call the engine will deduplicate.
type Plan struct {
	Tool        string
	Key         string
	Fingerprint string
	Explicit    bool
	Rule        *policy.Rule
	Policy      *policy.Policy
	// caller is who sent the call: the session a task it creates belongs
	// to is named from it (sessionHash), only when a task is involved.
	caller Caller
	// Tenant is who the caller is for the bounds that keep one caller from
	// starving the others (see engine.Tenant).
	Tenant string
	// earlier are the keys and fingerprints the same call had under the
	// policies in force before this one, where they differ (history.go).
	earlier []earlierKey
}

// Plan decides whether a tools/call is deduplicated. It returns nil (and no
// error) for a call to forward untouched, counted as passthrough or
// unscoped, and an *Error for a call to refuse without forwarding (a bad
// explicit key, unparseable arguments).
func (e *Engine) Plan(tc *ToolCall, c Caller) (*Plan, error) {
	return e.PlanCall(context.Background(), tc, c)
}

// PlanCall is Plan for a call whose span StartCall put in ctx: the span
// records what was decided.
func (e *Engine) PlanCall(ctx context.Context, tc *ToolCall, c Caller) (*Plan, error) {
	p := e.policy.Load()
	rule := p.RuleFor(tc.Name)
	dedup, reason := e.classify(rule, tc.Name, c.Listing)
	e.countClassified(dedup, reason)
	tracePlan(ctx, p, rule, reason)
	if !dedup {
		// A key on a call that is not deduplicated means nothing to us;
		// the server gets the call exactly as sent.
		e.CountPassthrough(tc.Name)
		traceOutcome(ctx, tracing.OutcomePassthrough)
		return nil, nil
	}
	explicit, err := ExplicitKey(c, tc.Meta)
	if err != nil {
		e.countCall(OutcomeRejected, tc.Name)
		traceOutcome(ctx, tracing.OutcomeRejected)
		return nil, err
	}
	if explicit == "" && unscopedCall(rule, c) || explicit != "" && !explicitScoped(rule, c) {
		e.countUnscoped(p, rule, tc.Name, c.Session != "")
		traceOutcome(ctx, tracing.OutcomeUnscoped)
		return nil, nil
	}
	fp, err := Fingerprint(tc.Name, tc.Arguments, rule.IgnoreArguments)
	if err != nil {
		e.countCall(OutcomeRejected, tc.Name)
		traceOutcome(ctx, tracing.OutcomeRejected)
		return nil, err
	}
	space, other, alt := e.keySpaces(time.Now())
	plan := &Plan{
		Tool:        tc.Name,
		Key:         deriveKey(space, rule, c, explicit, fp),
		earlier:     e.earlierKeys(tc, c, explicit, space, other, alt),
		Fingerprint: fp,
		Explicit:    explicit != "",
		Rule:        rule,
		Policy:      p,
		caller:      c,
		Tenant:      Tenant(c.Principal),
	}
	traceKey(ctx, plan)
	return plan, nil
}

// Upstream is what the transport got from the MCP server for one call.
type Upstream struct {
	// Response is the final JSON-RPC response message, or nil if the
	// server sent none.
	Response []byte
	// Valid says the transport has already checked that Response is JSON
	// (json.Valid), so settling does not scan a large result again.
	Valid bool
	// Status is the HTTP status (0 for transports without one); anything
	// but 2xx releases the key.
	Status int
	// TooLarge reports a response the transport relayed but could not keep
	// (over its buffer); Size is how large it was. The call ran: retries get
	// an error instead of running it again.
	TooLarge bool
	Size     int64
	// Later, when set, says the outcome is pending: the client's response
	// is over, but the call's own response comes later (a 2025-11-25 server
	// that closed the stream after an event id, to be resumed). The engine
	// answers the client, then calls Later once, detached, and settles with
	// what it returns.
	Later func(ctx context.Context) (Upstream, error)
}

// keyConflict is the answer to an explicit key reused with other arguments.
func keyConflict(tool string) *Error {
	return &Error{Code: mcpmsg.CodeKeyConflict, Message: fmt.Sprintf(
		"idempotency key conflict: this key was already used for a call with different arguments (tool %q); use a new key for a new operation", tool)}
}

// ErrOutcomeUnknown is returned by a Forward or a Later when the call may
// have run but its response cannot be had: the claim is neither completed
// nor released. It lapses at the end of its lease, and onAbandoned decides
// what the next call with its key gets.
var ErrOutcomeUnknown = errors.New("outcome unknown")

// Forward sends the call upstream and relays whatever the server streams
// back (progress, server-to-client requests, the response itself) to the
// client as it arrives. It runs detached from the client: ctx is not
// cancelled when the client goes away.
type Forward func(ctx context.Context) (Upstream, error)

// Kind says how a deduplicated call was answered.
type Kind int

const (
	// Executed means this call ran upstream; Forward already relayed its response.
	Executed Kind = iota + 1
	// Replayed means Response holds a stored response for the transport to send
	// with the caller's id (mcpmsg.WithID).
	Replayed
	// ForwardedOpen means the store was unreachable and the policy says
	// FailOpen; Forward relayed the response, nothing was deduplicated.
	ForwardedOpen
)

// Outcome is how a deduplicated call was answered.
type Outcome struct {
	Kind     Kind
	Response []byte
}

// Execute runs a planned call exactly once across every caller that shares
// its key. It returns an *Error to answer without forwarding, or
// ErrDetached if ctx ended while this call was running upstream.
func (e *Engine) Execute(ctx context.Context, p *Plan, fwd Forward) (Outcome, error) {
	start := time.Now()
	if out, err, found := e.findEarlier(ctx, p, fwd); found {
		return out, err
	}
	owner := e.instance + "-" + strconv.FormatUint(e.seq.Add(1), 36)
	c := store.Claim{
		Key:         p.Key,
		Fingerprint: p.Fingerprint,
		Owner:       owner,
		Lease:       p.Policy.LeaseDuration,
		Retention:   p.pendingRetention(),
		TakeOver:    p.Rule.OnAbandoned != v1alpha1.AbandonedError,
		Tenant:      p.Tenant,
		Tool:        p.Tool,
		Pod:         e.pod,
	}
	waits := e.waits(p, p.Key)
	r, err := e.claims.Reserve(ctx, c, waits)
	switch {
	case err == nil:
	case errors.Is(err, claim.ErrConflict):
		// Stores never take over a claim of other arguments (the store
		// contract): an explicit key reused with them is refused, whether
		// its first call completed, runs or was abandoned.
		e.countCall(OutcomeRejected, p.Tool)
		traceOutcome(ctx, tracing.OutcomeConflict)
		return Outcome{}, keyConflict(p.Tool)
	case errors.Is(err, claim.ErrInFlight):
		e.countCall(OutcomeRejected, p.Tool)
		traceOutcome(ctx, tracing.OutcomeInFlight)
		return Outcome{}, &Error{Code: mcpmsg.CodeInFlight, Message: fmt.Sprintf(
			"a call to %q with this key is still running; retry later to get its result", p.Tool)}
	case errors.Is(err, claim.ErrWaitTimeout):
		e.countCall(OutcomeRejected, p.Tool)
		traceOutcome(ctx, tracing.OutcomeInFlight)
		return Outcome{}, &Error{Code: mcpmsg.CodeInFlight, Message: fmt.Sprintf(
			"a call to %q with this key is still running after waiting %s (waitTimeout); retry later to get its result", p.Tool, p.Policy.WaitTimeout)}
	default:
		if unavailable := (*claim.UnavailableError)(nil); errors.As(err, &unavailable) {
			if unavailable.Held {
				// The store said another call holds this key: never
				// forward a second one, whatever onStoreUnavailable says.
				traceOutcome(ctx, tracing.OutcomeInFlight)
				return Outcome{}, e.stillRunning(p, unavailable.Err)
			}
			traceOutcome(ctx, tracing.OutcomeStoreUnavailable)
			return e.storeUnavailable(ctx, p, fwd, unavailable.Err)
		}
		// ctx's error, or too many waiters (already counted).
		traceOutcome(ctx, tracing.OutcomeRejected)
		return Outcome{}, err
	}
	switch r.State {
	case store.Won:
		stopRunning, err := e.startRunning(p)
		if err != nil {
			// Nothing ran: the claim goes, so that a retry once the
			// caller is under its bound runs the call (and, under
			// onAbandoned: Error, is not answered "outcome unknown").
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			if rerr := e.store.Release(rctx, p.Key, owner); rerr != nil {
				e.metrics.StoreErrors.WithLabelValues("release").Inc()
			}
			return Outcome{}, err
		}
		if r.TookOver {
			e.metrics.TakeOvers.Inc()
			e.log.Warn("Took over an abandoned claim", "tool", p.Tool, "key", p.Key)
			traceReplay(ctx, trace.SpanContext{}, true)
		}
		return e.run(ctx, p, owner, start, fwd, stopRunning)
	case store.Completed:
		session, resp := taskSession(r.Response)
		if session != "" && session != sessionHash(p.caller) {
			e.countCall(OutcomeRejected, p.Tool)
			traceOutcome(ctx, tracing.OutcomeRejected)
			return Outcome{}, &Error{Code: mcpmsg.CodeTaskElsewhere, Message: fmt.Sprintf(
				"the first call to %q with this key created a task in another MCP session, and a task can be read only in the session that created it; it is not run again. Read the task from that session, or use a new key to start a new one", p.Tool)}
		}
		e.countCall(OutcomeReplayed, p.Tool)
		if r.Waited {
			traceOutcome(ctx, tracing.OutcomeWaited)
		} else {
			traceOutcome(ctx, tracing.OutcomeReplayed)
		}
		traceReplay(ctx, r.Execution, false)
		return Outcome{Kind: Replayed, Response: withExecution(resp, r.Execution)}, nil
	default: // store.Abandoned
		e.countCall(OutcomeRejected, p.Tool)
		traceOutcome(ctx, tracing.OutcomeOutcomeUnknown)
		return Outcome{}, &Error{Code: mcpmsg.CodeOutcomeUnknown, Message: fmt.Sprintf(
			"outcome unknown: the first call to %q with this key stopped mid-call (its sidecar died) and onAbandoned is Error, so it is not run again; check whether it took effect", p.Tool)}
	}
}

// stillRunning answers a duplicate whose first call holds the key when the
// store stops answering.
func (e *Engine) stillRunning(p *Plan, err error) error {
	e.countCall(OutcomeRejected, p.Tool)
	return &Error{Code: mcpmsg.CodeInFlight, Message: fmt.Sprintf(
		"a call to %q with this key is running, and the idempotency store became unreachable while waiting for it (%v); retry later to get its result", p.Tool, err)}
}

func (e *Engine) storeUnavailable(ctx context.Context, p *Plan, fwd Forward, err error) (Outcome, error) {
	if p.Policy.OnStoreUnavailable == v1alpha1.FailOpen {
		e.log.Warn("Store unavailable, forwarding without deduplication (FailOpen)", "tool", p.Tool, "err", err)
		stopRunning, err := e.startRunning(p)
		if err != nil {
			return Outcome{}, err
		}
		e.countCall(OutcomeFailedOpen, p.Tool)
		traceForwarded(ctx)
		up, ferr := fwd(ctx)
		if ferr != nil {
			stopRunning()
			return Outcome{}, ferr
		}
		if up.Later != nil {
			// Nothing is stored, but Later holds resources until it ends.
			done := e.claims.Track()
			go func() {
				defer done()
				defer stopRunning()
				_, _ = up.Later(context.WithoutCancel(ctx))
			}()
		} else {
			stopRunning()
		}
		return Outcome{Kind: ForwardedOpen}, nil
	}
	e.log.Error("Store unavailable, refusing the call (FailClosed)", "tool", p.Tool, "err", err)
	e.countCall(OutcomeRejected, p.Tool)
	return Outcome{}, &Error{Code: mcpmsg.CodeStoreUnavailable, Message: fmt.Sprintf(
		"the idempotency store is unreachable (%v); %q was not called (onStoreUnavailable: FailClosed); retry later", err, p.Tool)}
}

// run executes the call this owner won, detached from ctx: a client that
// disconnects or cancels does not stop it, and its result is stored.
// start is when Execute began: the time until the call is forwarded is
// what idemcp added to it (idemcp_added_latency_seconds). stopRunning is
// called once the call is settled.
func (e *Engine) run(ctx context.Context, p *Plan, owner string, start time.Time, fwd Forward, stopRunning func()) (Outcome, error) {
	held := claim.Held{Key: p.Key, Owner: owner, Lease: p.Policy.LeaseDuration, Tool: p.Tool}
	traceOutcome(ctx, tracing.OutcomeExecuted)
	var began atomic.Bool
	err := e.claims.Run(ctx, held, func(runCtx context.Context, answer func(error)) {
		began.Store(true)
		defer stopRunning()
		e.metrics.AddedLatency.Observe(time.Since(start).Seconds())
		traceForwarded(runCtx)
		up, err := fwd(runCtx)
		if err == nil && up.Later != nil {
			// The client's part is over (it resumes on its own); the
			// outcome comes later.
			answer(nil)
			up, err = up.Later(runCtx)
		}
		firstTried := func() { answer(err) }
		if p.Policy.InFlight != v1alpha1.InFlightReject {
			// The client has its response: answer it now and store after.
			// A retry arriving meanwhile finds the claim pending and waits
			// the moment it takes.
			answer(err)
		}
		// Under Reject, a retry right after the answer must find the
		// result, not a claim it would be refused for: answer once the
		// first attempt to store is made.
		e.settle(runCtx, p, owner, up, err, firstTried)
	})
	if !began.Load() && !errors.Is(err, claim.ErrDetached) {
		stopRunning() // Run refused the claim: body never ran
	}
	switch {
	case errors.Is(err, claim.ErrDetached):
		e.countCall(OutcomeExecuted, p.Tool)
		return Outcome{}, ErrDetached
	case err != nil:
		return Outcome{}, err
	}
	e.countCall(OutcomeExecuted, p.Tool)
	return Outcome{Kind: Executed}, nil
}

// Recover stops a panic from ending the process when deferred at the top
// of a goroutine that handles a call: no input from a client or a server
// may. It logs the panic with its stack and counts it in
// idemcp_panics_total{where}.
func (e *Engine) Recover(where string) {
	if v := recover(); v != nil {
		e.panicked(where, v)
	}
}

// Go runs fn on a new goroutine that recovers from a panic (see Recover).
func (e *Engine) Go(where string, fn func()) {
	go func() {
		defer e.Recover(where)
		fn()
	}()
}

func (e *Engine) panicked(where string, v any) {
	e.metrics.Panics.WithLabelValues(where).Inc()
	e.log.Error("Recovered from a panic; the sidecar goes on", "where", where, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
}

// Track counts work a transport runs on its own goroutine for a call (a
// legacy SSE call answered 202 before it runs) until done is called, so
// Drain waits for it too. Call it before the handler that starts the work
// returns.
func (e *Engine) Track() (done func()) { return e.claims.Track() }

// Drain waits until every call running upstream has finished and its
// result is stored or released, or ctx ends. A sidecar drains before it
// exits so that a detached call is not lost.
func (e *Engine) Drain(ctx context.Context) error { return e.claims.Drain(ctx) }

// Reasons a result is not kept (idemcp_results_not_stored_total).
const (
	ReasonTransport     = "transport_error"
	ReasonHTTPStatus    = "http_error"
	ReasonRPCError      = "jsonrpc_error"
	ReasonToolError     = "tool_error"
	ReasonInputRequired = "input_required"
	ReasonTooLarge      = "too_large"
	// ReasonOutcomeUnknown: the response could not be had; the claim lapses.
	ReasonOutcomeUnknown = "outcome_unknown"
)

// settle stores a success or releases the key so a genuine retry retries.
func (e *Engine) settle(ctx context.Context, p *Plan, owner string, up Upstream, err error, firstTried func()) {
	if errors.Is(err, ErrOutcomeUnknown) {
		// Neither complete nor release: the claim lapses with its lease,
		// and onAbandoned decides whether the next call runs.
		e.metrics.NotStored.WithLabelValues(ReasonOutcomeUnknown).Inc()
		e.log.Warn("Outcome unknown: the call's claim is left to lapse and onAbandoned decides", "tool", p.Tool, "err", err)
		firstTried()
		return
	}
	reason := ""
	var stored []byte
	switch {
	case err != nil:
		reason = ReasonTransport
	case up.Status != 0 && (up.Status < 200 || up.Status > 299):
		reason = ReasonHTTPStatus
	case up.TooLarge:
		stored, reason = tooLargeMarker(p, int(up.Size)), ReasonTooLarge
	case up.Response == nil:
		reason = ReasonTransport
	default:
		stored, reason = e.replayableChecked(p, up.Response, up.Valid)
	}
	if reason != "" && reason != ReasonTooLarge {
		e.metrics.NotStored.WithLabelValues(reason).Inc()
		if rerr := e.claims.Release(ctx, p.Key, owner, firstTried); rerr != nil {
			e.storeWriteFailed("release", p, rerr)
		}
		return
	}
	if reason == ReasonTooLarge {
		e.metrics.NotStored.WithLabelValues(reason).Inc()
		e.log.Warn("Result over maxResultBytes was forwarded but not stored; retries get an error, not a second run",
			"tool", p.Tool, "bytes", len(up.Response), "maxResultBytes", p.Policy.MaxResultBytes)
	}
	if cerr := e.claims.CompleteJSON(ctx, p.Key, owner, stored, p.keepFor(), firstTried); cerr != nil {
		e.storeWriteFailed("complete", p, cerr)
	}
}

func (e *Engine) storeWriteFailed(op string, p *Plan, err error) {
	if errors.Is(err, claim.ErrProbablyApplied) {
		e.log.Warn("Store write retried after an error; the earlier attempt most likely applied", "tool", p.Tool, "op", op)
		return
	}
	if errors.Is(err, store.ErrNotOwner) {
		e.log.Error("Claim was taken over before the call finished; its result is not stored", "tool", p.Tool, "op", op)
		return
	}
	e.metrics.StoreErrors.WithLabelValues(op).Inc()
	e.log.Error("Store write failed after the call ran", "tool", p.Tool, "op", op, "err", err)
}

func tooLargeMarker(p *Plan, size int) []byte {
	msg := fmt.Sprintf("the first call to %q with this key completed, but its result (%d bytes) was over maxResultBytes (%d) and was not kept; it is not run again", p.Tool, size, p.Policy.MaxResultBytes)
	full := mcpmsg.ErrorResponse(json.RawMessage("null"), mcpmsg.CodeResultNotStored, msg)
	// Drop the id: stored responses are spliced with the caller's id.
	const prefix = `{"jsonrpc":"2.0","id":null,`
	return append([]byte(`{"jsonrpc":"2.0",`), full[len(prefix):]...)
}
