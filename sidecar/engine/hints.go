package engine

import (
	"encoding/json"
	"sync"
)

// maxHints bounds what is learned from tools/list: a server with more
// tools than this is unusual, and a hostile one must not grow our memory.
const maxHints = 10_000

// ToolHints remembers each tool's readOnlyHint as the server announced it in
// tools/list responses that passed through. A tool not seen yet counts as
// not read-only, so Auto errs on the side of deduplicating.
type ToolHints struct {
	mu       sync.RWMutex
	readOnly map[string]bool
}

// NewToolHints returns an empty set of hints.
func NewToolHints() *ToolHints { return &ToolHints{readOnly: make(map[string]bool)} }

// ReadOnly reports whether the server said the tool is read-only.
func (h *ToolHints) ReadOnly(tool string) bool {
	h.mu.RLock()
	defer h.mu.RUnlock()
	return h.readOnly[tool]
}

// ObserveListResult learns from the result of a tools/list response.
func (h *ToolHints) ObserveListResult(result json.RawMessage) {
	var res struct {
		Tools []struct {
			Name        string `json:"name"`
			Annotations *struct {
				ReadOnlyHint *bool `json:"readOnlyHint"`
			} `json:"annotations"`
		} `json:"tools"`
	}
	if json.Unmarshal(result, &res) != nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, t := range res.Tools {
		ro := t.Annotations != nil && t.Annotations.ReadOnlyHint != nil && *t.Annotations.ReadOnlyHint
		if _, known := h.readOnly[t.Name]; !known && len(h.readOnly) >= maxHints {
			continue
		}
		h.readOnly[t.Name] = ro
	}
}
