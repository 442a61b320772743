package pgstore

// Replays only of what a synchronous standby has.
//
// With synchronous replication (synchronous_standby_names, and
// synchronous_commit on or remote_apply), a commit returns once a
// synchronous standby has flushed it, and until then the row is invisible
// to every other session: a retry reads only results the standby has. A
// commit's wait can be cut short, though, and the row is then visible
// although the standby may not have it: the backend's wait cancelled
// (pg_cancel_backend, a client's cancel request) or the backend
// terminated (pg_terminate_backend, a fast shutdown), both with a WARNING
// "The transaction has already committed locally, but might not have been
// replicated to the standby"; synchronous_standby_names emptied while the
// commit waits; or a primary that crashed and restarted, which shows
// every commit in its WAL. Replayed then, a result can still be lost in a
// failover, and a later retry runs the call again.
//
// So, as the Redis store does with MinReplicas, a result is replayed only
// once a commit of it is known to have waited for the standbys in full:
// Complete marks its row (acked_owner, a second statement) after a commit
// that returned with no WARNING, and a Reserve that finds a row without
// the mark confirms it first: it commits a write to the row, whose commit
// waits for the standbys to have everything written before it, the
// result included (the WAL is one ordered stream). Confirmed, the result
// is replayed; not (an error, a timeout, a WARNING), the retry is told the
// call is still running (store.Pending), never to run it again.
//
// Where no commit waits for a standby (synchronous_standby_names empty,
// or synchronous_commit off or local), there is nothing to confirm with:
// rows count as confirmed, and nothing is written twice.

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemcp/idemcp/internal/store"
)

// noStandbyWaitSQL is true where a commit waits for no standby.
const noStandbyWaitSQL = `(current_setting('synchronous_standby_names') = '' OR current_setting('synchronous_commit') IN ('off', 'local'))`

// markSQL records that the row's result is on the synchronous standbys;
// its own commit waits for them, which is what confirms a row found
// without the mark.
const markSQL = `
UPDATE idemcp_records SET acked_owner = owner
WHERE key = $1::text AND owner = $2::text AND completed AND expires_at > now()`

// unconfirmedPause is how long a Reserve that could not confirm a result
// holds its caller before it reports the call still running, so that a
// confirmation that fails at once does not make its waiter spin.
const unconfirmedPause = 100 * time.Millisecond

// warnings counts the WARNINGs each connection has received: a commit
// whose wait for the standbys was cut short sends one, and nothing else
// tells its client.
type warnings struct{ m sync.Map } // *pgconn.PgConn -> *atomic.Int64

func (w *warnings) attach(cfg *pgxpool.Config) {
	cfg.ConnConfig.OnNotice = func(pc *pgconn.PgConn, n *pgconn.Notice) {
		if n.Severity == "WARNING" || n.SeverityUnlocalized == "WARNING" {
			w.counter(pc).Add(1)
		}
	}
	cfg.BeforeClose = func(c *pgx.Conn) { w.m.Delete(c.PgConn()) }
}

func (w *warnings) counter(pc *pgconn.PgConn) *atomic.Int64 {
	v, _ := w.m.LoadOrStore(pc, new(atomic.Int64))
	return v.(*atomic.Int64)
}

// onConn runs fn on one connection of the pool and reports whether that
// connection received a WARNING meanwhile.
func (s *Store) onConn(ctx context.Context, fn func(*pgxpool.Conn) error) (warned bool, err error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return false, err
	}
	defer conn.Release()
	c := s.warned.counter(conn.Conn().PgConn())
	before := c.Load()
	err = fn(conn)
	return c.Load() != before, err
}

// completeMarkedSQL stores a result and says whether its commit waits for
// a standby.
var completeMarkedSQL = settledSQL(`
  UPDATE idemcp_records SET completed = true, response = $3::bytea, lease_until = NULL,
    expires_at = now() + $4::bigint * interval '1 millisecond'
  WHERE key = $1::text AND owner = $2::text AND NOT completed AND expires_at > now()
  RETURNING waited`) + `, ` + noStandbyWaitSQL

// complete stores a result, then marks it confirmed if its commit waited
// for the standbys in full.
func (s *Store) complete(ctx context.Context, key, owner string, response []byte, ttl time.Duration) error {
	full := s.prefix + key
	var noWait bool
	var warned bool
	err := s.run(ctx, "complete", key, func(ctx context.Context) error {
		var n, notified int64
		var err error
		warned, err = s.onConn(ctx, func(c *pgxpool.Conn) error {
			return c.QueryRow(ctx, completeMarkedSQL, full, owner, response, millis(ttl)).Scan(&n, &notified, &noWait)
		})
		if err != nil {
			return err
		}
		if n != 1 {
			return store.ErrNotOwner
		}
		return nil
	})
	if err != nil || noWait || warned {
		// Unmarked, the first replay confirms it.
		return err
	}
	// Best effort: without the mark the first replay confirms it.
	_ = s.run(ctx, "complete", key, func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, markSQL, full, owner)
		return err
	})
	return nil
}

// confirm settles a Reserve that found the completed row of owner without
// the mark: res is replayed only if a commit to the row waits for the
// standbys in full now.
func (s *Store) confirm(ctx context.Context, full, owner string, res *store.Reservation) error {
	var tag pgconn.CommandTag
	warned, err := s.onConn(ctx, func(c *pgxpool.Conn) error {
		var err error
		tag, err = c.Exec(ctx, markSQL, full, owner)
		return err
	})
	switch {
	case err == nil && !warned && tag.RowsAffected() == 1:
		return nil
	case err == nil && tag.RowsAffected() == 0:
		return errRace // the row changed since: read it again
	}
	// The result exists, but nobody can say yet whether a failover keeps
	// it: the call is reported still running, never run again.
	*res = store.Reservation{State: store.Pending, Fingerprint: res.Fingerprint}
	t := time.NewTimer(unconfirmedPause)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	return nil
}
