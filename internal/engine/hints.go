package engine

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
)

// Why a tools/call was deduplicated or passed through: the reason label of
// idemcp_tool_calls_classified_total.
const (
	// ByRule: a rule (or defaultMode) says Deduplicate or Passthrough.
	ByRule = "rule"
	// ByReadOnlyHint: Auto followed the tool's readOnlyHint (true:
	// passthrough; false with no idempotentHint: deduplicated).
	ByReadOnlyHint = "readOnlyHint"
	// ByIdempotentHint: Auto followed the tool's idempotentHint (true:
	// passthrough; false: deduplicated).
	ByIdempotentHint = "idempotentHint"
	// ByNoAnnotations: the server listed the tool with neither hint, so
	// Auto deduplicates it.
	ByNoAnnotations = "noAnnotations"
	// ByUnknown: no listing named the tool, so Auto deduplicates it.
	ByUnknown = "unknown"
)

// hint is what a listing said of one tool.
type hint struct {
	readOnly, idempotent       bool
	hasReadOnly, hasIdempotent bool
	// conflict: one listing named the tool twice, with different
	// annotations; Auto deduplicates it as unknown.
	conflict bool
}

// classify resolves a tool's mode: a rule's Deduplicate or Passthrough
// wins; Auto takes the server's word. readOnlyHint: true and
// idempotentHint: true pass through (running the tool again is safe, and
// a fresh answer is what the caller wants); everything else, including a
// tool the server did not annotate or did not list, is deduplicated.
func (h *ToolHints) classify(mode v1alpha1.ToolMode, tool string, lc *ListingContext) (dedup bool, reason string) {
	switch mode {
	case v1alpha1.ModeDeduplicate:
		return true, ByRule
	case v1alpha1.ModePassthrough:
		return false, ByRule
	}
	t, known := h.lookupIn(tool, lc)
	return decide(t, known)
}

// decide is Auto's decision for a tool the listings said t of.
func decide(t hint, known bool) (dedup bool, reason string) {
	switch {
	case !known || t.conflict:
		return true, ByUnknown
	case t.readOnly:
		return false, ByReadOnlyHint
	case t.idempotent:
		return false, ByIdempotentHint
	case t.hasIdempotent:
		return true, ByIdempotentHint
	case t.hasReadOnly:
		return true, ByReadOnlyHint
	default:
		return true, ByNoAnnotations
	}
}

// classify is the engine's decision for one call under rule r.
func (e *Engine) classify(r *policy.Rule, tool string, lc *ListingContext) (dedup bool, reason string) {
	return e.hints.classify(r.Mode, tool, lc)
}

// ListingContext is where a caller stands for the tools a server lists:
// the capabilities its client declared at initialize, and its
// credentials (the policy's principal header). A server may list some
// tools only to some clients; a tool the sidecar's own listing does not
// name is looked for in a listing made in the caller's context, sent to
// the sidecar's configured endpoint only, where the call itself goes.
type ListingContext struct {
	// Capabilities is the client's initialize params.capabilities (nil:
	// not known).
	Capabilities json.RawMessage
	// Header and Value are the principal header and the caller's value.
	Header, Value string
}

// ContextLearner is a Learner that can also list the tools in a caller's
// context. LearnIn returns what such a listing taught (nil: none could be
// had in time); listings are cached per distinct context, boundedly.
type ContextLearner interface {
	LearnIn(lc ListingContext) *ToolHints
}

// countClassified counts a call in idemcp_tool_calls_classified_total.
func (e *Engine) countClassified(dedup bool, reason string) {
	mode := "passthrough"
	if dedup {
		mode = "deduplicate"
	}
	e.metrics.Classified.WithLabelValues(reason, mode).Inc()
}

// ReportAnnotations logs, when it changed since the last report, which
// tools Auto deduplicates only because their server annotates them with
// neither readOnlyHint nor idempotentHint, and the rule that would pass
// them through. Reads among them are replayed for retryWindow, so a change
// made behind the proxy's back is not seen until it ends. The tool
// listings call it after each full listing.
func (e *Engine) ReportAnnotations() {
	p := e.policy.Load()
	var tools []string
	for _, name := range e.hints.unannotated() {
		if p.RuleFor(name).Mode == v1alpha1.ModeAuto {
			tools = append(tools, name)
		}
	}
	key := strings.Join(tools, "\x00")
	h := e.hints
	h.reportMu.Lock()
	changed := key != h.reported
	h.reported = key
	h.reportMu.Unlock()
	if !changed || len(tools) == 0 {
		return
	}
	e.log.Warn("The MCP server gives these tools no annotations (readOnlyHint, idempotentHint), so Auto deduplicates them all, reads included: "+
		"an identical read within retryWindow is replayed, and a change made meanwhile is not seen. Pass the tools that only read, or are safe to repeat, through with a rule",
		"tools", tools, "retryWindow", p.RetryWindow.String(), "rule", passthroughRule(tools))
}

