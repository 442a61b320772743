// Package history classifies what a chaos or soak run recorded: when each
// logical call took effect upstream and which answers its clients got. A
// duplicate is an execution that took effect after a completion whose
// result the store held; a re-execution after the owner lost its claim
// (its sidecar died before storing the result, or it could not reach the
// store for longer than the lease) is the take-over onAbandoned: Retry
// allows, counted apart and never as a duplicate.
package history

import (
	"slices"
	"time"
)

// All marks a window that affected every sidecar (the store itself was
// away), rather than one.
const All = -1

// StoreRetrySlack bounds how long after the store returns a result held by
// the engine's store retries is written: one retry step of 1s, and
// go-redis's retries of the attempt before it.
const StoreRetrySlack = 2 * time.Second

// Completion is one successful answer a client got.
type Completion struct {
	// From is when the result may have been stored: for an execution, the
	// start of the attempt that claimed the key (the store losing its data
	// after that loses the claim, and with it the result); for a replay,
	// when it was answered.
	From time.Time
	At   time.Time
	// Answered, when set, is the earliest the sidecar may have written the
	// answer: when the client got the response's first byte. A client
	// reads a response some time after it was written (a stalled reader
	// seconds later), and the sidecar stores the result just after
	// writing it, so a kill of the sidecar after Answered (the process
	// that answered was alive to write it) may have lost the result even
	// when it came before At. Zero means At.
	Answered time.Time
	Body     string
	// Replayed: the sidecar answered from the store, not by running it.
	Replayed bool
	// Sidecar answered it.
	Sidecar int
}

// Window is a span of time in which Sidecar (or every sidecar: All) was
// affected by a fault. A zero To is open: it lasted past the run.
type Window struct {
	From, To time.Time
	Sidecar  int
}

func (w Window) overlaps(from, to time.Time) bool {
	return w.From.Before(to) && (w.To.IsZero() || w.To.After(from))
}

func (w Window) affects(sidecar int) bool { return w.Sidecar == All || w.Sidecar == sidecar }

// History is what a run recorded, and the faults it saw.
type History struct {
	Lease time.Duration
	// Retry is onAbandoned: Retry; with Error no take-over is allowed.
	Retry bool
	// Executions: when each logical call was dispatched upstream, for the
	// executions that took effect.
	Executions map[string][]time.Time
	// Completions: the answers each logical call got, in order.
	Completions map[string][]Completion
	// Losses: when the store lost its data (a restart without persistence).
	Losses []time.Time
	// Outages: the store was away, however briefly. A result answered then
	// is stored only once it is back, after the engine's store retries.
	Outages []Window
	// Lapses: the store was away (or out of reach of a sidecar) long
	// enough for a claim's lease to run out, so that a claim whose owner
	// answered but had not yet stored the result may be taken over.
	Lapses []Window
	// Kills: a sidecar was SIGKILLed, from the kill until it was back.
	Kills []Window
	// Reported: a sidecar logged that a claim it had answered under was
	// taken over before it stored the result (its lease lapsed with the
	// store in reach: the process did not renew in time, as on a starved
	// machine), the window ending when it said so. Such a re-run is the
	// trade-off of onAbandoned: Retry, counted with TakenOver; it never
	// excuses a raced execution, so a claim the store lost still counts.
	Reported []Window
	// StoreRetrySlack, when set, replaces the package's StoreRetrySlack:
	// stores whose writes fail for a while after an outage (a failover,
	// until the new primary has its replicas) retry a result for longer.
	StoreRetrySlack time.Duration
	// Logf, when set, explains every second execution it classifies.
	Logf func(format string, args ...any)
}

