package pgstore_test

import (
	"context"
	"crypto/rand"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcp/idemcp/internal/store"
	pgstore "github.com/idemcp/idemcp/internal/store/postgres"
	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
	"github.com/idemcp/idemcp/internal/store/storetest"
)

// prefix gives each test its own keys in a shared database.
func prefix(t *testing.T) string {
	return "idemcp:test/" + strings.ReplaceAll(t.Name(), "/", ".") + "/" + rand.Text()[:6] + ":"
}

func newStore(t *testing.T, opts pgstore.Options) *pgstore.Store {
	t.Helper()
	if opts.Prefix == "" {
		opts.Prefix = prefix(t)
	}
	s, err := pgstore.New(opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestContract(t *testing.T) {
	srv := pgtest.Start(t)
	storetest.Run(t, func(t *testing.T) store.Store {
		return newStore(t, pgstore.Options{URL: srv.URL})
	})
}

// TestContractThroughPgBouncer runs the contract through PgBouncer in
// transaction mode, where no session state survives a statement and
// notifications do not come through: waiters fall back to polling.
func TestContractThroughPgBouncer(t *testing.T) {
	srv := pgtest.Start(t)
	bouncer := pgtest.StartBouncer(t, srv)
	storetest.Run(t, func(t *testing.T) store.Store {
		return newStore(t, pgstore.Options{URL: bouncer.URL, PollInterval: 300 * time.Millisecond})
	})
}

// TestContractWithoutListen: the LISTEN connection cannot be had at all,
// and waiting still works by polling.
func TestContractWithoutListen(t *testing.T) {
	srv := pgtest.Start(t)
	dead := "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=1"
	storetest.Run(t, func(t *testing.T) store.Store {
		return newStore(t, pgstore.Options{URL: srv.URL, ListenURL: dead})
	})
}

func TestNewRejectsBadURL(t *testing.T) {
	if _, err := pgstore.New(pgstore.Options{}); err == nil {
		t.Fatal("New accepted options without a URL")
	}
	_, err := pgstore.New(pgstore.Options{URL: "postgres://u:s3cret@host:notaport/db"})
	if err == nil {
		t.Fatal("New accepted a URL with a bad port")
	}
	if strings.Contains(err.Error(), "s3cret") {
		t.Fatalf("the error shows the password: %v", err)
	}
}

// TestUnreachable: New succeeds, calls fail with ErrUnavailable, quickly.
func TestUnreachable(t *testing.T) {
	s := newStore(t, pgstore.Options{URL: "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable", ConnectTimeout: 500 * time.Millisecond})
	start := time.Now()
	_, err := s.Reserve(context.Background(), store.Claim{Key: "k", Fingerprint: "f", Owner: "o", Lease: time.Second})
	if !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("Reserve = %v, want ErrUnavailable", err)
	}
	if err := s.Ping(context.Background()); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("Ping = %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("failing took %v", d)
	}
}

// TestSchemaVersioned: the store records the schema version it applied,
// concurrent stores migrate once, and a database from a newer idemcp is
// refused with a message saying so.
func TestSchemaVersioned(t *testing.T) {
	srv := pgtest.Start(t)
	var wg sync.WaitGroup
	for range 5 {
		wg.Go(func() {
			s := newStore(t, pgstore.Options{URL: srv.URL})
			if err := s.Ping(context.Background()); err != nil {
				t.Errorf("Ping: %v", err)
			}
		})
	}
	wg.Wait()
	if got := queryInt(t, srv.URL, `SELECT count(*) FROM idemcp_schema_migrations`); got != pgstore.SchemaVersion {
		t.Fatalf("%d migrations recorded, want %d", got, pgstore.SchemaVersion)
	}
	pgtest.Exec(t, srv.URL, `INSERT INTO idemcp_schema_migrations (version) VALUES (999)`)
	err := newStore(t, pgstore.Options{URL: srv.URL}).Ping(context.Background())
	if err == nil || !strings.Contains(err.Error(), "newer than this idemcp knows") {
		t.Fatalf("Ping against a newer schema = %v, want a refusal naming the versions", err)
	}
}

// TestTableRecreated: a database restored empty (the table dropped) is
// migrated again on the next call, without a restart.
func TestTableRecreated(t *testing.T) {
	srv := pgtest.Start(t)
	s := newStore(t, pgstore.Options{URL: srv.URL})
	ctx := context.Background()
	if _, err := s.Reserve(ctx, store.Claim{Key: "a", Fingerprint: "f", Owner: "o1", Lease: time.Minute}); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, srv.URL, `DROP TABLE idemcp_records; DELETE FROM idemcp_schema_migrations`)
	r, err := s.Reserve(ctx, store.Claim{Key: "a", Fingerprint: "f", Owner: "o2", Lease: time.Minute})
	if err != nil || r.State != store.Won {
		t.Fatalf("Reserve after the table was dropped = %v, %v; want won", r.State, err)
	}
}

