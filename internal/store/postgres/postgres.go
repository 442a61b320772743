// Package pgstore is a store.Store shared by every sidecar of a policy (or
// every replica of a Go server using idemcp in-process), backed by
// PostgreSQL.
//
// Each operation is one SQL statement, run in autocommit: the claim is an
// INSERT ... ON CONFLICT ... DO UPDATE ... WHERE that either takes the key
// or reports what holds it. Leases and expiry are measured on the
// database's clock (now()), so servers with skewed clocks agree on whether
// a lease ran out. Owner tokens guard Renew, Complete and Release.
//
// Nothing is kept in a database session between statements (no prepared
// statements cached per connection, no session variables, no temporary
// tables), so the store works through PgBouncer in transaction mode.
// Waiters are woken by LISTEN/NOTIFY on one dedicated connection per Store;
// when that connection cannot be had (PgBouncer in transaction mode does not
// forward notifications: point ListenURL at the database itself), waiters
// poll every PollInterval instead.
//
// The store creates and upgrades its tables itself (see SchemaVersion).
// Expired rows are ignored at once and deleted in bounded batches.
package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemcp/idemcp/internal/store"
)

var _ store.Store = (*Store)(nil)

// Defaults for the zero values of Options. The timeouts are short because
// the store sits on the path of every deduplicated call: when Postgres is
// away, the engine's FailOpen or FailClosed should decide soon.
const (
	DefaultPrefix          = "idemcp:"
	DefaultConnectTimeout  = 5 * time.Second
	DefaultQueryTimeout    = 5 * time.Second
	DefaultPollInterval    = time.Second
	DefaultCleanupInterval = time.Minute
	DefaultCleanupBatch    = 1000
	DefaultMaxConns        = 10
	// Channel is the NOTIFY channel on which Complete and Release wake waiters.
	Channel = "idemcp_wake"
)

// Options say how to reach PostgreSQL.
type Options struct {
	// URL is a libpq connection string or URL
	// (postgres://user@host:5432/db?sslmode=verify-full).
	URL string
	// Password, if set, overrides the URL's (it comes from a Secret, not
	// from the URL).
	Password string
	// ListenURL is where the LISTEN connection goes when URL points at a
	// PgBouncer in transaction mode (default: URL). Without a working one,
	// waiters poll.
	ListenURL string
	// Prefix is put before every key, e.g. "idemcp:shop/payments:": the
	// policies that share a database never share keys.
	Prefix string

	ConnectTimeout time.Duration
	// QueryTimeout bounds each statement when the caller's context has no
	// shorter deadline.
	QueryTimeout time.Duration
	MaxConns     int32
	// PollInterval bounds how long a waiter trusts NOTIFY alone: it re-reads
	// the record at least this often, in case a wake-up was lost.
	PollInterval time.Duration
	// CleanupInterval is how often expired rows are deleted, CleanupBatch
	// rows per statement (negative interval: never, for a database cleaned
	// by other means).
	CleanupInterval time.Duration
	CleanupBatch    int
}

// Store is a store.Store in PostgreSQL. It is safe for concurrent use.
type Store struct {
	pool         *pgxpool.Pool
	prefix       string
	queryTimeout time.Duration
	poll         time.Duration
	batch        int
	waiters      *wakeHub
	warned       *warnings

	migrateMu sync.Mutex
	migrated  bool

	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once
}

