package chaos_test

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

const (
	sentinelMaster = "idemcp"
	// sentinelDownAfter is Sentinel's down-after-milliseconds: how long a
	// primary that does not answer is given before it is failed over.
	sentinelDownAfter = time.Second
	// sentinelLease is the lease of the Sentinel section. A failover keeps
	// the store from acknowledging writes for sentinelDownAfter (a killed
	// primary), up to a second until Sentinel sees the replica promoted,
	// and the old primary's resync as the new replica (with
	// --redis-min-replicas 1 a write needs it): 1 to 3 seconds, and a
	// sidecar may find the store back up to redialProbe later. An owner
	// renews every lease/3, so its claim has at least 2/3 of the lease left
	// when a failover starts: 6s leaves 4s, and a failover shorter than 3s
	// may let no claim lapse (mayLapse).
	sentinelLease = 6 * time.Second
	// switchTimeout bounds the wait for Sentinel to name the new primary.
	switchTimeout = 20 * time.Second
)

// failoverSet is a primary and its replica, managed by one Sentinel.
type failoverSet struct {
	t        *testing.T
	nodes    [2]*redistest.Server
	sentinel *redistest.Server
	// mu is held while a failover is under way.
	mu sync.Mutex
	// primary is the address of the primary once the last failover is
	// over.
	primary string
	// longest is the longest failover: from the fault until the new
	// primary has its replica in sync again.
	longest time.Duration
}

func startFailoverSet(t *testing.T, extra ...string) *failoverSet {
	primary := redistest.Start(t, extra...)
	replica := redistest.StartReplica(t, primary, extra...)
	f := &failoverSet{t: t, nodes: [2]*redistest.Server{primary, replica}, primary: primary.Addr}
	f.sentinel = redistest.StartSentinelWith(t, primary, sentinelMaster, sentinelDownAfter)
	// Sentinel learns of the replica from the primary's INFO: until then
	// it has none to promote.
	_, port, _ := net.SplitHostPort(replica.Addr)
	if !f.waitFor(switchTimeout, func() bool {
		out, err := redistest.Do(f.sentinel.Addr, "SENTINEL", "REPLICAS", sentinelMaster)
		return err == nil && strings.Contains(out, "\nport\n"+port+"\n") && strings.Contains(out, "\nflags\nslave\n")
	}) {
		t.Fatalf("Sentinel at %s did not list the replica %s within %v", f.sentinel.Addr, replica.Addr, switchTimeout)
	}
	return f
}

