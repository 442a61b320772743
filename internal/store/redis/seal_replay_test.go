package redisstore_test

import (
	"context"
	"crypto/rand"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/store"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/test/poll"
)

// TestSealedRecordRestoredAfterExpiryDoesNotReplay: whoever can write to
// Redis (the threat sealing is for) copies a genuine sealed result with
// DUMP while it lives and RESTOREs it under the same key after its TTL
// ran out. A later call with the same key (an explicit key reused after
// the TTL, or a Principal/Global scoped call with the same arguments) must
// run: the stale result must not replay, or the writer suppresses the call
// at will.
func TestSealedRecordRestoredAfterExpiryDoesNotReplay(t *testing.T) {
	srv := redistest.Start(t)
	key := make([]byte, store.SealKeyBytes)
	_, _ = rand.Read(key)
	ring, err := store.NewKeyring(key)
	if err != nil {
		t.Fatal(err)
	}
	s := store.Seal(newStore(t, redisstore.Options{Addrs: []string{srv.Addr}}), store.SealOptions{Keyring: ring, Context: prefix(t), ExpiryGrace: time.Millisecond})
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { _ = rc.Close() })
	ctx := context.Background()

	c := claim("daily-report", time.Minute)
	if r, err := s.Reserve(ctx, c); err != nil || r.State != store.Won {
		t.Fatalf("Reserve = %v, %v; want won", r.State, err)
	}
	const ttl = 300 * time.Millisecond
	if err := s.Complete(ctx, c.Key, c.Owner, []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"sent on day 1"}]}}`), ttl); err != nil {
		t.Fatal(err)
	}
	full := prefix(t) + c.Key
	copied, err := rc.Dump(ctx, full).Result()
	if err != nil {
		t.Fatalf("DUMP: %v", err)
	}
	poll.Within(t, 10*time.Second, "the record's TTL to run out", poll.True(func() bool { n, _ := rc.Exists(ctx, full).Result(); return n == 0 }))
	if err := rc.Restore(ctx, full, time.Hour, copied).Err(); err != nil {
		t.Fatalf("RESTORE: %v", err)
	}

	r, err := s.Reserve(ctx, claim("daily-report", time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if r.State != store.Won {
		t.Fatalf("a sealed result restored after its TTL ran out gave %s %q; want won (the call runs, the stale result is not replayed)", r.State, r.Response)
	}
}