// TestCleanupInBatches: expired rows go, in batches of CleanupBatch; live
// ones stay.
func TestCleanupInBatches(t *testing.T) {
	srv := pgtest.Start(t)
	s := newStore(t, pgstore.Options{URL: srv.URL, CleanupBatch: 7, CleanupInterval: -1})
	ctx := context.Background()
	for i := range 30 {
		key := "k" + string(rune('a'+i))
		if _, err := s.Reserve(ctx, store.Claim{Key: key, Fingerprint: "f", Owner: "o", Lease: 10 * time.Millisecond, Retention: 10 * time.Millisecond}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Reserve(ctx, store.Claim{Key: "live", Fingerprint: "f", Owner: "o", Lease: time.Minute}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	n, err := s.Cleanup(ctx)
	if err != nil || n != 30 {
		t.Fatalf("Cleanup = %d, %v; want 30 expired rows deleted", n, err)
	}
	if got := queryInt(t, srv.URL, `SELECT count(*) FROM idemcp_records`); got != 1 {
		t.Fatalf("%d rows left, want the 1 live claim", got)
	}
}

// TestSurvivesRestart: a stored result outlives a PostgreSQL restart, and
// the store reconnects by itself.
func TestSurvivesRestart(t *testing.T) {
	srv := pgtest.Start(t)
	s := newStore(t, pgstore.Options{URL: srv.URL})
	ctx := context.Background()
	c := store.Claim{Key: "k", Fingerprint: "f", Owner: "o", Lease: time.Minute, Retention: time.Minute}
	if _, err := s.Reserve(ctx, c); err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, "k", "o", []byte("kept"), time.Hour); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	if _, err := s.Reserve(ctx, store.Claim{Key: "k", Fingerprint: "f", Owner: "o2", Lease: time.Minute}); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("Reserve while PostgreSQL is down = %v, want ErrUnavailable", err)
	}
	srv.Start()
	deadline := time.Now().Add(10 * time.Second)
	for {
		r, err := s.Reserve(ctx, store.Claim{Key: "k", Fingerprint: "f", Owner: "o3", Lease: time.Minute})
		if err == nil {
			if r.State != store.Completed || string(r.Response) != "kept" {
				t.Fatalf("after the restart: %s %q, want the stored result", r.State, r.Response)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the store did not reconnect: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func queryInt(t *testing.T, url, sql string) int {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close(ctx) }()
	var n int
	if err := conn.QueryRow(ctx, sql).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// TestNullResponseReplaced: a completed row whose response is NULL (any
// writer to the database can make one) reads as an empty result, as in
// Redis, and a claim that discards the empty result replaces it. Before,
// `response = $7` was NULL for such a row: no claim could ever replace it,
// and a sealed store answered "store unavailable" for the key until the
// row expired.
func TestNullResponseReplaced(t *testing.T) {
	srv := pgtest.Start(t)
	p := prefix(t)
	s := newStore(t, pgstore.Options{URL: srv.URL, Prefix: p})
	ctx := context.Background()
	if err := s.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	plant := func(key string) {
		pgtest.Exec(t, srv.URL, `INSERT INTO idemcp_records (key, fingerprint, owner, completed, response, expires_at)
VALUES ($1::text, 'f', 'writer', true, NULL, now() + interval '1 hour')`, p+key)
	}

	plant("raw")
	r, err := s.Reserve(ctx, store.Claim{Key: "raw", Fingerprint: "f", Owner: "o1", Lease: time.Minute})
	if err != nil || r.State != store.Completed || r.Response == nil || len(r.Response) != 0 {
		t.Fatalf("Reserve of a NULL response = %v %q, %v; want completed with an empty response", r.State, r.Response, err)
	}
	r, err = s.Reserve(ctx, store.Claim{Key: "raw", Fingerprint: "f", Owner: "o2", Lease: time.Minute, Discard: []byte{}})
	if err != nil || r.State != store.Won {
		t.Fatalf("Reserve discarding the empty result = %v, %v; want won", r.State, err)
	}

	key := make([]byte, store.SealKeyBytes)
	_, _ = rand.Read(key)
	ring, err := store.NewKeyring(key)
	if err != nil {
		t.Fatal(err)
	}
	sealed := store.Seal(s, store.SealOptions{Keyring: ring, Context: p})
	plant("sealed")
	r, err = sealed.Reserve(ctx, store.Claim{Key: "sealed", Fingerprint: "f", Owner: "o3", Lease: time.Minute})
	if err != nil || r.State != store.Won {
		t.Fatalf("sealed Reserve over a NULL response = %v, %v; want won (the row counts as absent)", r.State, err)
	}
	if err := sealed.Complete(ctx, "sealed", "o3", []byte("fresh"), time.Minute); err != nil {
		t.Fatal(err)
	}
	r, err = sealed.Reserve(ctx, store.Claim{Key: "sealed", Fingerprint: "f", Owner: "o4", Lease: time.Minute})
	if err != nil || r.State != store.Completed || string(r.Response) != "fresh" {
		t.Fatalf("after the replacement: %v %q, %v; want the new result", r.State, r.Response, err)
	}
}

// TestUpgradeFromVersion2: a database an older idemcp made (schema version
// 2, rows without tool, pod or claim time) is upgraded in place; its rows
// keep working and list with no tool, pod or claim time (kubectl idemcp
// keys shows "-"), and new claims record theirs.
func TestUpgradeFromVersion2(t *testing.T) {
	srv := pgtest.Start(t)
	pgtest.Exec(t, srv.URL, `
CREATE TABLE idemcp_schema_migrations (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now());
INSERT INTO idemcp_schema_migrations (version) VALUES (1), (2);
CREATE TABLE idemcp_records (
  key text PRIMARY KEY, fingerprint text NOT NULL, owner text NOT NULL,
  completed boolean NOT NULL DEFAULT false, response bytea, lease_until timestamptz,
  expires_at timestamptz NOT NULL, waited boolean NOT NULL DEFAULT false,
  took_over boolean NOT NULL DEFAULT false, acked_owner text);
INSERT INTO idemcp_records (key, fingerprint, owner, completed, response, expires_at)
  VALUES ('old:done', 'f', 'o', true, 'result', now() + interval '1 minute');
INSERT INTO idemcp_records (key, fingerprint, owner, lease_until, expires_at)
  VALUES ('old:lapsed', 'f', 'o', now() - interval '1 second', now() + interval '1 minute')`)
	s := newStore(t, pgstore.Options{URL: srv.URL, Prefix: "old:"})
	ctx := context.Background()
	r := store.Claim{Key: "new", Fingerprint: "f", Owner: "o2", Lease: time.Minute, Tool: "charge", Pod: "mcp-0"}
	if res, err := s.Reserve(ctx, r); err != nil || res.State != store.Won {
		t.Fatalf("Reserve after the upgrade: %+v %v", res, err)
	}
	if got := queryInt(t, srv.URL, `SELECT max(version) FROM idemcp_schema_migrations`); got != pgstore.SchemaVersion {
		t.Fatalf("schema version %d after the upgrade, want %d", got, pgstore.SchemaVersion)
	}
	if res, err := s.Reserve(ctx, store.Claim{Key: "done", Fingerprint: "f", Owner: "o3", Lease: time.Minute}); err != nil || res.State != store.Completed || string(res.Response) != "result" {
		t.Fatalf("replay of the old result: %+v %v", res, err)
	}
	recs, err := s.Records(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]store.Record{}
	for _, rec := range recs {
		got[rec.Key] = rec
	}
	if d := got["done"]; !d.Completed || d.Tool != "" || d.Pod != "" || !d.Claimed.IsZero() {
		t.Errorf("the old result lists as %+v, want completed with no tool, pod or claim time", d)
	}
	if l := got["lapsed"]; l.State(time.Now()) != store.StateOutcomeUnknown || l.Tool != "" || !l.Claimed.IsZero() {
		t.Errorf("the old claim lists as %+v, want outcome-unknown with no tool or claim time", l)
	}
	if n := got["new"]; n.Tool != "charge" || n.Pod != "mcp-0" || n.Claimed.IsZero() || time.Since(n.Claimed) > time.Minute {
		t.Errorf("the new claim lists as %+v, want tool charge, pod mcp-0, claimed just now", n)
	}
	if rs, err := s.Records(ctx, 1); err != nil || len(rs) != 1 {
		t.Errorf("Records(1) = %d records, %v; want 1", len(rs), err)
	}
}
