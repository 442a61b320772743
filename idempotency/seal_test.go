package idempotency_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/idemcp/idemcp/idempotency"
	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// logBuffer is a logger whose output a test reads.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Whoever can write to a shared store can plant a result for a guessable
// key. Unsealed (the only way before seal keys), the planted result is
// returned and fn never runs, and the store says so in a warning; sealed,
// the planted record fails to open, counts as absent, and fn runs once.
func TestSealedStoreRefusesPlantedResults(t *testing.T) {
	// Each open is another process's client of one server.
	servers := map[string]func(t *testing.T) func(opts ...idempotency.StoreOption) (idempotency.Store, error){
		"Redis": func(t *testing.T) func(opts ...idempotency.StoreOption) (idempotency.Store, error) {
			srv := redistest.Start(t)
			return func(opts ...idempotency.StoreOption) (idempotency.Store, error) {
				return idempotency.NewRedisStore(idempotency.RedisOptions{Addrs: []string{srv.Addr}, Prefix: "seal:"}, opts...)
			}
		},
		"Postgres": func(t *testing.T) func(opts ...idempotency.StoreOption) (idempotency.Store, error) {
			srv := pgtest.Start(t)
			return func(opts ...idempotency.StoreOption) (idempotency.Store, error) {
				return idempotency.NewPostgresStore(idempotency.PostgresOptions{URL: srv.URL, Prefix: "seal:"}, opts...)
			}
		},
	}
	for name, start := range servers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			open := start(t)
			mustOpen := func(opts ...idempotency.StoreOption) idempotency.Store {
				st, err := open(opts...)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = st.Close() })
				return st
			}

			var warnings logBuffer
			attacker := idempotency.NewGroup(mustOpen(idempotency.StoreLogger(slog.New(slog.NewTextHandler(&warnings, nil)))), idempotency.Options{})
			if !strings.Contains(warnings.String(), "Results are stored unsealed") {
				t.Errorf("a store opened without seal keys logged %q; want a warning that its results are unsealed", warnings.String())
			}
			plant := func(key string) {
				if _, _, err := attacker.Do(context.Background(), key, "amount=5", func(context.Context) ([]byte, error) { return []byte("planted"), nil }); err != nil {
					t.Fatal(err)
				}
			}

			runs := 0
			charge := func(context.Context) ([]byte, error) {
				runs++
				return []byte("charged"), nil
			}
			plant("order-1")
			unsealed := idempotency.NewGroup(mustOpen(idempotency.StoreLogger(slog.New(slog.DiscardHandler))), idempotency.Options{})
			if v, replayed, err := unsealed.Do(context.Background(), "order-1", "amount=5", charge); err != nil || string(v) != "planted" || !replayed || runs != 0 {
				t.Fatalf("unsealed: Do = %q %v %v (%d runs); the threat is a planted result replayed, fn not run", v, replayed, err, runs)
			}

			key := make([]byte, idempotency.SealKeyBytes)
			_, _ = rand.Read(key)
			var sealWarnings logBuffer
			sealed := idempotency.NewGroup(mustOpen(idempotency.SealKeys(key), idempotency.StoreLogger(slog.New(slog.NewTextHandler(&sealWarnings, nil)))), idempotency.Options{})
			plant("order-2")
			for i, wantReplayed := range []bool{false, true} {
				v, replayed, err := sealed.Do(context.Background(), "order-2", "amount=5", charge)
				if err != nil || string(v) != "charged" || replayed != wantReplayed || runs != 1 {
					t.Fatalf("sealed, call %d: Do = %q %v %v (%d runs); want fn to run once, then its result replayed", i+1, v, replayed, err, runs)
				}
			}
			if w := sealWarnings.String(); strings.Contains(w, "unsealed") || !strings.Contains(w, "failed to open") {
				t.Errorf("the sealed store logged %q; want the planted record's failure to open, and no unsealed warning", w)
			}
			// The keyring as the sidecar's Secret holds it opens the same records.
			text := idempotency.SealKeyring("# current\n" + base64.StdEncoding.EncodeToString(key))
			same := idempotency.NewGroup(mustOpen(text), idempotency.Options{})
			if v, replayed, err := same.Do(context.Background(), "order-2", "amount=5", charge); err != nil || string(v) != "charged" || !replayed || runs != 1 {
				t.Fatalf("another process with the same key as text: Do = %q %v %v (%d runs); want the sealed result replayed", v, replayed, err, runs)
			}
		})
	}
}

