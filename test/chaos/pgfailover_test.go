package chaos_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
)

// PostgreSQL faults: the primary killed and its standby promoted (a new
// standby is then made from the new primary), at once or after the
// standby lost its connection to the primary for a moment, so that the
// primary went on without it (asynchronous) or waited for it (synchronous).
const (
	faultPGFailover       = "postgres failover (primary killed, standby promoted)"
	faultPGFailoverBehind = "postgres failover after the standby fell behind"
)

// TestChaosPostgresFailover runs the sidecars on a PostgreSQL primary with
// one synchronous streaming standby (synchronous_standby_names FIRST 1,
// synchronous_commit on, the guarantee docs/failure-modes.md states), and
// again and again kills the primary (an immediate shutdown, as a crash),
// promotes the standby and makes a new standby of the new primary where
// the old one was. The sidecars reach the pair by one URL that lists both
// addresses with target_session_attrs=read-write. With the lease well
// over a failover, a call that ran again after its answer, or a replay
// that differs, is a result or a claim the failover lost.
//
// CHAOS_PG_SYNC=0 runs it with the standby asynchronous, to see what
// synchronous replication is for: results and claims the failovers lose,
// run again (the test then fails).
func TestChaosPostgresFailover(t *testing.T) {
	r := run(t, section{onAbandoned: "Retry", lease: sentinelLease, postgres: true}, envDuration(t, 30*time.Second))
	if r.faults[faultPGFailover]+r.faults[faultPGFailoverBehind] == 0 {
		t.Errorf("no failover happened in %v", r.duration)
	}
	r.write(t)
}

// pgPair is a primary and its synchronous standby.
type pgPair struct {
	t                *testing.T
	primary, standby *pgtest.Server
	url              string
	longest          time.Duration
	state            string // the standby's sync_state: sync, or async (CHAOS_PG_SYNC=0)
}

func startPGPair(t *testing.T) *pgPair {
	t.Helper()
	primary := pgtest.Start(t)
	// In postgresql.auto.conf, which the standby's base backup copies: a
	// promoted standby asks for a synchronous standby of its own.
	p := &pgPair{t: t, primary: primary, state: "sync"}
	if os.Getenv("CHAOS_PG_SYNC") == "0" {
		p.state = "async"
	} else {
		pgtest.Exec(t, primary.URL, `ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 (standby)'`)
		pgtest.Exec(t, primary.URL, `SELECT pg_reload_conf()`)
	}
	p.standby = pgtest.StartStandby(t, primary, "standby")
	if !p.waitSync(30 * time.Second) {
		t.Fatalf("the standby %s did not become synchronous within 30s", p.standby.Addr)
	}
	p.url = fmt.Sprintf("postgres://postgres@%s,%s/postgres?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
		primary.Addr, p.standby.Addr)
	return p
}

// waitSync waits until the primary has its standby streaming, synchronous.
func (p *pgPair) waitSync(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, p.primary.URL)
		if err == nil {
			var n int
			err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_replication WHERE application_name = 'standby' AND sync_state = $1 AND state = 'streaming'`, p.state).Scan(&n)
			_ = conn.Close(ctx)
			if err == nil && n == 1 {
				cancel()
				return true
			}
		}
		cancel()
		time.Sleep(50 * time.Millisecond)
	}
	return false
}

// failOver kills the primary, promotes the standby, makes a new standby of
// it at the old primary's address, and records the window in which the
// store could not commit.
func (p *pgPair) failOver(w *world, behind bool) {
	start := time.Now()
	if behind {
		// The standby goes down for a moment, and the primary is killed
		// before it is back. Asynchronous, the primary commits without
		// it meanwhile, and the promoted standby does not have those
		// commits; synchronous, every commit waits, invisible, and dies
		// with the primary.
		w.fault(faultPGFailoverBehind)
		p.standby.Stop()
		time.Sleep(time.Duration(300+w.rnd.intn(700)) * time.Millisecond)
	} else {
		w.fault(faultPGFailover)
	}
	old := p.primary
	old.Stop()
	p.standby.Start() // a no-op unless it was stopped
	p.standby.Promote()
	p.primary = p.standby
	p.standby = pgtest.StartStandbyAt(p.t, p.primary, "standby", old.Addr)
	if !p.waitSync(30 * time.Second) {
		p.t.Errorf("failover: the new standby %s did not become synchronous within 30s", p.standby.Addr)
	}
	end := time.Now()
	p.longest = max(p.longest, end.Sub(start))
	w.t.Logf("%s failover from %s to %s took %v", end.Format("15:04:05.000"), old.Addr, p.primary.Addr, end.Sub(start).Round(time.Millisecond))
	// The sidecars find the new primary at their next connection: a
	// second more, at most, after it commits again.
	end = end.Add(redialProbe)
	w.mu.Lock()
	defer w.mu.Unlock()
	w.outages = append(w.outages, [2]time.Time{start, end})
	if w.mayLapse(end.Sub(start)) {
		w.pauses = append(w.pauses, [2]time.Time{start, end})
	}
}
