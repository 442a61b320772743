package history

import (
	"testing"
	"time"
)

// TestStalledReaderKillLongAfterStoreIsADuplicate: the sidecar wrote
// its answer at 100ms (the client's first byte) and stores the result a
// moment after; the client stalled for 2s and read it all at 2100ms. A
// kill of that sidecar at 1500ms, 1.4s after the result was stored (the
// store was in reach throughout), cannot have lost it: a re-run at 3000ms
// is a duplicate. (The classifier once counted it as lost with the sidecar,
// its window running from Answered to At+Lease.)
func TestStalledReaderKillLongAfterStoreIsADuplicate(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 4, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	for _, kill := range []int{1500, 2500} {
		h := History{Lease: time.Second, Retry: true,
			Executions:  map[string][]time.Time{"c": {at(10), at(3000)}},
			Completions: map[string][]Completion{"c": {{From: at(0), Answered: at(100), At: at(2100), Body: "a", Sidecar: 0}}},
			Kills:       []Window{{From: at(kill), To: at(2900), Sidecar: 0}}}
		if v := h.Classify(); v.Duplicates != 1 {
			t.Errorf("kill at %dms, 1.4s+ after the answer was written and stored: %+v, want 1 duplicate", kill, v)
		}
	}
}

// TestReportedTakeOverExcusesOnlyTheAnsweredCall: a sidecar's own report
// that a claim it answered under was taken over before it stored the
// result excuses the re-run after that answer (Retry's trade-off), but not
// two executions racing before any answer: a claim the store lost still
// counts as lost.
func TestReportedTakeOverExcusesOnlyTheAnsweredCall(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 4, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	reported := []Window{{From: at(0), To: at(1500), Sidecar: 0}}
	h := History{Lease: time.Second, Retry: true, Reported: reported,
		Executions:  map[string][]time.Time{"c": {at(10), at(3000)}},
		Completions: map[string][]Completion{"c": {{From: at(0), Answered: at(100), At: at(120), Body: "a", Sidecar: 0}}}}
	if v := h.Classify(); v.Duplicates != 0 || v.TakenOver != 1 {
		t.Errorf("a re-run after the owner reported its claim taken over: %+v, want 1 taken over", v)
	}
	h = History{Lease: time.Second, Retry: true, Reported: reported,
		Executions:  map[string][]time.Time{"c": {at(10), at(50)}},
		Completions: map[string][]Completion{"c": {{From: at(0), At: at(120), Body: "a", Sidecar: 0}}}}
	if v := h.Classify(); v.LostClaims != 1 {
		t.Errorf("two executions racing before any answer, with a report: %+v, want 1 lost claim", v)
	}
	h.Retry = false
	h.Executions = map[string][]time.Time{"c": {at(10), at(3000)}}
	if v := h.Classify(); v.Duplicates != 1 {
		t.Errorf("onAbandoned: Error with a report: %+v, want 1 duplicate", v)
	}
}
