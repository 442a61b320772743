package history

import (
	"testing"
	"time"
)

func TestClassify(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 4, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	const lease = time.Second
	// One call: executed through sidecar 0 from 0 to 100ms, then run again
	// at 3s.
	answered := []Completion{{From: at(0), At: at(100), Body: "a", Sidecar: 0}}
	twice := map[string][]time.Time{"c": {at(10), at(3000)}}
	for _, tc := range []struct {
		name  string
		h     History
		want  Verdict
		fails bool
	}{{
		name: "a second execution after the answer, no fault: a duplicate",
		h:    History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": answered}},
		want: Verdict{Executions: 2, Duplicates: 1}, fails: true,
	}, {
		name: "a second execution after a replay, no fault: a duplicate",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": {
			{From: at(0), At: at(100), Body: "a", Sidecar: 0}, {From: at(500), At: at(500), Body: "a", Replayed: true, Sidecar: 1},
		}}},
		want: Verdict{Executions: 2, Duplicates: 1}, fails: true,
	}, {
		name: "two executions racing before any answer, with no fault: a lost claim",
		h: History{Retry: true, Executions: map[string][]time.Time{"c": {at(10), at(50)}},
			Completions: map[string][]Completion{"c": answered}},
		want: Verdict{Executions: 2, Raced: 1, LostClaims: 1}, fails: true,
	}, {
		name: "two executions racing, a sidecar killed in between: a take-over",
		h: History{Retry: true, Executions: map[string][]time.Time{"c": {at(10), at(1200)}},
			Completions: map[string][]Completion{"c": {{From: at(1100), At: at(1300), Body: "a", Sidecar: 1}}},
			Kills:       []Window{{From: at(40), To: at(300), Sidecar: 0}}},
		want: Verdict{Executions: 2, Raced: 1},
	}, {
		name: "two executions racing, the store away for a lease in between: a take-over",
		h: History{Retry: true, Executions: map[string][]time.Time{"c": {at(10), at(1200)}},
			Completions: map[string][]Completion{"c": {{From: at(1100), At: at(1300), Body: "a", Sidecar: 1}}},
			Lapses:      []Window{{From: at(40), To: at(1100), Sidecar: All}}},
		want: Verdict{Executions: 2, Raced: 1},
	}, {
		name: "the owner's sidecar lost the store for a lease just after answering: taken over",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": answered},
			Lapses: []Window{{From: at(150), To: at(1500), Sidecar: 0}}},
		want: Verdict{Executions: 2, TakenOver: 1},
	}, {
		name: "the store was away for every sidecar: taken over",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": answered},
			Lapses: []Window{{From: at(50), To: at(2500), Sidecar: All}}},
		want: Verdict{Executions: 2, TakenOver: 1},
	}, {
		name: "another sidecar lost the store: still a duplicate",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": answered},
			Lapses: []Window{{From: at(150), To: at(1500), Sidecar: 1}}},
		want: Verdict{Executions: 2, Duplicates: 1}, fails: true,
	}, {
		name: "the store was away, but long after the result was stored: still a duplicate",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": answered},
			Lapses: []Window{{From: at(2000), To: at(2900), Sidecar: All}}},
		want: Verdict{Executions: 2, Duplicates: 1}, fails: true,
	}, {
		name: "onAbandoned: Error allows no take-over",
		h: History{Retry: false, Executions: twice, Completions: map[string][]Completion{"c": answered},
			Lapses: []Window{{From: at(150), To: at(1500), Sidecar: All}}},
		want: Verdict{Executions: 2, Duplicates: 1}, fails: true,
	}, {
		name: "the owner's sidecar was killed between answering and storing: lost with it",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": answered},
			Kills: []Window{{From: at(101), To: at(600), Sidecar: 0}}},
		want: Verdict{Executions: 2, LostWithSidecar: 1},
	}, {
		name: "the owner's sidecar was killed after its answer was written but before a stalled client read it: lost with it",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": {{From: at(0), Answered: at(60), At: at(100), Body: "a", Sidecar: 0}}},
			Kills: []Window{{From: at(70), To: at(600), Sidecar: 0}}},
		want: Verdict{Executions: 2, LostWithSidecar: 1},
	}, {
		name: "the owner's sidecar was killed before the answer's first byte: a duplicate",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": {{From: at(0), Answered: at(60), At: at(100), Body: "a", Sidecar: 0}}},
			Kills: []Window{{From: at(50), To: at(600), Sidecar: 0}}},
		want: Verdict{Executions: 2, Duplicates: 1}, fails: true,
	}, {
		name: "the owner's sidecar was killed well after storing: a duplicate",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": answered},
			Kills: []Window{{From: at(1500), To: at(2000), Sidecar: 0}}},
		want: Verdict{Executions: 2, Duplicates: 1}, fails: true,
	}, {
		name: "a store outage delays storing, and a kill after it loses the result",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": answered},
			Outages: []Window{{From: at(50), To: at(900), Sidecar: All}},
			Kills:   []Window{{From: at(2000), To: at(2500), Sidecar: 0}}},
		want: Verdict{Executions: 2, LostWithSidecar: 1},
	}, {
		name: "the store lost its data in between: not a duplicate",
		h: History{Retry: true, Executions: twice, Completions: map[string][]Completion{"c": answered},
			Losses: []time.Time{at(2000)}},
		want: Verdict{Executions: 2},
	}, {
		name: "a retry answered differently with no fault: a mismatch",
		h: History{Retry: true, Executions: map[string][]time.Time{"c": {at(10)}}, Completions: map[string][]Completion{"c": {
			{From: at(0), At: at(100), Body: "a"}, {From: at(500), At: at(500), Body: "b", Replayed: true},
		}}},
		want: Verdict{Executions: 1, Mismatches: 1}, fails: true,
	}, {
		name: "a replay, then its owner's sidecar killed before storing, and a re-run: replayed then lost",
		h: History{Retry: true, Executions: map[string][]time.Time{"c": {at(10), at(3000)}}, Completions: map[string][]Completion{"c": {
			{From: at(0), At: at(100), Body: "a", Sidecar: 0}, {From: at(150), At: at(150), Body: "a", Replayed: true, Sidecar: 1},
			{From: at(2900), At: at(3100), Body: "b", Sidecar: 2},
		}}, Kills: []Window{{From: at(200), To: at(600), Sidecar: 0}}},
		want: Verdict{Executions: 2, LostWithSidecar: 1, ReplayedThenLost: 1}, fails: true,
	}, {
		name: "a retry answered differently after a take-over: allowed",
		h: History{Retry: true, Executions: map[string][]time.Time{"c": {at(10), at(2000)}}, Completions: map[string][]Completion{"c": {
			{From: at(0), At: at(100), Body: "a"}, {From: at(1900), At: at(2100), Body: "b"},
		}}, Lapses: []Window{{From: at(50), To: at(1500), Sidecar: 0}}},
		want: Verdict{Executions: 2, TakenOver: 1},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			tc.h.Lease = lease
			tc.h.Logf = t.Logf
			got := tc.h.Classify()
			if got != tc.want {
				t.Errorf("Classify() = %+v, want %+v", got, tc.want)
			}
			if fails := got.Duplicates != 0 || got.Mismatches != 0 || got.LostClaims != 0 || got.ReplayedThenLost != 0; fails != tc.fails {
				t.Errorf("the run fails: %v, want %v", fails, tc.fails)
			}
		})
	}
}