// Verdict counts the executions of a History by kind.
type Verdict struct {
	Executions int
	// Duplicates ran while the call's result was stored: must be 0.
	Duplicates int
	// Mismatches: answers that differ from an earlier answer the store
	// held: must be 0.
	Mismatches int
	// TakenOver: re-runs after the owner's claim lapsed while the store
	// was out of its reach (Retry only).
	TakenOver int
	// LostWithSidecar: re-runs after the owner's sidecar was killed
	// between answering and storing the result (Retry only).
	LostWithSidecar int
	// Raced: executions dispatched after an earlier one of the same call
	// but before any client was answered. A claim lets one execution run
	// at a time, so each is a take-over of a claim whose owner died or was
	// cut off from the store for a lease (Retry only), or a claim the
	// store lost.
	Raced int
	// ReplayedThenLost: replays of a result the store held on its primary
	// only (the owner had stored it, but no replica had acknowledged it
	// yet) that a failover then lost, since the owner's sidecar was killed
	// before storing it again; a retry ran the call again and answered
	// differently (Retry only). Must be 0 with --redis-min-replicas: a
	// replay of a result the replicas have not acknowledged confirms it
	// first (docs/failure-modes.md).
	ReplayedThenLost int
	// LostClaims: raced executions that no kill of a sidecar and no lapse
	// explains: the store lost a live claim. Must be 0.
	LostClaims int
}

// Classify counts every execution and every answer of h.
func (h *History) Classify() Verdict {
	var v Verdict
	for call, ex := range h.Executions {
		v.Executions += len(ex)
		ex = slices.Clone(ex)
		slices.SortFunc(ex, func(a, b time.Time) int { return a.Compare(b) })
		for i, at := range ex {
			if i > 0 && !h.answeredBefore(call, at) {
				v.Raced++
				if h.ownerLost(ex[i-1], at) {
					h.logf("raced: %s ran at %s, after an execution at %s and before any answer; a sidecar was killed or the store out of reach meanwhile", call, ts(at), ts(ex[i-1]))
				} else {
					h.logf("lost claim: %s ran at %s, after an execution at %s and before any answer, with no sidecar killed and the store in reach meanwhile", call, ts(at), ts(ex[i-1]))
					v.LostClaims++
				}
			}
			switch h.classify(call, at) {
			case duplicate:
				v.Duplicates++
			case takenOver:
				v.TakenOver++
			case lostWithSidecar:
				v.LostWithSidecar++
			}
		}
	}
	for call, comps := range h.Completions {
		for i := 1; i < len(comps); i++ {
			prev, cur := comps[i-1], comps[i]
			if cur.Body != prev.Body && !h.lostBetween(prev.From, cur.At) && !h.takenOver(prev) && !h.diedBeforeStoring(prev) {
				if prev.Replayed && h.replayedThenLost(comps[:i], prev) {
					h.logf("replayed, then lost with its sidecar: %s was replayed %s before a replica had it, then its sidecar was killed and a failover lost it; a retry answered %s", call, prev.Body, cur.Body)
					v.ReplayedThenLost++
					continue
				}
				h.logf("mismatch: %s answered %s, then %s (replayed %v)", call, prev.Body, cur.Body, cur.Replayed)
				v.Mismatches++
			}
		}
	}
	return v
}

type kind int

const (
	first kind = iota
	duplicate
	takenOver
	lostWithSidecar
)

// classify judges the execution of call dispatched at: against the first
// completion before it (one dispatched before any completion raced its
// owner and ignored no stored result).
func (h *History) classify(call string, at time.Time) kind {
	for _, c := range h.Completions[call] {
		if !c.At.Before(at) || h.lostBetween(c.From, at) {
			continue
		}
		switch {
		case h.diedBeforeStoring(c):
			h.logf("lost with its sidecar: %s ran at %s after it completed at %s, its sidecar was killed before storing the result", call, ts(at), ts(c.At))
			return lostWithSidecar
		case h.takenOver(c):
			h.logf("taken over: %s ran at %s after it completed at %s through sidecar %d, whose claim lapsed while the store was out of its reach", call, ts(at), ts(c.At), c.Sidecar)
			return takenOver
		default:
			h.logf("duplicate: %s ran at %s after it completed at %s through sidecar %d (replayed %v)", call, ts(at), ts(c.At), c.Sidecar, c.Replayed)
			return duplicate
		}
	}
	return first
}