// New parses opts and returns a store. It does not fail when PostgreSQL
// cannot be reached yet: calls then return errors wrapping
// store.ErrUnavailable until it can, and Ping reports it. The schema is
// created or upgraded on first use.
func New(opts Options) (*Store, error) {
	if opts.URL == "" {
		return nil, errors.New("postgres store: no URL")
	}
	cfg, err := pgxpool.ParseConfig(opts.URL)
	if err != nil {
		// pgx's message may quote the URL, password and all.
		return nil, errors.New("postgres store: the URL is not a valid PostgreSQL connection string or URL (postgres://user@host:5432/db)")
	}
	configure(cfg.ConnConfig, opts)
	warned := &warnings{}
	warned.attach(cfg)
	cfg.MaxConns = opts.MaxConns
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = DefaultMaxConns
	}
	// A connection costs a backend process; keep two warm so that a burst
	// after a quiet spell does not wait for many at once.
	cfg.MinConns = min(2, cfg.MaxConns)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return nil, fmt.Errorf("postgres store: %w", err)
	}
	listenCfg := cfg.ConnConfig.Copy()
	if opts.ListenURL != "" {
		if listenCfg, err = pgx.ParseConfig(opts.ListenURL); err != nil {
			pool.Close()
			return nil, errors.New("postgres store: the listen URL is not a valid PostgreSQL connection string or URL")
		}
		configure(listenCfg, opts)
	}
	s := &Store{
		pool:         pool,
		warned:       warned,
		prefix:       opts.Prefix,
		queryTimeout: orDefault(opts.QueryTimeout, DefaultQueryTimeout),
		poll:         orDefault(opts.PollInterval, DefaultPollInterval),
		batch:        opts.CleanupBatch,
		stop:         make(chan struct{}),
		done:         make(chan struct{}),
	}
	if s.prefix == "" {
		s.prefix = DefaultPrefix
	}
	if s.batch <= 0 {
		s.batch = DefaultCleanupBatch
	}
	s.waiters = newWakeHub(listenCfg, s.stop)
	go s.janitor(opts.CleanupInterval)
	// Create the schema and open a first connection now, so that the
	// first calls do not pay for it; if the database is away, the first
	// call tries again.
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = s.ready(ctx)
	}()
	return s, nil
}

// configure makes every connection safe behind PgBouncer in transaction
// mode: statements are sent with the extended protocol's unnamed statement
// (QueryExecModeExec), never prepared and cached per connection.
func configure(c *pgx.ConnConfig, opts Options) {
	c.DefaultQueryExecMode = pgx.QueryExecModeExec
	c.StatementCacheCapacity = 0
	c.DescriptionCacheCapacity = 0
	if opts.Password != "" {
		c.Password = opts.Password
	}
	if c.ConnectTimeout == 0 || opts.ConnectTimeout > 0 {
		c.ConnectTimeout = orDefault(opts.ConnectTimeout, DefaultConnectTimeout)
	}
	if c.RuntimeParams == nil {
		c.RuntimeParams = map[string]string{}
	}
	if _, ok := c.RuntimeParams["application_name"]; !ok {
		c.RuntimeParams["application_name"] = "idemcp"
	}
}

func orDefault(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

// millis rounds up, so a lease or TTL is never shortened.
func millis(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

// unavailable wraps a failure to talk to PostgreSQL. A caller that gave up
// (context.Canceled) is not told the store is down.
func unavailable(op, key string, err error) error {
	if errors.Is(err, context.Canceled) {
		return fmt.Errorf("postgres %s %s: %w", op, key, err)
	}
	return fmt.Errorf("postgres %s %s: %w: %w", op, key, store.ErrUnavailable, err)
}

// ready creates or upgrades the schema once per Store, and again after a
// statement found the table missing (a database recreated under us).
func (s *Store) ready(ctx context.Context) error {
	s.migrateMu.Lock()
	defer s.migrateMu.Unlock()
	if s.migrated {
		return nil
	}
	if err := s.migrate(ctx); err != nil {
		return fmt.Errorf("creating the idemcp schema: %w", err)
	}
	s.migrated = true
	return nil
}

// run runs one statement with the store's timeout, creating the schema
// first when needed.
func (s *Store) run(ctx context.Context, op, key string, fn func(ctx context.Context) error) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.queryTimeout)
		defer cancel()
	}
	if err := s.ready(ctx); err != nil {
		return unavailable(op, key, err)
	}
	err := fn(ctx)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
		s.migrateMu.Lock()
		s.migrated = false
		s.migrateMu.Unlock()
		if err = s.ready(ctx); err == nil {
			err = fn(ctx)
		}
	}
	if err != nil && !errors.Is(err, store.ErrNotOwner) && !errors.Is(err, errRace) {
		return unavailable(op, key, err)
	}
	return err
}

