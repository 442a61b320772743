package history

import (
	"fmt"
	"maps"
	"slices"
	"time"
)

// Run is one execution of a logical call as the MCP server saw it: when it
// was dispatched and returned, which sidecar forwarded it, and whether the
// server's response to it reached that sidecar.
type Run struct {
	At, Done time.Time
	Sidecar  int
	// Lost, when set, says why the response never reached the sidecar:
	// the sidecar then had nothing to store and released the claim.
	Lost string
}

// ExtraKind says what an execution beyond a logical call's first was.
type ExtraKind string

// Kinds of extra executions. The first three are what the design allows
// (a retry after a failure that stored nothing, and the take-overs of
// onAbandoned: Retry); the last two are defects.
const (
	// AfterLostResponse: every earlier run's response was lost between
	// the server and the sidecar, so nothing was stored and the claim was
	// released: the retry ran the call again.
	AfterLostResponse ExtraKind = "re-run after the earlier run's response was lost on its way to the sidecar (nothing stored, claim released)"
	// AfterTakeOver: the owner's claim lapsed and another call took it
	// over (onAbandoned: Retry).
	AfterTakeOver ExtraKind = "re-run after the owner's claim lapsed and was taken over (onAbandoned: Retry)"
	// AfterSidecarDied: the sidecar that had the earlier run's response
	// was killed before it stored it.
	AfterSidecarDied ExtraKind = "re-run after the owner's sidecar was killed before storing the result (onAbandoned: Retry)"
	// Concurrent: it ran while an earlier run of the same call still ran,
	// with no take-over: a defect.
	Concurrent ExtraKind = "ran while another run of the same call was running (defect)"
	// AfterDelivered: an earlier run's response reached its sidecar, which
	// should have stored it, and nothing explains a re-run: a defect.
	AfterDelivered ExtraKind = "ran after an earlier run's response reached its sidecar (defect)"
)

// Defect reports whether k breaks the guarantee.
func (k ExtraKind) Defect() bool { return k == Concurrent || k == AfterDelivered }

// Extra is one execution beyond a logical call's first, classified.
type Extra struct {
	Call string
	Run  Run
	Kind ExtraKind
	// Why gives the evidence: what became of the earlier run.
	Why string
}

// Extras classifies every run of every call in runs beyond its first.
// TakeOvers (the take-overs the sidecars logged, by call) and the
// History's Lapses and Kills explain re-runs after a delivered response;
// a lost response explains the retry that follows it.
func (h *History) Extras(runs map[string][]Run, takeOvers map[string][]time.Time) []Extra {
	var out []Extra
	for _, call := range slices.Sorted(maps.Keys(runs)) {
		rs := slices.Clone(runs[call])
		slices.SortFunc(rs, func(a, b Run) int { return a.At.Compare(b.At) })
		for k := 1; k < len(rs); k++ {
			kind, why := h.extra(rs[:k], rs[k], takeOvers[call])
			out = append(out, Extra{Call: call, Run: rs[k], Kind: kind, Why: why})
		}
	}
	return out
}

func (h *History) extra(before []Run, r Run, takeOvers []time.Time) (ExtraKind, string) {
	tookOver := func(from time.Time) (time.Time, bool) {
		for _, t := range takeOvers {
			if !t.Before(from) && !t.After(r.At) {
				return t, true
			}
		}
		return time.Time{}, false
	}
	for _, p := range before {
		if p.Done.After(r.At) {
			if t, ok := tookOver(p.At); ok {
				return AfterTakeOver, fmt.Sprintf("the run dispatched at %s through sidecar %d still ran; its claim was taken over at %s", ts(p.At), p.Sidecar, ts(t))
			}
			return Concurrent, fmt.Sprintf("the run dispatched at %s through sidecar %d returned only at %s", ts(p.At), p.Sidecar, ts(p.Done))
		}
	}
	var delivered *Run
	for i := range before {
		if before[i].Lost == "" {
			delivered = &before[i]
		}
	}
	if delivered == nil {
		last := before[len(before)-1]
		return AfterLostResponse, fmt.Sprintf("the run at %s through sidecar %d: %s", ts(last.At), last.Sidecar, last.Lost)
	}
	d := *delivered
	if t, ok := tookOver(d.At); ok {
		return AfterTakeOver, fmt.Sprintf("the run at %s through sidecar %d answered at %s; its claim was taken over at %s", ts(d.At), d.Sidecar, ts(d.Done), ts(t))
	}
	c := Completion{From: d.At, At: d.Done, Sidecar: d.Sidecar}
	if h.takenOver(c) {
		return AfterTakeOver, fmt.Sprintf("the run at %s through sidecar %d answered at %s while that sidecar could not reach the store", ts(d.At), d.Sidecar, ts(d.Done))
	}
	if h.diedBeforeStoring(c) {
		return AfterSidecarDied, fmt.Sprintf("the run at %s through sidecar %d answered at %s, and the sidecar was killed before storing it", ts(d.At), d.Sidecar, ts(d.Done))
	}
	return AfterDelivered, fmt.Sprintf("the run at %s through sidecar %d answered at %s and reached the sidecar", ts(d.At), d.Sidecar, ts(d.Done))
}