// ownerLost reports whether the owner of an execution dispatched at prev
// may have lost its claim by at: a sidecar was killed in between (which one
// dispatched it is not recorded), or the store was out of reach long
// enough for a lease to lapse.
func (h *History) ownerLost(prev, at time.Time) bool {
	for _, k := range h.Kills {
		// A sidecar dispatches a call a moment before the server sees it.
		if !k.From.Before(prev.Add(-100*time.Millisecond)) && k.From.Before(at) {
			return true
		}
	}
	for _, l := range h.Lapses {
		if l.overlaps(prev, at) {
			return true
		}
	}
	return false
}

// replayedThenLost reports whether the replay r repeats the answer of an
// earlier execution whose sidecar was killed before it could have stored
// the result for good.
func (h *History) replayedThenLost(earlier []Completion, r Completion) bool {
	for _, c := range earlier {
		if !c.Replayed && c.Body == r.Body && h.diedBeforeStoring(c) {
			return true
		}
	}
	return false
}

func (h *History) storeRetrySlack() time.Duration {
	if h.StoreRetrySlack > 0 {
		return h.StoreRetrySlack
	}
	return StoreRetrySlack
}

// answeredBefore reports whether a client got an answer to call before at.
func (h *History) answeredBefore(call string, at time.Time) bool {
	for _, c := range h.Completions[call] {
		if c.At.Before(at) {
			return true
		}
	}
	return false
}

func ts(t time.Time) string { return t.Format("15:04:05.000") }

func (h *History) logf(format string, args ...any) {
	if h.Logf != nil {
		h.Logf(format, args...)
	}
}

// takenOver reports whether, under onAbandoned: Retry, c's claim may have
// lapsed before its result was stored (the owner answers its client
// before the store write succeeds): the store was out of reach of c's
// sidecar for a lease while the call ran or just after it was answered.
// This is the documented trade-off of Retry, which Error turns into
// -32012.
func (h *History) takenOver(c Completion) bool {
	if !h.Retry {
		return false
	}
	for _, w := range slices.Concat(h.Lapses, h.Reported) {
		if w.affects(c.Sidecar) && w.overlaps(c.From, c.At.Add(h.Lease)) {
			return true
		}
	}
	return false
}

// diedBeforeStoring reports whether, under onAbandoned: Retry, the sidecar
// that answered c (an execution, not a replay) was killed before it could
// have stored the result: a sidecar answers its client first and stores
// the result just after, so a SIGKILL in between loses the result with
// the process, the claim lapses, and a retry runs again.
func (h *History) diedBeforeStoring(c Completion) bool {
	if !h.Retry || c.Replayed {
		return false
	}
	// The engine stores the result as the handler writes the answer (it
	// does not wait for the client to read it), so just after the
	// answer's first byte, or, when the store is away then, once it is
	// back and the engine's store-retry backoff (50ms, 200ms, 500ms, 1s,
	// ... plus go-redis's own retries) comes round. A kill later than a
	// lease after that cannot have lost it: a re-run is a duplicate.
	answered := c.At
	if !c.Answered.IsZero() && c.Answered.Before(answered) {
		answered = c.Answered
	}
	storedBy := answered.Add(h.Lease)
	for _, o := range h.Outages {
		if o.affects(c.Sidecar) && o.overlaps(c.From, storedBy) && !o.To.IsZero() && o.To.Add(h.storeRetrySlack()).After(storedBy) {
			storedBy = o.To.Add(h.storeRetrySlack())
		}
	}
	for _, k := range h.Kills {
		if k.Sidecar == c.Sidecar && !k.From.Before(answered) && k.From.Before(storedBy) {
			return true
		}
	}
	return false
}

// lostBetween reports whether the store lost its data between a and b.
func (h *History) lostBetween(a, b time.Time) bool {
	for _, r := range h.Losses {
		if r.After(a) && r.Before(b) {
			return true
		}
	}
	return false
}