// passthroughRule is the policy snippet that would pass tools through,
// for the operator to trim to the tools that only read.
func passthroughRule(tools []string) string {
	const most = 20
	var b strings.Builder
	b.WriteString("tools: [")
	for i, t := range tools {
		if i == most {
			fmt.Fprintf(&b, ", ... %d more", len(tools)-most)
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "{name: %q, mode: Passthrough}", t)
	}
	b.WriteString("]")
	return b.String()
}

// maxHints bounds what is learned from tools/list: a server with more
// tools than this is unusual, and a hostile one must not grow our memory.
const maxHints = 10_000

// DefaultUnknownToolWait is how long a call to a tool not seen in any
// tools/list waits for the listing that may name it.
const DefaultUnknownToolWait = 2 * time.Second

// Learner lists the server's tools on the proxy's own account (see
// sidecar/toollist), so that Auto does not depend on the client listing
// them.
type Learner interface {
	// Learn is called for a tool no listing has named. It starts a listing
	// (or joins the one running, or does nothing if one has just ended)
	// and returns a channel closed when there is nothing more to wait for.
	Learn(tool string) <-chan struct{}
}

// ToolHints remembers each tool's readOnlyHint and idempotentHint as the
// server announced them, in tools/list responses that passed through or in
// the listings of a Learner. A tool not known is deduplicated by Auto, which
// errs on that side.
type ToolHints struct {
	mu    sync.RWMutex
	tools map[string]hint

	learner Learner
	wait    time.Duration
	unknown func(tool string)

	// reported is the last list of unannotated tools ReportAnnotations
	// logged, joined.
	reportMu sync.Mutex
	reported string

	// called are tools calls named that no listing had (bounded), for the
	// policy's status; version counts the changes of what is known.
	called  map[string]struct{}
	version atomic.Uint64
}

// maxCalledUnknown bounds the unknown tools remembered for the status:
// names come from clients.
const maxCalledUnknown = 64

// NewToolHints returns an empty set of hints.
func NewToolHints() *ToolHints { return &ToolHints{tools: make(map[string]hint)} }

// SetLearner makes a call to an unknown tool ask l for a listing and wait
// for it up to wait; onUnknown (if not nil) is told of every call to a tool
// still unknown after that.
func (h *ToolHints) SetLearner(l Learner, wait time.Duration, onUnknown func(tool string)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.learner, h.wait, h.unknown = l, wait, onUnknown
}

// ReadOnly reports whether the server said the tool is read-only. For a
// tool it has not heard of, it waits (boundedly) for a listing first.
func (h *ToolHints) ReadOnly(tool string) bool {
	t, _ := h.lookup(tool)
	return t.readOnly
}

// lookup returns what the server said of the tool. For a tool it has not
// heard of, it waits (boundedly) for a listing first.
func (h *ToolHints) lookup(tool string) (hint, bool) { return h.lookupIn(tool, nil) }

// lookupIn is lookup, then, for a tool still unknown, a listing in the
// caller's context lc (when given and the learner can make one).
func (h *ToolHints) lookupIn(tool string, lc *ListingContext) (hint, bool) {
	h.mu.RLock()
	t, known := h.tools[tool]
	learner, wait, unknown := h.learner, h.wait, h.unknown
	h.mu.RUnlock()
	if known {
		return t, true
	}
	if learner != nil {
		timer := time.NewTimer(wait)
		select {
		case <-learner.Learn(tool):
		case <-timer.C:
		}
		timer.Stop()
		h.mu.RLock()
		t, known = h.tools[tool]
		h.mu.RUnlock()
		if known {
			return t, true
		}
		if cl, ok := learner.(ContextLearner); ok && lc != nil {
			if in := cl.LearnIn(*lc); in != nil {
				in.mu.RLock()
				t, known = in.tools[tool]
				in.mu.RUnlock()
				if known {
					return t, true
				}
			}
		}
	}
	if unknown != nil {
		unknown(tool)
	}
	h.mu.Lock()
	if _, seen := h.called[tool]; !seen && len(h.called) < maxCalledUnknown {
		if h.called == nil {
			h.called = map[string]struct{}{}
		}
		h.called[tool] = struct{}{}
		h.version.Add(1)
	}
	h.mu.Unlock()
	return hint{}, false
}

