package idempotency_test

import (
	"context"
	"crypto/rand"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/idempotency"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// countingStore counts Reserve calls: store round trips per call.
type countingStore struct {
	idempotency.Store
	reserves atomic.Int64
}

func (c *countingStore) Reserve(ctx context.Context, cl store.Claim) (store.Reservation, error) {
	c.reserves.Add(1)
	return c.Store.Reserve(ctx, cl)
}

// frozen is the store as seen by a process that stopped: its lease is
// never renewed.
type frozen struct{ idempotency.Store }

func (frozen) Renew(context.Context, string, string, time.Duration) error { return nil }

func TestConcurrentCallsWaitInProcess(t *testing.T) {
	st := &countingStore{Store: idempotency.NewMemoryStore()}
	g := idempotency.NewGroup(st, idempotency.Options{})
	var runs atomic.Int64
	var wg sync.WaitGroup
	var replays atomic.Int64
	for range 50 {
		wg.Go(func() {
			v, replayed, err := g.Do(context.Background(), "k", "fp", func(context.Context) ([]byte, error) {
				runs.Add(1)
				time.Sleep(200 * time.Millisecond)
				return []byte("r"), nil
			})
			if err != nil || string(v) != "r" {
				t.Errorf("Do = %q, %v", v, err)
			}
			if replayed {
				replays.Add(1)
			}
		})
	}
	wg.Wait()
	if runs.Load() != 1 || replays.Load() != 49 {
		t.Fatalf("fn ran %d times and %d calls were replays; want 1 and 49", runs.Load(), replays.Load())
	}
	if n := st.reserves.Load(); n != 1 {
		t.Fatalf("50 concurrent calls made %d store reservations, want 1 (the others wait in process)", n)
	}
}

func TestErrorsAreNotKept(t *testing.T) {
	g := idempotency.NewGroup(idempotency.NewMemoryStore(), idempotency.Options{})
	boom := errors.New("card declined")
	calls := 0
	fn := func(context.Context) ([]byte, error) {
		calls++
		if calls == 1 {
			return nil, boom
		}
		return []byte("ok"), nil
	}
	if _, _, err := g.Do(context.Background(), "k", "fp", fn); !errors.Is(err, boom) {
		t.Fatalf("first Do = %v, want fn's error", err)
	}
	v, replayed, err := g.Do(context.Background(), "k", "fp", fn)
	if err != nil || string(v) != "ok" || replayed || calls != 2 {
		t.Fatalf("retry after an error = %q %v %v (%d runs); want fn to run again", v, replayed, err, calls)
	}
}

// TestSharedStores: two Groups (two processes) sharing Redis or
// PostgreSQL run fn once between them, and honour onAbandoned.
func TestSharedStores(t *testing.T) {
	stores := map[string]func(t *testing.T) idempotency.Store{
		"Redis": func(t *testing.T) idempotency.Store {
			srv := redistest.Start(t)
			st, err := idempotency.NewRedisStore(idempotency.RedisOptions{Addrs: []string{srv.Addr}, Prefix: "t:"})
			if err != nil {
				t.Fatal(err)
			}
			return st
		},
		"Postgres": func(t *testing.T) idempotency.Store {
			srv := pgtest.Start(t)
			st, err := idempotency.NewPostgresStore(idempotency.PostgresOptions{URL: srv.URL, Prefix: "t:"})
			if err != nil {
				t.Fatal(err)
			}
			return st
		},
	}
	for name, open := range stores {
		t.Run(name, func(t *testing.T) {
			st := open(t)
			t.Cleanup(func() { _ = st.Close() })
			a := idempotency.NewGroup(st, idempotency.Options{})
			b := idempotency.NewGroup(st, idempotency.Options{})
			var runs atomic.Int64
			fn := func(context.Context) ([]byte, error) {
				runs.Add(1)
				time.Sleep(300 * time.Millisecond)
				return []byte("charged"), nil
			}
			var wg sync.WaitGroup
			for i := range 20 {
				g := a
				if i%2 == 1 {
					g = b
				}
				wg.Go(func() {
					if v, _, err := g.Do(context.Background(), "order-1", "fp", fn); err != nil || string(v) != "charged" {
						t.Errorf("Do = %q, %v", v, err)
					}
				})
			}
			wg.Wait()
			if n := runs.Load(); n != 1 {
				t.Fatalf("20 calls over two groups sharing %s ran fn %d times, want 1", name, n)
			}

			// A process died holding a claim (its lease ran out).
			key := rand.Text()
			dead := idempotency.NewGroup(frozen{st}, idempotency.Options{Lease: 500 * time.Millisecond})
			gone := make(chan struct{})
			t.Cleanup(func() { close(gone) })
			started := make(chan struct{})
			go func() {
				_, _, _ = dead.Do(context.Background(), key, "fp", func(context.Context) ([]byte, error) {
					close(started)
					<-gone
					return nil, errors.New("gone")
				})
			}()
			<-started
			cautious := idempotency.NewGroup(st, idempotency.Options{AbandonedError: true, WaitTimeout: 5 * time.Second})
			if _, _, err := cautious.Do(context.Background(), key, "fp", fn); !errors.Is(err, idempotency.ErrOutcomeUnknown) {
				t.Fatalf("AbandonedError after the owner died = %v, want ErrOutcomeUnknown", err)
			}
			v, replayed, err := b.Do(context.Background(), key, "fp", fn)
			if err != nil || replayed || string(v) != "charged" || runs.Load() != 2 {
				t.Fatalf("Retry after the owner died = %q %v %v (%d runs); want fn to run once more", v, replayed, err, runs.Load())
			}
		})
	}
}
