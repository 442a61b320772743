package pgstore_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/store"
	pgstore "github.com/idemcp/idemcp/internal/store/postgres"
	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// BenchmarkStores measures what a deduplicated call costs in each store
// over loopback: Executed is a claim and a stored result (what a call that
// runs costs), Replay a claim that finds the result.
func BenchmarkStores(b *testing.B) {
	resp := []byte(`{"jsonrpc":"2.0","result":{"content":[{"type":"text","text":"charged 129.99 to 4242 (charge #1)"}],"_meta":{"idemcp.io/replayed":true}}}`)
	stores := []struct {
		name string
		open func(b *testing.B) store.Store
	}{
		{"Memory", func(*testing.B) store.Store { return store.NewMemory(0) }},
		{"Redis", func(b *testing.B) store.Store {
			srv := redistest.Start(b)
			s, err := redisstore.New(redisstore.Options{Addrs: []string{srv.Addr}})
			if err != nil {
				b.Fatal(err)
			}
			return s
		}},
		{"RedisSealed", func(b *testing.B) store.Store {
			srv := redistest.Start(b)
			s, err := redisstore.New(redisstore.Options{Addrs: []string{srv.Addr}})
			if err != nil {
				b.Fatal(err)
			}
			ring, err := store.NewKeyring(make([]byte, store.SealKeyBytes))
			if err != nil {
				b.Fatal(err)
			}
			return store.Seal(s, store.SealOptions{Keyring: ring, Context: redisstore.DefaultPrefix})
		}},
		{"Postgres", func(b *testing.B) store.Store {
			srv := pgtest.Start(b)
			s, err := pgstore.New(pgstore.Options{URL: srv.URL})
			if err != nil {
				b.Fatal(err)
			}
			return s
		}},
	}
	for _, st := range stores {
		b.Run(st.name, func(b *testing.B) {
			s := st.open(b)
			b.Cleanup(func() { _ = s.Close() })
			ctx := context.Background()
			claim := func(key string) store.Claim {
				return store.Claim{Key: key, Fingerprint: "fp", Owner: key, Lease: 30 * time.Second, Retention: time.Hour}
			}
			if _, err := s.Reserve(ctx, claim("warm")); err != nil { // connections up, schema created
				b.Fatal(err)
			}
			if err := s.Complete(ctx, "warm", "warm", resp, time.Hour); err != nil {
				b.Fatal(err)
			}
			seq := 0 // keys are new across the benchmark's runs
			b.Run("Executed", func(b *testing.B) {
				for range b.N {
					seq++
					key := "k" + strconv.Itoa(seq)
					if _, err := s.Reserve(ctx, claim(key)); err != nil {
						b.Fatal(err)
					}
					if err := s.Complete(ctx, key, key, resp, time.Hour); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("Replay", func(b *testing.B) {
				for range b.N {
					if r, err := s.Reserve(ctx, claim("warm")); err != nil || r.State != store.Completed {
						b.Fatal(r.State, err)
					}
				}
			})
		})
	}
}