func (f *failoverSet) waitFor(d time.Duration, ok func() bool) bool {
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// primaryAddr is the primary Sentinel names.
func (f *failoverSet) primaryAddr() string {
	out, err := redistest.Do(f.sentinel.Addr, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", sentinelMaster)
	if err != nil {
		return ""
	}
	return strings.Replace(out, "\n", ":", 1)
}

// settledOn reports whether Sentinel holds addr as the primary, with no
// failover in progress.
func (f *failoverSet) settledOn(addr string) bool {
	out, err := redistest.Do(f.sentinel.Addr, "SENTINEL", "MASTER", sentinelMaster)
	if err != nil {
		return false
	}
	kv := strings.Split(out, "\n")
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return net.JoinHostPort(m["ip"], m["port"]) == addr && !strings.Contains(m["flags"], "failover")
}

// inSync reports whether primary serves as one with its replica online,
// so that a write waiting for one replica (WAIT 1) is acknowledged.
func inSync(primary, replica *redistest.Server) bool {
	p, err := redistest.Do(primary.Addr, "INFO", "replication")
	if err != nil || !strings.Contains(p, "role:master") || !strings.Contains(p, "connected_slaves:1") || !strings.Contains(p, "state=online") {
		return false
	}
	r, err := redistest.Do(replica.Addr, "INFO", "replication")
	return err == nil && strings.Contains(r, "master_link_status:up") && strings.Contains(r, "master_port:"+port(primary.Addr))
}

func port(addr string) string {
	_, p, _ := net.SplitHostPort(addr)
	return p
}

// failOver fails the primary over to the replica: by SENTINEL FAILOVER
// (forced), or by SIGKILLing the primary so that Sentinel finds it down
// and promotes the replica. The old primary then rejoins as the new one's
// replica, and failOver returns once writes are acknowledged again, so
// that a later failover can happen.
func (f *failoverSet) failOver(w *world, forced bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	old, next := f.roles()
	if !inSync(old, next) {
		// Sentinel is failing over on its own, and watch settles it.
		w.t.Logf("%s primary %s and replica %s are not in sync; no failover this time", time.Now().Format("15:04:05.000"), old.Addr, next.Addr)
		return
	}
	start := time.Now()
	if forced {
		if _, err := redistest.Do(f.sentinel.Addr, "SENTINEL", "FAILOVER", sentinelMaster); err != nil {
			// NOGOODSLAVE until Sentinel has read the new replica's INFO
			// (every 10 seconds), INPROG while a failover runs.
			w.t.Logf("%s SENTINEL FAILOVER refused: %v; no failover this time", start.Format("15:04:05.000"), err)
			return
		}
		w.fault(faultFailoverForced)
	} else {
		w.fault(faultFailoverKilled)
		old.Stop()
	}
	// Sentinel names the new primary while it still repoints replicas:
	// wait for the failover to end before the old primary comes back.
	switched := f.waitFor(switchTimeout, func() bool { return f.settledOn(next.Addr) })
	if !forced {
		// Back as a primary until it is told to replicate.
		old.Start()
	}
	if !switched {
		f.t.Errorf("failover: Sentinel did not name %s the primary within %v", next.Addr, switchTimeout)
		return
	}
	f.rejoin(w, start, old, next)
}

// roles are the primary Sentinel names (the last one seen if Sentinel
// cannot be asked) and the other node.
func (f *failoverSet) roles() (primary, replica *redistest.Server) {
	addr := f.primaryAddr()
	if addr == "" {
		addr = f.primary
	}
	if addr == f.nodes[1].Addr {
		return f.nodes[1], f.nodes[0]
	}
	return f.nodes[0], f.nodes[1]
}

// rejoin makes the old primary the new one's replica, waits until writes
// are acknowledged again, and records the failover's window from start.
func (f *failoverSet) rejoin(w *world, start time.Time, old, next *redistest.Server) {
	// Sentinel repoints the old primary at the new one itself, but only
	// some ten seconds after the failover; until then, with
	// --redis-min-replicas 1, the new primary acknowledges no write. Do at
	// once what Sentinel would, as a pod's start-up script asking Sentinel
	// for the primary does.
	for _, cmd := range [][]string{{"REPLICAOF", "127.0.0.1", port(next.Addr)}, {"CONFIG", "REWRITE"}} {
		if _, err := redistest.Do(old.Addr, cmd...); err != nil {
			f.t.Errorf("failover: %s on the old primary %s: %v", strings.Join(cmd, " "), old.Addr, err)
		}
	}
	if !f.waitFor(switchTimeout, func() bool { return inSync(next, old) }) {
		f.t.Errorf("failover: the old primary %s did not sync with the new one %s within %v", old.Addr, next.Addr, switchTimeout)
	}
	end := time.Now()
	f.primary = next.Addr
	f.longest = max(f.longest, end.Sub(start))
	w.t.Logf("%s failover from %s to %s took %v", end.Format("15:04:05.000"), old.Addr, next.Addr, end.Sub(start).Round(time.Millisecond))
	w.mu.Lock()
	defer w.mu.Unlock()
	w.outages = append(w.outages, [2]time.Time{start, end})
	// A failover long enough to let a claim lapse is counted as a pause
	// would be; no claim may lapse in a shorter one.
	if w.mayLapse(end.Sub(start)) {
		w.pauses = append(w.pauses, [2]time.Time{start, end})
	}
}

// watch follows Sentinel until ctx ends. Sentinel may fail over on its own
// (on a loaded machine a primary can miss PINGs for down-after): that
// failover is completed as an injected one is, counted, and its window
// recorded from down-after and a second (Sentinel's promotion) before
// Sentinel was last seen naming the old primary.
func (f *failoverSet) watch(ctx context.Context, w *world) {
	seen := time.Now()
	for ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
		f.mu.Lock()
		if addr := f.primaryAddr(); addr != "" && addr != f.primary {
			w.fault(faultFailoverUnplanned)
			next, old := f.roles()
			f.rejoin(w, seen.Add(-sentinelDownAfter-time.Second), old, next)
		}
		seen = time.Now()
		f.mu.Unlock()
	}
}