// Seal keys that cannot seal are refused when the store is opened, with a
// message saying what a key is.
func TestBadSealKeys(t *testing.T) {
	srv := redistest.Start(t)
	o := idempotency.RedisOptions{Addrs: []string{srv.Addr}, Prefix: "seal:"}
	for _, tt := range []struct {
		name string
		opts []idempotency.StoreOption
		want string
	}{
		{"short key", []idempotency.StoreOption{idempotency.SealKeys([]byte("short"))}, "is 5 bytes long; a seal key is 32 random bytes"},
		{"no key", []idempotency.StoreOption{idempotency.SealKeys()}, "no key was given to SealKeys"},
		{"not base64", []idempotency.StoreOption{idempotency.SealKeyring("not base64!")}, "is not base64"},
		{"empty keyring", []idempotency.StoreOption{idempotency.SealKeyring("# nothing\n")}, "no seal key given"},
		{"unset variable", []idempotency.StoreOption{idempotency.SealKeyring("")}, "no seal key given"},
		{"both ways", []idempotency.StoreOption{idempotency.SealKeys(make([]byte, 32)), idempotency.SealKeyring(base64.StdEncoding.EncodeToString(make([]byte, 32)))}, "give the keys one way"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			st, err := idempotency.NewRedisStore(o, tt.opts...)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				if st != nil {
					_ = st.Close()
				}
				t.Fatalf("NewRedisStore = %v, want an error saying %q", err, tt.want)
			}
		})
	}
}

// Prefix "" is the store's DefaultPrefix: a process that leaves Prefix
// empty and one that spells the default out share the same records, and
// each opens the results the other sealed, so fn runs once between them.
func TestSealedResultsOpenUnderTheDefaultPrefixSpelledOut(t *testing.T) {
	servers := map[string]func(t *testing.T) func(prefix string, opts ...idempotency.StoreOption) (idempotency.Store, error){
		"Redis": func(t *testing.T) func(string, ...idempotency.StoreOption) (idempotency.Store, error) {
			srv := redistest.Start(t)
			return func(prefix string, opts ...idempotency.StoreOption) (idempotency.Store, error) {
				return idempotency.NewRedisStore(idempotency.RedisOptions{Addrs: []string{srv.Addr}, Prefix: prefix}, opts...)
			}
		},
		"Postgres": func(t *testing.T) func(string, ...idempotency.StoreOption) (idempotency.Store, error) {
			srv := pgtest.Start(t)
			return func(prefix string, opts ...idempotency.StoreOption) (idempotency.Store, error) {
				return idempotency.NewPostgresStore(idempotency.PostgresOptions{URL: srv.URL, Prefix: prefix}, opts...)
			}
		},
	}
	for name, start := range servers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			open := start(t)
			key := make([]byte, idempotency.SealKeyBytes)
			_, _ = rand.Read(key)
			var warnings logBuffer
			groups := map[string]*idempotency.Group{}
			for _, prefix := range []string{"", "idemcp:"} {
				st, err := open(prefix, idempotency.SealKeys(key), idempotency.StoreLogger(slog.New(slog.NewTextHandler(&warnings, nil))))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = st.Close() })
				groups[prefix] = idempotency.NewGroup(st, idempotency.Options{})
			}
			runs := 0
			charge := func(context.Context) ([]byte, error) {
				runs++
				return []byte("charged"), nil
			}
			for i, call := range []struct {
				first, then string
			}{{"", "idemcp:"}, {"idemcp:", ""}} {
				order := "order-" + rand.Text()
				for _, prefix := range []string{call.first, call.then} {
					if _, _, err := groups[prefix].Do(context.Background(), order, "amount=5", charge); err != nil {
						t.Fatal(err)
					}
				}
				if runs != i+1 {
					t.Errorf("Prefix %q, then Prefix %q on one server: fn ran %d times, want once", call.first, call.then, runs-i)
					runs = i + 1
				}
			}
			if w := warnings.String(); strings.Contains(w, "failed to open") {
				t.Errorf("the stores logged %q; want every sealed result to open in both", w)
			}
		})
	}
}