// Reply codes of reserveSQL.
const (
	codeWon       = 1
	codeCompleted = 2
	codePending   = 3
	codeAbandoned = 4
)

// reserveSQL claims $1 in one statement. The INSERT takes the key when it
// is free, expired, (with $6) abandoned by a claim of the same
// fingerprint (a claim of other arguments is never taken over), or a
// result whose response is exactly $7 (Claim.Discard; NULL: none; a NULL
// response, which only another writer makes, counts as empty, as Reserve
// reports it and as Redis treats a missing field); its ON CONFLICT ... WHERE is
// checked against the latest committed row while holding its lock, so of
// concurrent claims exactly one wins. When it does not take the key, the
// second branch reports what holds it, as the statement's snapshot saw it.
// A row that snapshot cannot see yet (a claim committed while this one
// waited for its lock) gives no answer, and the statement runs again.
// When the snapshot already shows a live record that cannot be taken (a
// result, a live claim), nothing is inserted and no row is locked, so a
// replay is a read.
const reserveSQL = `
WITH ins AS (
  INSERT INTO idemcp_records AS r (key, fingerprint, owner, completed, response, lease_until, expires_at, waited, took_over, tool, pod, claimed_at)
  SELECT $1::text, $2::text, $3::text, false, NULL,
         now() + $4::bigint * interval '1 millisecond',
         now() + $5::bigint * interval '1 millisecond', false, false,
         nullif($8::text, ''), nullif($9::text, ''), now()
  WHERE NOT EXISTS (
    SELECT 1 FROM idemcp_records c WHERE c.key = $1::text AND c.expires_at > now()
      AND NOT (($6::boolean AND NOT c.completed AND c.lease_until <= now() AND c.fingerprint = $2::text)
        OR (c.completed AND coalesce(coalesce(c.response, ''::bytea) = $7::bytea, false))))
  ON CONFLICT (key) DO UPDATE SET
    fingerprint = excluded.fingerprint, owner = excluded.owner, completed = false, response = NULL,
    lease_until = excluded.lease_until, expires_at = excluded.expires_at, waited = false,
    tool = excluded.tool, pod = excluded.pod, claimed_at = excluded.claimed_at,
    took_over = r.expires_at > now() AND NOT r.completed
  WHERE r.expires_at <= now() OR ($6::boolean AND NOT r.completed AND r.lease_until <= now() AND r.fingerprint = $2::text)
    OR (r.completed AND coalesce(coalesce(r.response, ''::bytea) = $7::bytea, false))
  RETURNING r.took_over
)
SELECT 1, '', NULL::bytea, took_over, '', true FROM ins
UNION ALL
SELECT CASE WHEN r.completed THEN 2 WHEN r.lease_until > now() THEN 3 ELSE 4 END,
       r.fingerprint, CASE WHEN r.completed THEN r.response END, false,
       r.owner, coalesce(r.acked_owner = r.owner, false) OR ` + noStandbyWaitSQL + `
FROM idemcp_records r
WHERE r.key = $1::text AND r.expires_at > now() AND NOT EXISTS (SELECT 1 FROM ins)`

// errRace: the statement lost a race with a concurrent claim and must run
// again to see it.
var errRace = errors.New("raced with a concurrent claim")

const reserveAttempts = 10

