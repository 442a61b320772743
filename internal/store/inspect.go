package store

import (
	"context"
	"errors"
	"time"
)

// Record is what an operator may see of a stored key: never the arguments,
// and the response only when asked for (Inspector.Lookup).
type Record struct {
	// Key is the store key (a hash), without the store's prefix.
	Key string
	// Tool and Pod are the claim's (Claim.Tool, Claim.Pod); empty for a
	// record written by a sidecar that did not say.
	Tool, Pod string
	// Completed is a stored result; otherwise the record is a claim, live
	// until LeaseUntil.
	Completed bool
	// Claimed is when the claim was made (zero if unknown).
	Claimed time.Time
	// LeaseUntil is when a claim's lease runs out (claims only).
	LeaseUntil time.Time
	// Expires is when the record is dropped.
	Expires time.Time
}

// RecordState is a record's state as kubectl idemcp keys names it.
type RecordState string

// Record states: a claim whose lease is live, a claim whose lease ran out
// before its call completed (a retry takes it over, or under onAbandoned:
// Error is answered "outcome unknown"), and a stored result.
const (
	StatePending        RecordState = "pending"
	StateOutcomeUnknown RecordState = "outcome-unknown"
	StateCompleted      RecordState = "completed"
)

// State says what r is at now.
func (r Record) State(now time.Time) RecordState {
	switch {
	case r.Completed:
		return StateCompleted
	case now.Before(r.LeaseUntil):
		return StatePending
	}
	return StateOutcomeUnknown
}

// Drop says which records Inspector.Drop may delete.
type Drop int

const (
	// DropClaim releases a claim whose lease ran out: the next call with
	// its key runs. A claim under a live lease is not dropped
	// (ErrLeaseLive): its owner still runs the call, and a retry would run
	// it a second time.
	DropClaim Drop = iota + 1
	// DropResult forgets a stored result: the next identical call runs.
	DropResult
)

var (
	// ErrNoRecord means no record is stored under the key.
	ErrNoRecord = errors.New("no record under this key")
	// ErrWrongState means the record is not what the Drop asked for: a
	// result to release, or a claim to forget.
	ErrWrongState = errors.New("the record is not in the state asked for")
	// ErrLeaseLive means the claim's owner still renews its lease.
	ErrLeaseLive = errors.New("the claim's lease is live: its call is still running")
)

// Inspector is a store whose records an operator may list and resolve
// (kubectl idemcp keys, through the manager).
type Inspector interface {
	// Records lists every record, at most limit (0: no limit) of them.
	Records(ctx context.Context, limit int) ([]Record, error)
	// Lookup returns the record at key and, for a result, the response
	// stored (sealed, in a sealed store: see Sealed.Lookup).
	Lookup(ctx context.Context, key string) (Record, []byte, error)
	// Drop deletes the record at key if it is what d says, waking its
	// waiters, and returns what it was: ErrNoRecord, ErrWrongState or
	// ErrLeaseLive otherwise.
	Drop(ctx context.Context, key string, d Drop) (Record, error)
}

// InspectorOf returns the Inspector under st (through Unwrap), if any. A
// sealed store's Lookup opens the response it returns.
func InspectorOf(st Store) (Inspector, bool) { return As[Inspector](st) }

// As finds, in st or the stores it wraps (Unwrap, as Sealed and Timed
// do), the first that is a T: what only one kind of store offers (an
// Inspector, the Redis store's live MinReplicas) behind the wrappers.
func As[T any](st Store) (T, bool) {
	for st != nil {
		if t, ok := st.(T); ok {
			return t, true
		}
		u, ok := st.(interface{ Unwrap() Store })
		if !ok {
			break
		}
		st = u.Unwrap()
	}
	var zero T
	return zero, false
}

var _ Inspector = (*Sealed)(nil)

// Records implements Inspector for the store underneath (claims and
// metadata are not sealed).
func (s *Sealed) Records(ctx context.Context, limit int) ([]Record, error) {
	in, ok := InspectorOf(s.Store)
	if !ok {
		return nil, errNotInspectable
	}
	return in.Records(ctx, limit)
}

// Lookup implements Inspector: the response is opened. One that does not
// open is reported as ErrSealBroken with the record.
func (s *Sealed) Lookup(ctx context.Context, key string) (Record, []byte, error) {
	in, ok := InspectorOf(s.Store)
	if !ok {
		return Record{}, nil, errNotInspectable
	}
	r, resp, err := in.Lookup(ctx, key)
	if err != nil || !r.Completed {
		return r, resp, err
	}
	plain, reason, ok := s.ring.Open(s.ctx, key, resp, time.Now().Add(-s.grace))
	if !ok {
		return r, nil, &SealBrokenError{Reason: reason}
	}
	return r, plain, nil
}

// Drop implements Inspector.
func (s *Sealed) Drop(ctx context.Context, key string, d Drop) (Record, error) {
	in, ok := InspectorOf(s.Store)
	if !ok {
		return Record{}, errNotInspectable
	}
	return in.Drop(ctx, key, d)
}

var errNotInspectable = errors.New("this store cannot list its records")

// SealBrokenError is a stored result that does not open: a retry runs the
// call again as if there were none.
type SealBrokenError struct{ Reason string }

func (e *SealBrokenError) Error() string {
	return "the stored result does not open (" + e.Reason + "): a retry runs the call again as if none were stored"
}
