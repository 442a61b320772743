package redisstore_test

import (
	"context"
	"crypto/rand"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/store"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// TestClockStepOnOneSidecar: sealed expiries are written and checked by
// each sidecar's own clock (leases and TTLs by Redis's). Two sidecars
// share a Redis and a seal key; one's clock steps, forward and back,
// while records live. Within SealExpiryGrace (2m) of the other's, every
// result it reads is replayed and every result it writes is replayed to
// the other, up to its whole TTL; a step forward further than the grace
// and the result's remaining TTL makes that sidecar take live results as
// expired, and a retry through it runs the call again, which it reports
// (OnOpenFailure, "expired": idemcp_sealed_open_failures_total).
func TestClockStepOnOneSidecar(t *testing.T) {
	srv := redistest.Start(t)
	key := make([]byte, store.SealKeyBytes)
	_, _ = rand.Read(key)
	ring, err := store.NewKeyring(key)
	if err != nil {
		t.Fatal(err)
	}
	var step atomic.Int64 // the stepped sidecar's clock, ahead of the other's
	stepped := func() time.Time { return time.Now().Add(time.Duration(step.Load())) }
	var expired atomic.Int32
	steady := store.Seal(newStore(t, redisstore.Options{Addrs: []string{srv.Addr}}), store.SealOptions{Keyring: ring, Context: prefix(t)})
	skewed := store.Seal(newStore(t, redisstore.Options{Addrs: []string{srv.Addr}}), store.SealOptions{Keyring: ring, Context: prefix(t), Now: stepped,
		OnOpenFailure: func(_, reason string) {
			if reason == store.OpenExpired {
				expired.Add(1)
			}
		}})
	ctx := context.Background()
	const ttl = 10 * time.Minute
	complete := func(s store.Store, k string) {
		t.Helper()
		c := claim(k, time.Minute)
		if r, err := s.Reserve(ctx, c); err != nil || r.State != store.Won {
			t.Fatalf("Reserve %s = %v, %v; want won", k, r.State, err)
		}
		if err := s.Complete(ctx, c.Key, c.Owner, []byte("result of "+k), ttl); err != nil {
			t.Fatal(err)
		}
	}
	replays := func(s store.Store, k, who string) {
		t.Helper()
		r, err := s.Reserve(ctx, claim(k, time.Minute))
		if err != nil || r.State != store.Completed || string(r.Response) != "result of "+k {
			t.Fatalf("%s: a retry of %s = %v %q, %v; want the stored result replayed", who, k, r.State, r.Response, err)
		}
	}

	complete(steady, "a")
	for _, d := range []time.Duration{90 * time.Second, -90 * time.Second} {
		step.Store(int64(d))
		replays(skewed, "a", "the sidecar stepped "+d.String())
		k := "b" + d.String()
		complete(skewed, k)
		replays(steady, k, "the other sidecar")
	}
	// Stepped back 90s, its record's sealed expiry is 90s early: the
	// other still opens it at the end of its TTL, within the grace.
	step.Store(int64(-90 * time.Second))
	late := store.Seal(newStore(t, redisstore.Options{Addrs: []string{srv.Addr}}), store.SealOptions{Keyring: ring, Context: prefix(t),
		Now: func() time.Time { return time.Now().Add(ttl - 10*time.Second) }})
	replays(late, "b-1m30s", "a sidecar at the end of the result's TTL")

	// A step forward past the grace and the TTL: live results look
	// expired to it, and a retry through it runs again, counted.
	step.Store(int64(ttl + store.SealExpiryGrace + time.Minute))
	r, err := skewed.Reserve(ctx, claim("a", time.Minute))
	if err != nil || r.State != store.Won || expired.Load() != 1 {
		t.Fatalf("a sidecar stepped %v ahead: %v, %v (%d expired); want the live result taken as expired, counted, and the call claimed to run again",
			time.Duration(step.Load()), r.State, err, expired.Load())
	}
}