// Reserve implements store.Store.
func (s *Store) Reserve(ctx context.Context, c store.Claim) (store.Reservation, error) {
	var res store.Reservation
	full := s.prefix + c.Key
	for range reserveAttempts {
		err := s.run(ctx, "reserve", c.Key, func(ctx context.Context) error {
			var code int
			var fp string
			var resp []byte
			var tookOver, vouched bool
			var owner string
			err := s.pool.QueryRow(ctx, reserveSQL, full, c.Fingerprint, c.Owner,
				millis(c.Lease), millis(max(c.Retention, c.Lease)), c.TakeOver, c.Discard, c.Tool, c.Pod).Scan(&code, &fp, &resp, &tookOver, &owner, &vouched)
			if errors.Is(err, pgx.ErrNoRows) {
				return errRace
			}
			if err != nil {
				return err
			}
			switch code {
			case codeWon:
				res = store.Reservation{State: store.Won, TookOver: tookOver}
			case codeCompleted:
				if resp == nil {
					resp = []byte{}
				}
				res = store.Reservation{State: store.Completed, Fingerprint: fp, Response: resp}
				if !vouched {
					return s.confirm(ctx, full, owner, &res)
				}
			case codePending:
				res = store.Reservation{State: store.Pending, Fingerprint: fp}
			case codeAbandoned:
				if c.TakeOver && fp == c.Fingerprint {
					// Another claim took it over after our snapshot.
					return errRace
				}
				res = store.Reservation{State: store.Abandoned, Fingerprint: fp}
			default:
				return fmt.Errorf("unexpected reply code %d", code)
			}
			return nil
		})
		if errors.Is(err, errRace) {
			continue
		}
		return res, err
	}
	return store.Reservation{}, unavailable("reserve", c.Key, errors.New("the claim kept racing with concurrent claims"))
}

const renewSQL = `
UPDATE idemcp_records SET
  lease_until = now() + $3::bigint * interval '1 millisecond',
  expires_at = greatest(expires_at, now() + $3::bigint * interval '1 millisecond')
WHERE key = $1::text AND owner = $2::text AND NOT completed AND expires_at > now()`

// Renew implements store.Store.
func (s *Store) Renew(ctx context.Context, key, owner string, lease time.Duration) error {
	return s.run(ctx, "renew", key, func(ctx context.Context) error {
		tag, err := s.pool.Exec(ctx, renewSQL, s.prefix+key, owner, millis(lease))
		return owned(tag, err)
	})
}

func owned(tag pgconn.CommandTag, err error) error {
	if err != nil {
		return err
	}
	if tag.RowsAffected() != 1 {
		return store.ErrNotOwner
	}
	return nil
}

// settledSQL wraps a statement that settles a claim ($1 key, $2 owner) and
// returns its waited column: the NOTIFY is sent, on commit, only when
// someone waits. pg_notify is volatile, so the planner keeps the call.
func settledSQL(modify string) string {
	return `
WITH m AS (` + modify + `),
n AS (SELECT pg_notify('` + Channel + `', $1::text) FROM m WHERE m.waited)
SELECT (SELECT count(*) FROM m), (SELECT count(*) FROM n)`
}

var releaseSQL = settledSQL(`
  DELETE FROM idemcp_records
  WHERE key = $1::text AND owner = $2::text AND NOT completed AND expires_at > now()
  RETURNING waited`)

func (s *Store) settle(ctx context.Context, op, key, sql string, args ...any) error {
	return s.run(ctx, op, key, func(ctx context.Context) error {
		var n, notified int64
		if err := s.pool.QueryRow(ctx, sql, args...).Scan(&n, &notified); err != nil {
			return err
		}
		if n != 1 {
			return store.ErrNotOwner
		}
		return nil
	})
}

// Complete implements store.Store (see complete in confirm.go).
func (s *Store) Complete(ctx context.Context, key, owner string, response []byte, ttl time.Duration) error {
	if response == nil {
		response = []byte{}
	}
	return s.complete(ctx, key, owner, response, ttl)
}

// Release implements store.Store.
func (s *Store) Release(ctx context.Context, key, owner string) error {
	return s.settle(ctx, "release", key, releaseSQL, s.prefix+key, owner)
}

