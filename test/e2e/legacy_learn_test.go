package e2e_test

import "testing"

// TestLegacySSEToolsLearnedBySidecar: in front of a server that speaks
// only legacy HTTP+SSE (2024-11-05), the sidecar lists the tools itself
// over that transport (its Streamable HTTP listing is refused), so a
// client that never calls tools/list still gets get_balance
// (readOnlyHint) fresh each time under Auto, while charge_card (no
// annotations) runs once.
func TestLegacySSEToolsLearnedBySidecar(t *testing.T) {
	h := newLegacyHarness(t, "")
	cs := h.connect(t, h.proxy.URL, nil)
	args := map[string]any{"card": "4242", "amount": 10}
	for i := range 2 {
		if res := mustCall(t, cs, "get_balance", args, nil); replayed(res) {
			t.Errorf("get_balance call %d (readOnlyHint) was replayed", i+1)
		}
		mustCall(t, cs, "charge_card", args, nil)
	}
	if n := h.srv.Counts.Get("get_balance"); n != 2 {
		t.Errorf("get_balance ran %d times, want 2: the sidecar did not learn its readOnlyHint over legacy SSE", n)
	}
	if n := h.srv.Counts.Get("charge_card"); n != 1 {
		t.Errorf("charge_card ran %d times, want 1", n)
	}
}
