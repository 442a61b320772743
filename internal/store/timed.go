package store

import (
	"context"
	"time"
)

// Operation names Timed reports, as idemcp_store_duration_seconds labels
// them.
const (
	OpReserve  = "reserve"
	OpRenew    = "renew"
	OpComplete = "complete"
	OpRelease  = "release"
	OpPing     = "ping"
)

// Timed returns st with the duration of each round trip reported to
// observe, whether it failed or not. Wait is not timed: it lasts as long as
// the call it waits for, which says nothing of the store.
func Timed(st Store, observe func(op string, d time.Duration)) Store {
	return &timed{Store: st, observe: observe}
}

var _ Store = (*timed)(nil)

type timed struct {
	Store
	observe func(op string, d time.Duration)
}

func (t *timed) since(op string, start time.Time) { t.observe(op, time.Since(start)) }

func (t *timed) Reserve(ctx context.Context, c Claim) (Reservation, error) {
	defer t.since(OpReserve, time.Now())
	return t.Store.Reserve(ctx, c)
}

func (t *timed) Renew(ctx context.Context, key, owner string, lease time.Duration) error {
	defer t.since(OpRenew, time.Now())
	return t.Store.Renew(ctx, key, owner, lease)
}

func (t *timed) Complete(ctx context.Context, key, owner string, response []byte, ttl time.Duration) error {
	defer t.since(OpComplete, time.Now())
	return t.Store.Complete(ctx, key, owner, response, ttl)
}

func (t *timed) Release(ctx context.Context, key, owner string) error {
	defer t.since(OpRelease, time.Now())
	return t.Store.Release(ctx, key, owner)
}

func (t *timed) Ping(ctx context.Context) error {
	defer t.since(OpPing, time.Now())
	return t.Store.Ping(ctx)
}

// Unwrap returns the store underneath (InspectorOf looks through it).
func (t *timed) Unwrap() Store { return t.Store }