// probeSQL returns the milliseconds left on a pending claim's lease, and
// marks it as waited on in the same statement, so its Complete or Release
// cannot miss a waiter that saw it pending. No row: not pending.
const probeSQL = `
UPDATE idemcp_records SET waited = true
WHERE key = $1::text AND NOT completed AND lease_until > now() AND expires_at > now()
RETURNING ceil(extract(epoch FROM lease_until - now()) * 1000)::bigint`

// Wait implements store.Store. It costs one statement, plus one per
// PollInterval while the claim stays pending; wake-ups arrive on the
// Store's one LISTEN connection.
func (s *Store) Wait(ctx context.Context, key string) error {
	full := s.prefix + key
	// Listen before reading the record: a Complete between the read and
	// the listening would otherwise go unnoticed until the next poll.
	w, listening := s.waiters.listen(ctx, full)
	defer s.waiters.stop(full, w)

	timer := time.NewTimer(s.poll)
	defer timer.Stop()
	for {
		resub := s.waiters.resubscribed()
		var left int64
		err := s.run(ctx, "wait", key, func(ctx context.Context) error {
			err := s.pool.QueryRow(ctx, probeSQL, full).Scan(&left)
			if errors.Is(err, pgx.ErrNoRows) {
				left = 0
				return nil
			}
			return err
		})
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
		if left <= 0 {
			return nil
		}
		poll := s.poll
		if !listening {
			poll = min(poll, 250*time.Millisecond)
		}
		timer.Reset(min(time.Duration(left)*time.Millisecond+10*time.Millisecond, poll))
		select {
		case <-w:
			return nil
		case <-resub:
			// Notifications sent while the listener was down are lost:
			// read the record again.
			listening = true
		case <-timer.C:
		case <-ctx.Done():
			return ctx.Err()
		case <-s.stop:
			return fmt.Errorf("postgres wait %s: %w: store closed", key, store.ErrUnavailable)
		}
	}
}

// KeyPrefix is the prefix the store puts before every key: Options.Prefix,
// or DefaultPrefix when that is empty. Seal records bound to this, not to
// Options.Prefix, so that "" and DefaultPrefix open each other's records.
func (s *Store) KeyPrefix() string { return s.prefix }

// Ping implements store.Store: the database answers and the schema is in
// place.
func (s *Store) Ping(ctx context.Context) error {
	return s.run(ctx, "ping", s.prefix, func(ctx context.Context) error {
		return s.pool.Ping(ctx)
	})
}

// cleanupSQL deletes at most $1 expired rows. SKIP LOCKED lets the
// janitors of several servers share the work without waiting on each
// other or on live claims.
const cleanupSQL = `
DELETE FROM idemcp_records WHERE key IN (
  SELECT key FROM idemcp_records WHERE expires_at <= now()
  ORDER BY expires_at LIMIT $1::integer FOR UPDATE SKIP LOCKED)`

// maxBatchesPerRun bounds one cleanup run, so that a large backlog is
// worked off over several runs rather than in one long burst.
const maxBatchesPerRun = 100

// Cleanup deletes expired rows in batches and reports how many went. The
// store runs it every CleanupInterval; it is exported for tests and for
// databases cleaned by a job.
func (s *Store) Cleanup(ctx context.Context) (int64, error) {
	var total int64
	for range maxBatchesPerRun {
		var n int64
		err := s.run(ctx, "cleanup", strconv.Itoa(s.batch), func(ctx context.Context) error {
			tag, err := s.pool.Exec(ctx, cleanupSQL, s.batch)
			n = tag.RowsAffected()
			return err
		})
		total += n
		if err != nil || n < int64(s.batch) {
			return total, err
		}
	}
	return total, nil
}

func (s *Store) janitor(every time.Duration) {
	defer close(s.done)
	if every < 0 {
		<-s.stop
		return
	}
	t := time.NewTicker(orDefault(every, DefaultCleanupInterval))
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			_, _ = s.Cleanup(ctx)
			cancel()
		}
	}
}

// Close implements store.Store.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		close(s.stop)
		<-s.done
		s.waiters.wait()
		s.pool.Close()
	})
	return nil
}
