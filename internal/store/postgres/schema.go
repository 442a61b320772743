package pgstore

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// The store's tables. A record is one row of idemcp_records:
//
//	key          prefix + the engine's key (a hash)
//	fingerprint  of the call
//	owner        token of the caller that holds (or completed) the claim
//	completed    false while pending
//	response     the stored response (completed only)
//	lease_until  when a pending claim's lease runs out, on the database's clock
//	expires_at   when the row stops counting; expired rows are ignored at
//	             once and deleted later in bounded batches
//	waited       set once someone waits, so that Complete and Release only
//	             NOTIFY when it can matter (a NOTIFY serializes commits)
//	took_over    set when a Reserve replaced an abandoned claim
//	acked_owner  the owner of a completed row once a commit of it is known
//	             to have waited for the synchronous standbys in full (see
//	             confirm.go); a row whose acked_owner is not its owner is
//	             confirmed before it is replayed
//	tool, pod    the claim's Claim.Tool and Claim.Pod, for kubectl idemcp
//	             keys (NULL: a row written before version 3, or by a
//	             caller that did not say)
//	claimed_at   when the claim was made, on the database's clock (NULL
//	             in rows written before version 3)
//
// The schema is versioned: idemcp_schema_migrations lists the migrations
// applied, and a store applies the missing ones, in order, under a
// transaction-scoped advisory lock, so sidecars starting together do not
// race and PgBouncer in transaction mode is fine.
var migrations = []string{
	1: `
CREATE TABLE IF NOT EXISTS idemcp_records (
  key         text        PRIMARY KEY,
  fingerprint text        NOT NULL,
  owner       text        NOT NULL,
  completed   boolean     NOT NULL DEFAULT false,
  response    bytea,
  lease_until timestamptz,
  expires_at  timestamptz NOT NULL,
  waited      boolean     NOT NULL DEFAULT false,
  took_over   boolean     NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS idemcp_records_expires_at ON idemcp_records (expires_at);
`,
	2: `
ALTER TABLE idemcp_records ADD COLUMN IF NOT EXISTS acked_owner text;
`,
	3: `
ALTER TABLE idemcp_records ADD COLUMN IF NOT EXISTS tool text;
ALTER TABLE idemcp_records ADD COLUMN IF NOT EXISTS pod text;
ALTER TABLE idemcp_records ADD COLUMN IF NOT EXISTS claimed_at timestamptz;
`,
}

// SchemaVersion is the version of the schema this code needs.
const SchemaVersion = 3

// migrationLock is the advisory lock key taken while migrating ("idemcp"
// in ASCII).
const migrationLock = 0x6964656d6370

func (s *Store) migrate(ctx context.Context) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1::bigint)`, int64(migrationLock)); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS idemcp_schema_migrations (
  version    integer     PRIMARY KEY,
  applied_at timestamptz NOT NULL DEFAULT now()
)`); err != nil {
		return err
	}
	var have int
	if err := tx.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM idemcp_schema_migrations`).Scan(&have); err != nil {
		return err
	}
	if have > SchemaVersion {
		return fmt.Errorf("the database has idemcp schema version %d, newer than this idemcp knows (%d): upgrade idemcp", have, SchemaVersion)
	}
	for v := have + 1; v <= SchemaVersion; v++ {
		if _, err := tx.Exec(ctx, migrations[v], pgx.QueryExecModeSimpleProtocol); err != nil {
			return fmt.Errorf("migration %d: %w", v, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO idemcp_schema_migrations (version) VALUES ($1::integer)`, v); err != nil {
			return fmt.Errorf("recording migration %d: %w", v, err)
		}
	}
	return tx.Commit(ctx)
}
