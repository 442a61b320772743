package engine

import (
	"encoding/json"
	"sync"
	"time"

	"github.com/idemcp/idemcp/sidecar/mcpmsg"
)

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

// ToolHints remembers each tool's readOnlyHint as the server announced it,
// in tools/list responses that passed through or in the listings of a
// Learner. A tool not known counts as not read-only, so Auto errs on the
// side of deduplicating.
type ToolHints struct {
	mu       sync.RWMutex
	readOnly map[string]bool

	learner Learner
	wait    time.Duration
	unknown func(tool string)
}

// NewToolHints returns an empty set of hints.
func NewToolHints() *ToolHints { return &ToolHints{readOnly: make(map[string]bool)} }

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
	h.mu.RLock()
	ro, known := h.readOnly[tool]
	learner, wait, unknown := h.learner, h.wait, h.unknown
	h.mu.RUnlock()
	if known {
		return ro
	}
	if learner != nil {
		timer := time.NewTimer(wait)
		select {
		case <-learner.Learn(tool):
		case <-timer.C:
		}
		timer.Stop()
		h.mu.RLock()
		ro, known = h.readOnly[tool]
		h.mu.RUnlock()
		if known {
			return ro
		}
	}
	if unknown != nil {
		unknown(tool)
	}
	return false
}

// Known reports whether a listing named the tool.
func (h *ToolHints) Known(tool string) bool {
	h.mu.RLock()
	defer h.mu.RUnlock()
	_, ok := h.readOnly[tool]
	return ok
}

// ObserveListResult learns from the result of a tools/list response, read
// with the strict decoder: an ambiguous tool entry teaches nothing. It
// returns the page's nextCursor.
func (h *ToolHints) ObserveListResult(result json.RawMessage) string {
	tools, next, err := mcpmsg.DecodeToolsList(result)
	if err != nil {
		return ""
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, t := range tools {
		if _, known := h.readOnly[t.Name]; !known && len(h.readOnly) >= maxHints {
			continue
		}
		h.readOnly[t.Name] = t.ReadOnly
	}
	return next
}