// Version changes whenever what the hints know changes: a listing that
// taught something new, or a call to a tool no listing named.
func (h *ToolHints) Version() uint64 { return h.version.Load() }

// Known reports whether a listing named the tool.
func (h *ToolHints) Known(tool string) bool {
	h.mu.RLock()
	defer h.mu.RUnlock()
	_, ok := h.tools[tool]
	return ok
}

// unannotated lists, sorted, the known tools the server gave neither hint.
func (h *ToolHints) unannotated() []string {
	h.mu.RLock()
	defer h.mu.RUnlock()
	var names []string
	for name, t := range h.tools {
		if !t.hasReadOnly && !t.hasIdempotent && !t.conflict {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	return names
}

// ObserveListResult learns from the result of a tools/list response, read
// with the strict decoder: an ambiguous tool entry teaches nothing, and a
// tool named twice with different annotations is taken as unknown (the
// last entry must not decide: [{delete, readOnlyHint: false}, {delete,
// idempotentHint: true}] would pass it through). It returns the page's
// nextCursor.
func (h *ToolHints) ObserveListResult(result json.RawMessage) string {
	tools, next, err := mcpmsg.DecodeToolsList(result)
	if err != nil {
		return ""
	}
	page := make(map[string]hint, len(tools))
	for _, t := range tools {
		n := hint{readOnly: t.ReadOnly, idempotent: t.Idempotent, hasReadOnly: t.HasReadOnly, hasIdempotent: t.HasIdempotent}
		if seen, dup := page[t.Name]; dup && seen != n {
			n = hint{conflict: true}
		} else if dup {
			continue
		}
		page[t.Name] = n
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for name, n := range page {
		old, known := h.tools[name]
		if !known && len(h.tools) >= maxHints {
			continue
		}
		if !known || old != n {
			h.version.Add(1)
		}
		h.tools[name] = n
		delete(h.called, name)
	}
	return next
}

// ToolDecisions is what the engine decides, under the policy in force,
// for every tool it has seen: each tool a listing named, and each tool a
// call named that none did. Those Auto deduplicates for want of
// annotations come first, then by name; at most limit are returned, with
// how many were left out. The policy stream reports them to the manager,
// which lists them in the policy's status.
func (e *Engine) ToolDecisions(limit int) (tools []policywire.Tool, omitted int) {
	p := e.policy.Load()
	h := e.hints
	h.mu.RLock()
	all := make([]policywire.Tool, 0, len(h.tools)+len(h.called))
	add := func(name string, t hint, known bool) {
		r := p.RuleFor(name)
		var dedup bool
		var reason string
		switch r.Mode {
		case v1alpha1.ModeDeduplicate:
			dedup, reason = true, ByRule
		case v1alpha1.ModePassthrough:
			dedup, reason = false, ByRule
		default:
			dedup, reason = decide(t, known)
		}
		mode := v1alpha1.ModePassthrough
		if dedup {
			mode = v1alpha1.ModeDeduplicate
		}
		all = append(all, policywire.Tool{Name: name, Mode: string(mode), Reason: reason})
	}
	for name, t := range h.tools {
		add(name, t, true)
	}
	for name := range h.called {
		add(name, hint{}, false)
	}
	h.mu.RUnlock()
	slices.SortFunc(all, func(a, b policywire.Tool) int {
		if wa, wb := warns(a.Reason), warns(b.Reason); wa != wb {
			if wa {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Name, b.Name)
	})
	if len(all) > limit {
		return all[:limit], len(all) - limit
	}
	return all, 0
}

// warns reports whether Auto deduplicates a tool for want of the
// server's word: no annotations, or not listed.
func warns(reason string) bool { return reason == ByNoAnnotations || reason == ByUnknown }

// ToolsVersion changes whenever ToolDecisions may have (but for a policy
// change, which the stream reports anyway).
func (e *Engine) ToolsVersion() uint64 { return e.hints.Version() }