func TestExtras(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 4, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	run := func(from, to, sidecar int, lost string) Run {
		return Run{At: at(from), Done: at(to), Sidecar: sidecar, Lost: lost}
	}
	for _, tc := range []struct {
		name      string
		h         History
		runs      []Run
		takeOvers []time.Time
		want      ExtraKind
	}{{
		name: "the first run's response was lost: the retry's run is allowed",
		runs: []Run{run(0, 100, 0, "the session was deleted while it ran"), run(500, 600, 1, "")},
		want: AfterLostResponse,
	}, {
		name: "the first run's response reached the sidecar, nothing else happened: a defect",
		runs: []Run{run(0, 100, 0, ""), run(500, 600, 1, "")},
		want: AfterDelivered,
	}, {
		name: "two runs at once, no take-over: a defect",
		runs: []Run{run(0, 300, 0, ""), run(100, 200, 1, "")},
		want: Concurrent,
	}, {
		name:      "two runs at once after a logged take-over",
		runs:      []Run{run(0, 3000, 0, ""), run(1200, 1300, 1, "")},
		takeOvers: []time.Time{at(1190)},
		want:      AfterTakeOver,
	}, {
		name:      "a logged take-over after the delivered run",
		runs:      []Run{run(0, 100, 0, ""), run(2000, 2100, 1, "")},
		takeOvers: []time.Time{at(1990)},
		want:      AfterTakeOver,
	}, {
		name:      "a take-over logged before the first run does not explain the second",
		runs:      []Run{run(0, 100, 0, ""), run(2000, 2100, 1, "")},
		takeOvers: []time.Time{at(-10)},
		want:      AfterDelivered,
	}, {
		name: "the owner's sidecar could not reach the store just after answering",
		h:    History{Retry: true, Lapses: []Window{{From: at(150), To: at(1500), Sidecar: 0}}},
		runs: []Run{run(0, 100, 0, ""), run(2000, 2100, 1, "")},
		want: AfterTakeOver,
	}, {
		name: "the owner's sidecar was killed before storing",
		h:    History{Retry: true, Kills: []Window{{From: at(101), To: at(600), Sidecar: 0}}},
		runs: []Run{run(0, 100, 0, ""), run(2000, 2100, 1, "")},
		want: AfterSidecarDied,
	}, {
		name: "a lost response, then a delivered one, then a third run: a defect",
		runs: []Run{run(0, 100, 0, "lost"), run(500, 600, 1, ""), run(900, 1000, 1, "")},
		want: AfterDelivered,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			tc.h.Lease = time.Second
			// Out of order on purpose: Extras sorts by dispatch.
			runs := append([]Run{tc.runs[len(tc.runs)-1]}, tc.runs[:len(tc.runs)-1]...)
			got := tc.h.Extras(map[string][]Run{"c": runs, "once": {run(0, 10, 0, "")}}, map[string][]time.Time{"c": tc.takeOvers})
			if len(got) != len(tc.runs)-1 {
				t.Fatalf("%d extras, want %d: %+v", len(got), len(tc.runs)-1, got)
			}
			last := got[len(got)-1]
			if last.Call != "c" || last.Kind != tc.want || !last.Run.At.Equal(tc.runs[len(tc.runs)-1].At) {
				t.Errorf("last extra = %+v, want %q for the run at %v", last, tc.want, tc.runs[len(tc.runs)-1].At)
			}
			if last.Kind.Defect() != (tc.want == Concurrent || tc.want == AfterDelivered) {
				t.Errorf("Defect() = %v for %q", last.Kind.Defect(), last.Kind)
			}
			t.Logf("%s: %s", last.Kind, last.Why)
		})
	}
}
