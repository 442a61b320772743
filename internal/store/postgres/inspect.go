package pgstore

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcp/idemcp/internal/store"
)

var _ store.Inspector = (*Store)(nil)

// recordColumns are a record's columns as Records, Lookup and Drop read
// them: times as milliseconds from the database's now() (negative: past),
// so that a record's state does not depend on the skew between the
// database's clock and the reader's. A row written before schema version 3
// has no tool, pod or claim time (NULL: listed as unknown).
const recordColumns = `substr(key, length($1::text) + 1), coalesce(tool, ''), coalesce(pod, ''), completed,
  (extract(epoch FROM claimed_at - now()) * 1000)::bigint,
  (extract(epoch FROM lease_until - now()) * 1000)::bigint,
  (extract(epoch FROM expires_at - now()) * 1000)::bigint`

// recordsSQL lists the live records under the prefix $1, at most $2 (NULL:
// all). left() rather than LIKE: a prefix may hold % and _.
const recordsSQL = `SELECT ` + recordColumns + `
FROM idemcp_records
WHERE left(key, length($1::text)) = $1::text AND expires_at > now()
ORDER BY key
LIMIT $2::bigint`

const lookupSQL = `SELECT ` + recordColumns + `, CASE WHEN completed THEN coalesce(response, ''::bytea) END
FROM idemcp_records
WHERE key = $1::text || $2::text AND expires_at > now()`

type row struct {
	key, tool, pod         string
	completed              bool
	claimed, lease, expiry *int64
}

func (r *row) dest() []any {
	return []any{&r.key, &r.tool, &r.pod, &r.completed, &r.claimed, &r.lease, &r.expiry}
}

func (r *row) record(now time.Time) store.Record {
	at := func(ms *int64) time.Time {
		if ms == nil {
			return time.Time{}
		}
		return now.Add(time.Duration(*ms) * time.Millisecond)
	}
	rec := store.Record{Key: r.key, Tool: r.tool, Pod: r.pod, Completed: r.completed,
		Claimed: at(r.claimed), Expires: at(r.expiry)}
	if !r.completed {
		rec.LeaseUntil = at(r.lease)
	}
	return rec
}

// Records implements store.Inspector: one SELECT of the prefix's live rows.
func (s *Store) Records(ctx context.Context, limit int) ([]store.Record, error) {
	var lim *int64
	if limit > 0 {
		l := int64(limit)
		lim = &l
	}
	out := []store.Record{}
	err := s.run(ctx, "records", s.prefix+"*", func(ctx context.Context) error {
		out = out[:0]
		rows, err := s.pool.Query(ctx, recordsSQL, s.prefix, lim)
		if err != nil {
			return err
		}
		defer rows.Close()
		now := time.Now()
		for rows.Next() {
			var r row
			if err := rows.Scan(r.dest()...); err != nil {
				return err
			}
			out = append(out, r.record(now))
		}
		return rows.Err()
	})
	return out, err
}

// Lookup implements store.Inspector; the response is as stored (sealed,
// for a sidecar's store: store.Sealed opens it).
func (s *Store) Lookup(ctx context.Context, key string) (store.Record, []byte, error) {
	var rec store.Record
	var resp []byte
	err := s.run(ctx, "lookup", key, func(ctx context.Context) error {
		var r row
		err := s.pool.QueryRow(ctx, lookupSQL, s.prefix, key).Scan(append(r.dest(), &resp)...)
		if err != nil {
			return err
		}
		rec = r.record(time.Now())
		return nil
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return store.Record{}, nil, store.ErrNoRecord
	}
	return rec, resp, err
}

// dropSelectSQL locks the live record $1||$2 and reads it, with whether
// it is a claim whose lease is live on the database's clock. The lock
// orders the drop with a racing Renew or Complete: one that commits first
// is seen (FOR UPDATE reads the latest committed row), one that comes later
// finds no row.
const dropSelectSQL = `SELECT ` + recordColumns + `, NOT completed AND coalesce(lease_until > now(), false)
FROM idemcp_records WHERE key = $1::text || $2::text AND expires_at > now() FOR UPDATE`

// Drop implements store.Inspector in one transaction: the record is locked,
// checked and deleted, and its waiters woken (NOTIFY) when it commits.
func (s *Store) Drop(ctx context.Context, key string, d store.Drop) (store.Record, error) {
	var rec store.Record
	var verdict error
	err := s.run(ctx, "drop", key, func(ctx context.Context) error {
		return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			var r row
			var live bool
			err := tx.QueryRow(ctx, dropSelectSQL, s.prefix, key).Scan(append(r.dest(), &live)...)
			if errors.Is(err, pgx.ErrNoRows) {
				verdict = store.ErrNoRecord
				return nil
			}
			if err != nil {
				return err
			}
			rec = r.record(time.Now())
			switch {
			case r.completed != (d == store.DropResult):
				verdict = store.ErrWrongState
				return nil
			case live:
				verdict = store.ErrLeaseLive
				return nil
			}
			verdict = nil
			var waited bool
			if err := tx.QueryRow(ctx, `DELETE FROM idemcp_records WHERE key = $1::text || $2::text RETURNING waited`,
				s.prefix, key).Scan(&waited); err != nil {
				return err
			}
			if waited {
				if _, err := tx.Exec(ctx, `SELECT pg_notify('`+Channel+`', $1::text || $2::text)`, s.prefix, key); err != nil {
					return err
				}
			}
			return nil
		})
	})
	if err != nil {
		return store.Record{}, err
	}
	return rec, verdict
}
