// Package store holds the records that make a tool call exactly-once: a
// claim (pending, with a lease and an owner token) that becomes a stored
// response, or is released so that a retry runs again.
package store

import (
	"context"
	"errors"
	"time"
)

// State is what Reserve found at a key.
type State int

const (
	// Won means the caller now owns the key and must run the call, then Complete
	// or Release.
	Won State = iota + 1
	// Completed means a response is stored; replay it.
	Completed
	// Pending means another owner holds a live lease; wait or reject. A
	// store that replicates may also report a completed record Pending
	// while it cannot yet vouch that the record survives a failover (Redis
	// with MinReplicas: its replicas have not acknowledged it): a replay
	// must never hand out a result the store can still lose. Its Wait
	// then returns soon, and the next Reserve looks again.
	Pending
	// Abandoned means the owner's lease ran out before it completed, and the
	// caller did not ask to take the claim over.
	Abandoned
)

func (s State) String() string {
	switch s {
	case Won:
		return "won"
	case Completed:
		return "completed"
	case Pending:
		return "pending"
	case Abandoned:
		return "abandoned"
	}
	return "unknown"
}

var (
	// ErrNotOwner means the key is no longer held by this owner token (its lease
	// expired and someone took over, or it was released). A stale owner
	// never overwrites or deletes another owner's claim.
	ErrNotOwner = errors.New("claim is held by another owner")
	// ErrUnavailable wraps failures to reach the store.
	ErrUnavailable = errors.New("store unavailable")
)

// Claim asks for a key.
type Claim struct {
	// Key is a hash; stores never see raw arguments or explicit keys.
	Key string
	// Fingerprint identifies the call (tool and canonical arguments).
	Fingerprint string
	// Owner is a random token of the caller.
	Owner string
	// Lease is how long the claim lives without a Renew.
	Lease time.Duration
	// Retention is how long an unfinished claim is remembered, so that an
	// abandoned one can still be recognized after its lease ran out.
	Retention time.Duration
	// TakeOver makes Reserve take a claim whose lease ran out (Won, with
	// TookOver set) instead of reporting it Abandoned. A claim with another
	// Fingerprint is never taken over: it is reported Abandoned.
	TakeOver bool
	// Discard, when not nil, makes Reserve treat a completed record whose
	// response is exactly these bytes as absent: the claim replaces it
	// (Won). The sealing layer sets it to a record that failed to open, so
	// that exactly one caller replaces it and the others find the new claim
	// pending, as with any claim; a record stored meanwhile is not touched.
	Discard []byte
	// Tenant names whose call this is (a hash of the principal, never the
	// principal; "" for callers with none). A bounded store that must
	// evict makes room from the tenant that holds the most first, so one
	// caller filling it evicts its own results, not another's.
	Tenant string
	// Tool and Pod describe the call to a person who inspects the store
	// (kubectl idemcp keys): the tool's name and the pod whose sidecar
	// claimed it. Neither is part of the key, and neither is secret: a
	// policy's status lists its tools, and pods are public in their
	// namespace.
	Tool, Pod string
}

// Reservation is the outcome of Reserve.
type Reservation struct {
	State State
	// Fingerprint of the record found (Completed, Pending, Abandoned).
	Fingerprint string
	// Response is the stored response (Completed).
	Response []byte
	// TookOver reports a Won that replaced an abandoned claim.
	TookOver bool
}

// Store is implemented by every store and checked by the contract suite in
// storetest. All methods are safe for concurrent use.
type Store interface {
	// Reserve claims a key atomically, or reports what holds it.
	Reserve(ctx context.Context, c Claim) (Reservation, error)
	// Renew extends the lease of a claim this owner still holds.
	Renew(ctx context.Context, key, owner string, lease time.Duration) error
	// Complete stores the response for ttl if the owner still holds the claim.
	Complete(ctx context.Context, key, owner string, response []byte, ttl time.Duration) error
	// Release deletes the claim if the owner still holds it, so the next
	// call runs.
	Release(ctx context.Context, key, owner string) error
	// Wait blocks until the key is no longer pending under a live lease
	// (completed, released, expired, or its lease ran out), or ctx ends.
	// It may return early; callers Reserve again to see what happened.
	Wait(ctx context.Context, key string) error
	// Ping reports whether the store can be reached.
	Ping(ctx context.Context) error
	// Close releases the store's resources.
	Close() error
}
