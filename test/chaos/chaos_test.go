// Package chaos_test runs many retrying agents through three idemcp
// sidecar processes that share a real Redis, in front of a counting MCP
// server, while it injects faults, then checks the guarantees at the end.
//
// CHAOS_SEED and CHAOS_DURATION (a Go duration, per run) override the
// defaults; the seed is printed so a failing run can be replayed.
// CHAOS_MIN_REPLICAS is for TestChaosSentinelFailover (see there).
package chaos_test

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/test/history"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/test/poll"
	"github.com/idemcp/idemcp/test/procs"
)

const (
	defaultSeed = 17
	// lease of the sections with a single Redis: short, so that a pause
	// longer than it is cheap.
	lease  = time.Second
	agents = 12
	// patience is how long an agent retries one call before it gives up
	// and the call counts as left without an answer. It is a time, not a
	// number of attempts: a run of failovers answers "retry later" for
	// seconds at a time (CI saw 12 attempts used up in 15s), while a
	// wedged key answers so for good.
	patience = 60 * time.Second
	// stallFor is how long a stalled client stops reading.
	stallFor = 2 * time.Second
)

// Fault kinds the harness injects.
const (
	faultDrop          = "client drop mid-call"
	faultStall         = "client stall"
	faultUpstreamFail  = "upstream fail"
	faultUpstreamHang  = "upstream hang"
	faultRedisRestart  = "redis restart"
	faultRedisPause    = "redis pause > lease"
	faultSidecarKilled = "sidecar SIGKILL"
	faultClockStep     = "clock step on sidecar 0 (within the seal's expiry grace)"
	// A Sentinel failover of the primary to its replica, asked of
	// Sentinel, or after the primary was SIGKILLed.
	faultFailoverForced = "redis sentinel failover (SENTINEL FAILOVER)"
	faultFailoverKilled = "redis sentinel failover (primary SIGKILL)"
	// A failover Sentinel started on its own.
	faultFailoverUnplanned = "redis sentinel failover (unplanned, by Sentinel)"
)

func TestMain(m *testing.M) {
	code := m.Run()
	procs.Cleanup()
	os.Exit(code)
}

func TestChaos(t *testing.T) {
	r := run(t, section{onAbandoned: "Retry", lease: lease}, envDuration(t, 30*time.Second))
	r.write(t)
}

// TestChaosAtMostOnce runs the same faults with onAbandoned: Error: no
// call runs twice, and every call whose owner was lost is answered -32012.
func TestChaosAtMostOnce(t *testing.T) {
	r := run(t, section{onAbandoned: "Error", lease: lease}, envDuration(t, 25*time.Second))
	if r.executions > r.logical {
		t.Errorf("onAbandoned: Error ran %d executions for %d logical calls", r.executions, r.logical)
	}
	if r.ambiguous == 0 {
		t.Errorf("no call was answered outcome unknown (%d): the faults left no owner behind", mcpmsg.CodeOutcomeUnknown)
	}
	r.write(t)
}

// TestChaosSentinelFailover runs the sidecars on a Sentinel-managed
// primary and replica with --redis-min-replicas 1, and fails the primary
// over to the replica again and again, by SENTINEL FAILOVER and by
// SIGKILLing it (the old primary then rejoins as a replica). Its lease is
// well over the time a failover keeps the store from acknowledging
// writes, as docs/failure-modes.md asks: no claim lapses in a failover,
// so a call that ran again after its answer, or a replay that differs,
// is a result or a claim the failover lost.
//
// CHAOS_MIN_REPLICAS=0 runs it without waiting for the replica, to see
// what the option is for: results and claims the failovers lose, run
// again (the test then fails).
func TestChaosSentinelFailover(t *testing.T) {
	minReplicas := 1
	if v := os.Getenv("CHAOS_MIN_REPLICAS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			t.Fatalf("CHAOS_MIN_REPLICAS=%q: want 0 or 1", v)
		}
		minReplicas = n
	}
	r := run(t, section{onAbandoned: "Retry", lease: sentinelLease, sentinel: true, minReplicas: minReplicas}, envDuration(t, 30*time.Second))
	if r.faults[faultFailoverForced]+r.faults[faultFailoverKilled] == 0 {
		t.Errorf("no failover happened in %v", r.duration)
	}
	r.write(t)
	r.writeSeed(t)
}

// TestChaosClockStep seals the results with one key for the three
// sidecars and steps one sidecar's clock (by which sealed expiries are
// written and checked) forward and back, up to 100s, while Redis restarts
// and pauses: within the seal's expiry grace nothing runs twice, every
// replay is the stored result, and no sidecar takes a live result as
// expired.
func TestChaosClockStep(t *testing.T) {
	r := run(t, section{onAbandoned: "Retry", lease: lease, clockStep: true}, envDuration(t, 25*time.Second))
	if r.faults[faultClockStep] == 0 {
		t.Errorf("no clock step in %v", r.duration)
	}
	r.write(t)
}

// section is what one chaos test runs.
type section struct {
	onAbandoned string
	lease       time.Duration
	// sentinel: a primary, a replica and a Sentinel instead of one Redis;
	// failovers instead of restarts and pauses.
	sentinel bool
	// minReplicas is the sidecars' --redis-min-replicas.
	minReplicas int
	// toxics: the sidecars reach Redis through a fault proxy, and the
	// network between them misbehaves instead of Redis restarting and
	// pausing.
	toxics bool
	// postgres: a PostgreSQL primary and its synchronous standby instead
	// of Redis; failovers instead of restarts and pauses.
	postgres bool
	// clockStep: results are sealed, and one sidecar's clock (which sealed
	// expiries are written and checked by) steps forward and back within
	// the seal's expiry grace instead of sidecars being killed.
	clockStep bool
}

func (s section) title() string {
	if s.toxics {
		return fmt.Sprintf("onAbandoned: %s, store network faults (toxiproxy)", s.onAbandoned)
	}
	if s.postgres {
		return fmt.Sprintf("onAbandoned: %s, PostgreSQL failover to a synchronous standby", s.onAbandoned)
	}
	if s.sentinel {
		return fmt.Sprintf("onAbandoned: %s, Sentinel failover, min-replicas %d", s.onAbandoned, s.minReplicas)
	}
	if s.clockStep {
		return fmt.Sprintf("onAbandoned: %s, sealed results, a clock stepping on one sidecar", s.onAbandoned)
	}
	return "onAbandoned: " + s.onAbandoned
}

func envDuration(t *testing.T, def time.Duration) time.Duration {
	if v := os.Getenv("CHAOS_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("CHAOS_DURATION=%q: %v (want a Go duration such as 30s)", v, err)
		}
		return d
	}
	return def
}

func seed(t *testing.T) uint64 {
	if v := os.Getenv("CHAOS_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("CHAOS_SEED=%q: %v (want an unsigned integer)", v, err)
		}
		return n
	}
	return defaultSeed
}

type report struct {
	title        string
	lease        time.Duration
	seed         uint64
	duration     time.Duration
	logical      int
	attempts     int
	retries      int
	executions   int
	duplicates   int
	mismatches   int
	unanswered   int
	ambiguous    int // calls answered -32012 in the end
	superseded   int
	lostWithSide int
	raced        int
	replayedLost int
	lostClaims   int
	// answers -32013 to attempts that overlapped no store outage
	unavailableOutside int
	faults             map[string]int
	codes              map[string]int
	goroutines         [2]int
	sidecarGor         [2]float64
	sidecarHeap        [2]float64
	verification       int
	// failover: the longest time a failover kept the store from
	// acknowledging writes, and whether any reached the lease.
	longestFailover time.Duration
}

type world struct {
	t           *testing.T
	rnd         *lockedRand
	redis       *redistest.Server
	sidecars    []*procs.Sidecar
	mu          sync.Mutex
	execs       map[string][]time.Time
	completions map[string][]history.Completion
	restarts    []time.Time    // when Redis lost its data
	killed      [][2]time.Time // per sidecar kill window, indexed with killedBy
	killedBy    []int
	faults      map[string]int
	codes       map[string]int
	attempts    atomic.Int64
	transport   *http.Transport
	persistent  bool // Redis keeps its data across restarts
	// pauses of Redis longer than the lease; with onAbandoned: Retry a
	// claim whose lease ran out during one is taken over.
	pauses [][2]time.Time
	// outages: every window in which Redis was stopped or paused, however
	// short. A result answered then is stored only once Redis is back, after
	// the engine's store-retry backoff.
	outages     [][2]time.Time
	onAbandoned string
	lease       time.Duration
	failover    *failoverSet
	toxics      *storeProxy
	pg          *pgPair
	// unavailable: attempts answered -32013, from start to answer.
	unavailable [][2]time.Time
	// clockFile holds sidecar 0's clock offset (the clock-step section).
	clockFile string
	// violations: the classifier's explanation of each execution or
	// answer that breaks a guarantee, repeated beside the test's error
	// (CI keeps only part of a long log).
	violations []string
}

type lockedRand struct {
	mu sync.Mutex
	r  *rand.Rand
}

func (l *lockedRand) float() float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Float64()
}

func (l *lockedRand) intn(n int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.IntN(n)
}

func (w *world) fault(kind string) {
	if kind != faultDrop && kind != faultStall {
		w.t.Logf("%s fault: %s", time.Now().Format("15:04:05.000"), kind)
	}
	w.mu.Lock()
	w.faults[kind]++
	w.mu.Unlock()
}

func (w *world) code(kind string) {
	w.mu.Lock()
	w.codes[kind]++
	w.mu.Unlock()
}

func run(t *testing.T, sec section, duration time.Duration) *report {
	bin := procs.Binary(t)
	s := seed(t)
	onAbandoned := sec.onAbandoned
	t.Logf("chaos: seed %d (CHAOS_SEED), duration %v (CHAOS_DURATION), %s, lease %v", s, duration, sec.title(), sec.lease)
	w := &world{
		t: t, rnd: &lockedRand{r: rand.New(rand.NewPCG(s, 0x1de3c9))},
		execs: map[string][]time.Time{}, completions: map[string][]history.Completion{},
		faults: map[string]int{}, codes: map[string]int{}, transport: newClientTransport(),
		persistent: true, onAbandoned: onAbandoned, lease: sec.lease,
	}

	// Redis keeps an append-only file synced on every write, so a restart
	// (SIGKILL) loses nothing: the guarantees hold while the store does.
	// Without persistence a restart loses claims and results; w.restarts
	// then records the loss and the checks allow for it.
	persist := []string{"--appendonly", "yes", "--appendfsync", "always"}
	storeSpec := ""
	sidecarArgs := []string{"--redis-key-prefix", "idemcp:chaos/" + onAbandoned + ":"}
	switch {
	case sec.postgres:
		w.pg = startPGPair(t)
		sidecarArgs = []string{"--store", "postgres", "--postgres-url", w.pg.url,
			"--postgres-key-prefix", "idemcp:chaos/" + onAbandoned + ":", "--log-level", "warn"}
	case sec.sentinel:
		// A killed primary rejoins as a replica and resyncs from the new
		// one, so what it persisted does not matter; fsync on every write
		// only stalls it, and a primary stalled for down-after is failed
		// over by Sentinel on its own.
		w.failover = startFailoverSet(t, "--appendonly", "yes", "--appendfsync", "everysec")
		storeSpec = fmt.Sprintf("{addresses: [%q], sentinelMaster: %s}", w.failover.sentinel.Addr, sentinelMaster)
		// Warnings too (store writes retried, renewals failing), printed
		// only when the run fails.
		sidecarArgs = append(sidecarArgs, "--redis-min-replicas", strconv.Itoa(sec.minReplicas), "--log-level", "warn")
	default:
		w.redis = redistest.Start(t, persist...)
		storeSpec = fmt.Sprintf("{addresses: [%q]}", w.redis.Addr)
		if sec.toxics {
			w.toxics = startStoreProxy(t, w.redis.Addr)
			storeSpec = fmt.Sprintf("{addresses: [%q]}", w.toxics.addr)
		}
	}
	srv := mcpserver.New()
	srv.MCP.AddReceivingMiddleware(w.countExecutions)
	upstream := httptest.NewServer(w.upstreamFaults(srv.Handler(true)))
	defer upstream.Close()

	policy := filepath.Join(t.TempDir(), "policy.yaml")
	store := fmt.Sprintf("{type: Redis, redis: {external: %s}}", storeSpec)
	if sec.postgres {
		store = "{type: Memory}" // --store postgres overrides it
	}
	body := fmt.Sprintf("spec: {leaseDuration: %v, waitTimeout: 3s, onAbandoned: %s, keyScope: Principal, store: %s}\n",
		sec.lease, onAbandoned, store)
	if err := os.WriteFile(policy, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	var env [3][]string
	if sec.clockStep {
		// A build whose wall clock a file steps (the faultclock tag), one
		// seal key for the three, and sidecar 0's clock in that file.
		bin = procs.Build(t, "github.com/idemcp/idemcp", "-tags", "faultclock")
		key := make([]byte, 32)
		_, _ = crand.Read(key)
		w.clockFile = filepath.Join(t.TempDir(), "clock-offset")
		if err := os.WriteFile(w.clockFile, []byte("0s"), 0o600); err != nil {
			t.Fatal(err)
		}
		for i := range env {
			env[i] = []string{"IDEMCP_SEAL_KEYS=" + base64.StdEncoding.EncodeToString(key)}
		}
		env[0] = append(env[0], "IDEMCP_FAULT_CLOCK_FILE="+w.clockFile)
	}
	for i := range 3 {
		w.sidecars = append(w.sidecars, procs.StartSidecar(t, bin, env[i],
			append([]string{"--upstream", upstream.URL, "--policy-file", policy}, sidecarArgs...)...))
	}
	r := &report{title: sec.title(), lease: sec.lease, seed: s, duration: duration}
	time.Sleep(300 * time.Millisecond)
	for _, sc := range w.sidecars {
		g, _ := sc.Metric("go_goroutines")
		r.sidecarGor[0] = max(r.sidecarGor[0], g)
		h, _ := sc.Metric("go_memstats_heap_inuse_bytes")
		r.sidecarHeap[0] = max(r.sidecarHeap[0], h)
	}

	baseGoroutines := runtime.NumGoroutine()
	ctx, stop := context.WithTimeout(context.Background(), duration)
	defer stop()
	var wg sync.WaitGroup
	var logical, retries, unanswered, ambiguous atomic.Int64
	for a := range agents {
		wg.Go(func() {
			ag := newAgent(w, a)
			defer ag.close()
			for n := 0; ctx.Err() == nil; n++ {
				id := fmt.Sprintf("agent%d-call%d", a, n)
				logical.Add(1)
				out := ag.logicalCall(id)
				retries.Add(int64(out.attempts - 1))
				switch out.final {
				case "ok":
				case strconv.Itoa(mcpmsg.CodeOutcomeUnknown):
					ambiguous.Add(1)
				default:
					unanswered.Add(1)
					t.Errorf("logical call %s got no result after %d attempts: last %s\n%s", id, out.attempts, out.final, strings.Join(out.trace, "\n"))
				}
			}
		})
	}
	wg.Go(func() { w.injectInfraFaults(ctx) })
	if w.failover != nil {
		wg.Go(func() { w.failover.watch(ctx, w) })
	}
	wg.Wait()

	// Every sidecar and Redis are up again; every completed call, retried
	// now, gets its stored result unless Redis lost it since.
	for _, sc := range w.sidecars {
		sc.Start()
	}
	if w.redis != nil {
		w.redis.Start()
	}
	verifyStart := time.Now()
	r.verification = w.verify()
	t.Logf("verification took %v", time.Since(verifyStart))

	w.mu.Lock()
	r.logical = int(logical.Load())
	r.attempts = int(w.attempts.Load())
	r.retries = int(retries.Load())
	r.unanswered = int(unanswered.Load())
	r.ambiguous = int(ambiguous.Load())
	r.faults, r.codes = w.faults, w.codes
	v := w.history().Classify()
	w.mu.Unlock()
	r.executions, r.duplicates, r.mismatches = v.Executions, v.Duplicates, v.Mismatches
	r.superseded, r.lostWithSide, r.raced, r.lostClaims = v.TakenOver, v.LostWithSidecar, v.Raced, v.LostClaims
	r.replayedLost = v.ReplayedThenLost
	if w.failover != nil {
		r.longestFailover = w.failover.longest
	}
	if w.pg != nil {
		r.longestFailover = w.pg.longest
	}
	r.unavailableOutside = w.unavailableOutsideOutages()

	// Resources back to baseline once the traffic is over. The fault
	// proxy's goroutines are the sidecars' connections to Redis, held in
	// this process: it goes first.
	if w.clockFile != "" {
		w.checkSealed(storeSpecAddr(w))
	}
	if w.toxics != nil {
		w.toxics.proxy.Stop()
	}
	upstream.CloseClientConnections()
	w.transport.CloseIdleConnections()
	deadline := time.Now().Add(15 * time.Second)
	for {
		r.goroutines = [2]int{baseGoroutines, runtime.NumGoroutine()}
		var g, h float64
		for _, sc := range w.sidecars {
			gi, err := sc.Metric("go_goroutines")
			if err != nil {
				t.Errorf("reading a sidecar's metrics: %v", err)
			}
			hi, _ := sc.Metric("go_memstats_heap_inuse_bytes")
			g, h = max(g, gi), max(h, hi)
		}
		r.sidecarGor[1], r.sidecarHeap[1] = g, h
		if (r.goroutines[1] <= r.goroutines[0]+10 && g <= r.sidecarGor[0]+10) || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}

	t.Log("\n" + r.String())
	if r.duplicates != 0 || r.lostClaims != 0 {
		// The sidecars log errors only (lost claims, failed store writes):
		// what each owner saw.
		for i, sc := range w.sidecars {
			if b, err := os.ReadFile(sc.Log()); err == nil {
				t.Logf("sidecar %d log:\n%s", i, b)
			}
		}
	}
	if len(w.violations) != 0 {
		t.Errorf("what broke a guarantee, with the faults around it:\n%s\n%s", strings.Join(w.violations, "\n"), w.faultWindows())
	}
	if r.duplicates != 0 {
		t.Errorf("%d executions ran while the call's result was stored", r.duplicates)
	}
	if r.lostClaims != 0 {
		t.Errorf("%d executions ran while an earlier one held the call's claim, with no fault to end it: the store lost the claim", r.lostClaims)
	}
	if r.mismatches != 0 {
		t.Errorf("%d retries of a completed call got a different result than the one stored", r.mismatches)
	}
	if r.replayedLost != 0 {
		t.Errorf("%d replays handed out a result no replica had, which a failover then lost, and a retry ran the call again", r.replayedLost)
	}
	if r.codes["other"] != 0 {
		t.Errorf("%d attempts got neither a result nor a clear idemcp error", r.codes["other"])
	}
	if r.goroutines[1] > r.goroutines[0]+10 {
		var stacks strings.Builder
		_ = pprof.Lookup("goroutine").WriteTo(&stacks, 1)
		t.Log(stacks.String())
		t.Errorf("goroutines in the test process: %d after the run, %d before", r.goroutines[1], r.goroutines[0])
	}
	if r.sidecarGor[1] > r.sidecarGor[0]+10 {
		t.Errorf("sidecar goroutines: %.0f after the run, %.0f at the start", r.sidecarGor[1], r.sidecarGor[0])
	}
	if r.sidecarHeap[1] > 4*r.sidecarHeap[0]+16<<20 {
		t.Errorf("sidecar heap in use: %.1f MiB after the run, %.1f MiB at the start", r.sidecarHeap[1]/(1<<20), r.sidecarHeap[0]/(1<<20))
	}
	return r
}

// unavailableOutsideOutages counts the attempts answered -32013 that
// overlapped no outage of the store (nor the second after one, while
// connections are made again), and logs them.
func (w *world) unavailableOutsideOutages() int {
	n := 0
	for _, u := range w.unavailable {
		inOutage := false
		for _, o := range w.outages {
			if o[0].Before(u[1]) && o[1].Add(time.Second).After(u[0]) {
				inOutage = true
			}
		}
		if !inOutage {
			n++
			w.t.Logf("attempt from %s to %s answered -32013 with the store up", u[0].Format("15:04:05.000"), u[1].Format("15:04:05.000"))
		}
	}
	return n
}

// countExecutions records every charge that took effect, by logical call.
func (w *world) countExecutions(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		// An execution counts from when the sidecar dispatched it: one sent
		// before the call completed raced its owner, it did not ignore a
		// stored result. That is when it reached upstreamFaults, before
		// any hang it injected: a hung execution runs up to lease+1.5s
		// later, maybe after a store outage during which its claim lapsed
		// and a retry took it over (CI saw one dispatched at 04.58, hung,
		// run at 06.81, and its take-over at 06.86, after a pause of
		// Redis from 04.76 to 06.78, counted as a lost claim).
		dispatched, ok := ctx.Value(arrivedKey{}).(time.Time)
		if !ok && method == "tools/call" {
			w.t.Errorf("a tools/call reached the server without the time it arrived (upstreamFaults)")
			dispatched = time.Now()
		}
		res, err := next(ctx, method, req)
		ctr, ok := req.(*mcp.CallToolRequest)
		// One whose context was cancelled just after it charged counts too.
		if method != "tools/call" || !ok || !mcpserver.Charged(res, err) {
			return res, err
		}
		var args mcpserver.ChargeArgs
		if json.Unmarshal(ctr.Params.Arguments, &args) == nil {
			w.mu.Lock()
			w.execs[args.Card] = append(w.execs[args.Card], dispatched)
			w.mu.Unlock()
		}
		return res, err
	}
}

// arrivedKey is the context key of the time a request reached
// upstreamFaults, as its sidecar dispatched it.
type arrivedKey struct{}

// upstreamFaults makes some tools/call requests fail before they reach the
// server (the connection is aborted) or hang for longer than the lease.
func (w *world) upstreamFaults(next http.Handler) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		r = r.WithContext(context.WithValue(r.Context(), arrivedKey{}, time.Now()))
		if r.Method == http.MethodPost && r.Header.Get("Mcp-Method") == "tools/call" {
			switch p := w.rnd.float(); {
			case p < 0.05:
				w.fault(faultUpstreamFail)
				panic(http.ErrAbortHandler)
			case p < 0.10:
				w.fault(faultUpstreamHang)
				select {
				case <-time.After(w.lease + time.Duration(w.rnd.intn(1500))*time.Millisecond):
				case <-r.Context().Done():
					return
				}
			}
		}
		next.ServeHTTP(rw, r)
	})
}

// injectInfraFaults restarts and pauses Redis (or fails it over) and kills
// sidecars until ctx ends.
func (w *world) injectInfraFaults(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(1000+w.rnd.intn(2000)) * time.Millisecond):
		}
		switch k := w.rnd.intn(4); {
		case w.failover != nil && k < 2:
			// A replicated store: failovers instead of restarts and
			// pauses, which the other sections inject.
			w.failover.failOver(w, k == 0)
		case w.pg != nil && k < 2:
			w.pg.failOver(w, k == 1)
		case w.clockFile != "" && k >= 2:
			// Instead of a sidecar killed: sidecar 0's clock steps.
			w.stepClock()
		case w.toxics != nil && k < 3:
			// The network to the store misbehaves instead, each kind in
			// turn.
			w.injectToxic(w.toxics.injected)
			w.toxics.injected++
		case k == 0:
			w.fault(faultRedisRestart)
			if !w.persistent {
				w.mu.Lock()
				w.restarts = append(w.restarts, time.Now())
				w.mu.Unlock()
			}
			start := time.Now()
			w.redis.Stop()
			time.Sleep(time.Duration(100+w.rnd.intn(400)) * time.Millisecond)
			w.redis.Start()
			// An owner last renewed up to lease/3 before the stop, and its
			// sidecar finds Redis back up to redialProbe after it is: a
			// restart of a quarter lease (with a lease of 1s, any) can let
			// its claim lapse (CI saw re-runs after restarts of 0.2-0.5
			// lease).
			w.mu.Lock()
			w.outages = append(w.outages, [2]time.Time{start, time.Now()})
			w.mu.Unlock()
			if w.mayLapse(time.Since(start)) {
				// As the sidecars see it, the outage lasts until their
				// redial probe finds Redis back: a claim reserved on a
				// fresh connection can still lapse while its renewals go
				// to pooled connections of the stopped Redis (seen: a
				// claim reserved just after a restart, its call answered,
				// lost 60ms later, "Lost the claim while the call runs").
				w.mu.Lock()
				w.pauses = append(w.pauses, [2]time.Time{start, time.Now().Add(redialProbe)})
				w.mu.Unlock()
			}
		case k == 1:
			w.fault(faultRedisPause)
			start := time.Now()
			w.redis.Pause()
			time.Sleep(2*w.lease + time.Duration(w.rnd.intn(500))*time.Millisecond)
			w.redis.Resume()
			w.mu.Lock()
			w.outages = append(w.outages, [2]time.Time{start, time.Now()})
			w.pauses = append(w.pauses, [2]time.Time{start, time.Now()})
			w.mu.Unlock()
		default:
			w.fault(faultSidecarKilled)
			i := w.rnd.intn(len(w.sidecars))
			w.mu.Lock()
			k := len(w.killed)
			w.killed = append(w.killed, [2]time.Time{time.Now()}) // open until it is back
			w.killedBy = append(w.killedBy, i)
			w.mu.Unlock()
			w.sidecars[i].Kill()
			time.Sleep(time.Duration(100+w.rnd.intn(400)) * time.Millisecond)
			w.sidecars[i].Start()
			w.mu.Lock()
			w.killed[k][1] = time.Now()
			w.mu.Unlock()
		}
	}
}

// maxClockStep bounds the stepped sidecar's clock offset: inside the
// seal's expiry grace (store.SealExpiryGrace, 2m), within which node clocks
// may differ and every guarantee holds.
const maxClockStep = 100 * time.Second

// stepClock sets sidecar 0's clock to a new offset, forward or back.
func (w *world) stepClock() {
	w.fault(faultClockStep)
	d := time.Duration(w.rnd.intn(2*int(maxClockStep/time.Second)+1))*time.Second - maxClockStep
	if err := os.WriteFile(w.clockFile, []byte(d.String()), 0o600); err != nil {
		w.t.Errorf("stepping the clock: %v", err)
	}
	// The sidecar (a faultclock build) writes back the offset it took.
	if err := poll.Until(context.Background(), 5*time.Second, func() error {
		b, _ := os.ReadFile(w.clockFile + ".applied")
		if string(b) != d.String() && d != 0 {
			return fmt.Errorf("its clock is %q off", b)
		}
		return nil
	}); err != nil {
		w.t.Errorf("sidecar 0 did not take the clock step to %v: %v", d, err)
	}
	w.t.Logf("%s sidecar 0's clock now %v off", ts(time.Now()), d)
}

// checkSealed: the results in Redis are sealed (no plain result text),
// and no sidecar took a stored result as expired or forged.
func (w *world) checkSealed(addr string) {
	keys, err := redistest.Do(addr, "KEYS", "idemcp:chaos/*")
	if err != nil || keys == "" {
		w.t.Errorf("listing the stored records: %q, %v", keys, err)
		return
	}
	records := 0
	for k := range strings.SplitSeq(keys, "\n") {
		typ, _ := redistest.Do(addr, "TYPE", k)
		var v string
		switch typ {
		case "hash":
			v, err = redistest.Do(addr, "HGETALL", k)
		case "string":
			v, err = redistest.Do(addr, "GET", k)
		default:
			continue
		}
		if err != nil {
			w.t.Errorf("reading %s: %v", k, err)
			continue
		}
		records++
		if strings.Contains(v, "charged") {
			w.t.Errorf("record %s holds a plain result (%.80q): results are not sealed", k, v)
			return
		}
	}
	if records == 0 {
		w.t.Errorf("no record among the %d keys", len(strings.Split(keys, "\n")))
	}
	for i, sc := range w.sidecars {
		for _, reason := range []string{"expired", "forged", "unknown_key", "malformed"} {
			if n, err := sc.Metric(`idemcp_sealed_open_failures_total{reason="` + reason + `"}`); err == nil && n != 0 {
				w.t.Errorf("sidecar %d: %v stored results failed to open as %s (idemcp_sealed_open_failures_total): a clock step inside the grace must not make a live result look %s", i, n, reason, reason)
			}
		}
	}
}

// storeSpecAddr is the address of the one Redis of a section without
// failovers.
func storeSpecAddr(w *world) string { return w.redis.Addr }

// redialProbe is how long after Redis is back a sidecar may still find it
// away: go-redis, once as many dials as its pool size have failed, fails
// every command at once and probes the server once a second.
const redialProbe = time.Second

// mayLapse reports whether a store outage of d, as the harness saw it, may
// let a claim lapse: its owner renewed up to lease/3 before it, and its
// sidecar may find the store back up to redialProbe after it.
func (w *world) mayLapse(d time.Duration) bool {
	return d+redialProbe >= w.lease*2/3
}

func cond[T any](c bool, a, b T) T {
	if c {
		return a
	}
	return b
}

// history is what the run recorded, with the faults it injected, for the
// classifier the soak shares.
func (w *world) history() *history.History {
	h := &history.History{
		Lease: w.lease, Retry: w.onAbandoned == "Retry",
		// After a failover the engine retries a result (50ms doubling to
		// 8s) while the new primary cannot yet acknowledge it: a sidecar
		// killed that long after answering may have lost it.
		StoreRetrySlack: cond(w.failover != nil || w.pg != nil, 16*time.Second, 0),
		Executions:      w.execs, Completions: w.completions, Losses: w.restarts,
		Logf: func(format string, args ...any) {
			line := fmt.Sprintf(format, args...)
			w.t.Log(line)
			for _, must0 := range []string{"duplicate:", "mismatch:", "lost claim:", "replayed, then lost"} {
				if strings.HasPrefix(line, must0) {
					w.violations = append(w.violations, line)
				}
			}
		},
	}
	for _, o := range w.outages {
		h.Outages = append(h.Outages, history.Window{From: o[0], To: o[1], Sidecar: history.All})
	}
	for _, p := range w.pauses {
		h.Lapses = append(h.Lapses, history.Window{From: p[0], To: p[1], Sidecar: history.All})
	}
	for k, win := range w.killed {
		h.Kills = append(h.Kills, history.Window{From: win[0], To: win[1], Sidecar: w.killedBy[k]})
	}
	for i, sc := range w.sidecars {
		for _, at := range takenOverReports(sc.Log()) {
			// The claim lapsed a lease or so before the failed store
			// said so.
			h.Reported = append(h.Reported, history.Window{From: at.Add(-2*w.lease - time.Second), To: at, Sidecar: i})
		}
	}
	return h
}

// takenOverReports are the times a sidecar's log says a claim it answered
// under was taken over before its result was stored.
func takenOverReports(log string) []time.Time {
	b, err := os.ReadFile(log)
	if err != nil {
		return nil
	}
	var out []time.Time
	for line := range strings.SplitSeq(string(b), "\n") {
		var rec struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal([]byte(line), &rec) == nil && strings.HasPrefix(rec.Msg, "Claim was taken over before the call finished") {
			out = append(out, rec.Time)
		}
	}
	return out
}

// verify retries every completed call once, with no faults, as the agent
// that made it.
func (w *world) verify() int {
	w.mu.Lock()
	calls := slices.Collect(maps.Keys(w.completions))
	w.mu.Unlock()
	sort.Strings(calls)
	byAgent := map[int][]string{}
	for _, call := range calls {
		var n, c int
		if _, err := fmt.Sscanf(call, "agent%d-call%d", &n, &c); err != nil {
			w.t.Fatalf("call id %q: %v", call, err)
		}
		byAgent[n] = append(byAgent[n], call)
	}
	var wg sync.WaitGroup
	for n, calls := range byAgent {
		wg.Go(func() {
			ag := newAgent(w, n)
			defer ag.close()
			for _, call := range calls {
				ag.attempt(call, false, false)
			}
		})
	}
	wg.Wait()
	return len(calls)
}

type agent struct {
	lastErr   string // of the last attempt, when idemcp answered an error
	w         *world
	n         int
	principal string
	sessions  []*mcp.ClientSession
}

func newAgent(w *world, n int) *agent {
	return &agent{w: w, n: n, principal: fmt.Sprintf("Bearer agent-%d", n), sessions: make([]*mcp.ClientSession, len(w.sidecars))}
}

func (a *agent) close() {
	for _, cs := range a.sessions {
		if cs != nil {
			_ = cs.Close()
		}
	}
}

type outcome struct {
	attempts int
	final    string
	// trace: when each attempt ended, and how, for a call left without an
	// answer.
	trace []string
}

// logicalCall retries one call until it gets its result or a final error.
func (a *agent) logicalCall(id string) outcome {
	var out outcome
	unavailable := 0 // answers "retry later" so far
	for first := time.Now(); time.Since(first) < patience; {
		out.attempts++
		drop := a.w.rnd.float() < 0.10
		stall := !drop && a.w.rnd.float() < 0.05
		out.final = a.attempt(id, drop, stall)
		out.trace = append(out.trace, time.Now().Format("15:04:05.000")+" "+out.final+a.lastErr)
		switch out.final {
		case "ok":
			// An agent that did not see its answer retries anyway.
			if a.w.rnd.float() < 0.2 {
				out.attempts++
				a.attempt(id, false, false)
			}
			return out
		case strconv.Itoa(mcpmsg.CodeOutcomeUnknown):
			return out
		}
		pause := time.Duration(50+a.w.rnd.intn(250)) * time.Millisecond
		if out.final == strconv.Itoa(mcpmsg.CodeStoreUnavailable) || out.final == strconv.Itoa(mcpmsg.CodeInFlight) {
			// "Retry later": the agent backs off, as from an HTTP 503, so
			// that a store failing over (or restarting), which answers
			// both at once, does not use up its attempts in a second.
			pause += min(100*time.Millisecond<<unavailable, 2*time.Second)
			unavailable++
		}
		time.Sleep(pause)
	}
	return out
}

type attemptKey struct{}

// attemptState is what the transport learns about one attempt.
type attemptState struct {
	stall  bool
	mu     sync.Mutex
	dialed time.Time // of the oldest connection the attempt used
	code   int64     // a JSON-RPC error code in a non-2xx response
	// firstByte: when the tools/call response's first byte came, the
	// earliest the sidecar may have written its answer.
	firstByte time.Time
}

// attempt makes one call; it returns "ok", the idemcp error code, or
// "fault" when an injected fault explains the failure.
func (a *agent) attempt(id string, drop, stall bool) string {
	w := a.w
	w.attempts.Add(1)
	i := w.rnd.intn(len(w.sidecars))
	start := time.Now()
	st := &attemptState{stall: stall}
	ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), attemptKey{}, st), 20*time.Second)
	defer cancel()
	if drop {
		w.fault(faultDrop)
		time.AfterFunc(time.Duration(w.rnd.intn(400))*time.Millisecond, cancel)
	}
	if stall {
		w.fault(faultStall)
	}
	a.lastErr = ""
	res, err := a.call(ctx, i, id)
	if err == nil && !res.IsError {
		b, _ := json.Marshal(res.StructuredContent)
		replayed, _ := res.Meta["idemcp.io/replayed"].(bool)
		w.mu.Lock()
		st.mu.Lock()
		answered := st.firstByte
		st.mu.Unlock()
		w.completions[id] = append(w.completions[id], history.Completion{From: cond(replayed, time.Now(), start), Answered: answered, At: time.Now(), Body: string(b), Replayed: replayed, Sidecar: i})
		w.mu.Unlock()
		w.code("ok")
		return "ok"
	}
	code := st.code
	var we *jsonrpc.Error
	if code == 0 && errors.As(err, &we) {
		code = we.Code
	}
	switch {
	case code <= -32010 && code >= -32019:
		w.code(strconv.FormatInt(code, 10))
		if err != nil {
			a.lastErr = ": " + err.Error()
		}
		if code == mcpmsg.CodeStoreUnavailable {
			w.mu.Lock()
			w.unavailable = append(w.unavailable, [2]time.Time{start, time.Now()})
			w.mu.Unlock()
		}
		return strconv.FormatInt(code, 10)
	case drop && ctx.Err() != nil:
		w.code("client gave up (injected)")
	case w.sidecarDown(i, st.since(start), time.Now()):
		w.code("sidecar killed (injected)")
	default:
		w.code("other")
		w.t.Logf("attempt of %s through sidecar %d: %v (result %v)", id, i, err, res)
	}
	// The session may be broken: open a fresh one next time.
	if a.sessions[i] != nil {
		_ = a.sessions[i].Close()
		a.sessions[i] = nil
	}
	return "fault"
}

// faultWindows lists the kills, outages and lapses the run recorded, for
// a failure's message.
func (w *world) faultWindows() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var b strings.Builder
	win := func(kind string, from, to time.Time) {
		fmt.Fprintf(&b, "%s %s-%s\n", kind, ts(from), ts(to))
	}
	for k, kw := range w.killed {
		win(fmt.Sprintf("sidecar %d killed", w.killedBy[k]), kw[0], kw[1])
	}
	for _, o := range w.outages {
		win("store away", o[0], o[1])
	}
	for _, p := range w.pauses {
		win("claims may lapse", p[0], p[1])
	}
	return b.String()
}

func ts(t time.Time) string { return t.Format("15:04:05.000") }

func (w *world) sidecarDown(i int, from, to time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for k, win := range w.killed {
		if w.killedBy[k] == i && !win[0].After(to) && (win[1].IsZero() || !win[1].Before(from)) {
			return true
		}
	}
	return false
}

func (a *agent) call(ctx context.Context, i int, id string) (*mcp.CallToolResult, error) {
	if a.sessions[i] == nil {
		client := mcp.NewClient(&mcp.Implementation{Name: "chaos-agent", Version: "1.0.0"}, nil)
		cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{
			Endpoint:   "http://" + a.w.sidecars[i].Addr,
			HTTPClient: &http.Client{Transport: &agentTransport{principal: a.principal, next: a.w.transport}},
			MaxRetries: -1,
		}, nil)
		if err != nil {
			return nil, err
		}
		a.sessions[i] = cs
	}
	// The same arguments on every attempt: the delay comes from the id.
	args := mcpserver.ChargeArgs{Card: id, Amount: 1, DelayMS: len(id) * 37 % 300}
	return a.sessions[i].CallTool(ctx, &mcp.CallToolParams{
		Name: "charge_card", Arguments: args, Meta: mcp.Meta{"idempotency-key": id},
	})
}

// agentTransport sets the agent's principal, stalls the reading of a
// response when asked, and reads the JSON-RPC error of a non-2xx answer.
type agentTransport struct {
	principal string
	next      http.RoundTripper
}

func (t *agentTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	ctx := r.Context()
	if st, _ := ctx.Value(attemptKey{}).(*attemptState); st != nil {
		call := r.Header.Get("Mcp-Method") == "tools/call"
		ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
			if tc, ok := info.Conn.(*timedConn); ok {
				st.mu.Lock()
				if st.dialed.IsZero() || tc.dialed.Before(st.dialed) {
					st.dialed = tc.dialed
				}
				st.mu.Unlock()
			}
		}, GotFirstResponseByte: func() {
			if call {
				st.mu.Lock()
				st.firstByte = time.Now()
				st.mu.Unlock()
			}
		}})
	}
	r = r.Clone(ctx)
	r.Header.Set("Authorization", t.principal)
	resp, err := t.next.RoundTrip(r)
	if err != nil {
		return resp, err
	}
	st, _ := r.Context().Value(attemptKey{}).(*attemptState)
	if st == nil {
		if resp.StatusCode >= 300 {
			b, _ := io.ReadAll(resp.Body)
			resp.Body = io.NopCloser(bytes.NewReader(b))
		}
		return resp, nil
	}
	if resp.StatusCode >= 300 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		_ = resp.Body.Close()
		var msg struct {
			Error struct {
				Code int64 `json:"code"`
			} `json:"error"`
		}
		if json.Unmarshal(b, &msg) == nil {
			st.code = msg.Error.Code
		}
		resp.Body = io.NopCloser(bytes.NewReader(b))
	}
	if st.stall {
		resp.Body = &stalled{ReadCloser: resp.Body, d: stallFor}
	}
	return resp, nil
}

// since is when the attempt's oldest connection was opened: a pooled
// connection to a sidecar killed since then fails with EOF.
func (st *attemptState) since(start time.Time) time.Time {
	st.mu.Lock()
	defer st.mu.Unlock()
	if !st.dialed.IsZero() && st.dialed.Before(start) {
		return st.dialed
	}
	return start
}

// timedConn remembers when it was dialed.
type timedConn struct {
	net.Conn
	dialed time.Time
}

func newClientTransport() *http.Transport {
	d := &net.Dialer{Timeout: 5 * time.Second}
	return &http.Transport{
		MaxIdleConnsPerHost: 16,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			dialed := time.Now()
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &timedConn{Conn: c, dialed: dialed}, nil
		},
	}
}

// stalled waits before the first read, as a client that stops reading.
type stalled struct {
	io.ReadCloser
	d    time.Duration
	once sync.Once
}

func (s *stalled) Read(p []byte) (int, error) {
	s.once.Do(func() { time.Sleep(s.d) })
	return s.ReadCloser.Read(p)
}

func (r *report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "| %s | seed %d, %v, %d agents, 3 sidecars, lease %v |\n| --- | --- |\n", r.title, r.seed, r.duration, agents, r.lease)
	row := func(k string, v any) { fmt.Fprintf(&b, "| %s | %v |\n", k, v) }
	row("logical calls", r.logical)
	row("attempts (calls)", r.attempts)
	row("retries", r.retries)
	row("executions", r.executions)
	row("duplicates (must be 0)", r.duplicates)
	row("replays that differed (must be 0)", r.mismatches)
	row("re-run after a claim lapsed in a Redis pause or a slow restart, or its owner reported it taken over before storing (Retry only)", r.superseded)
	row("re-run after its sidecar was killed between answering and storing (Retry only)", r.lostWithSide)
	row("replayed before a replica had it, then lost with its sidecar in a failover (must be 0)", r.replayedLost)
	row("ran again before any answer: a take-over of a claim whose owner was killed or cut off for a lease (Retry only)", r.raced)
	row("of which with no sidecar killed and the store in reach: a lost claim (must be 0)", r.lostClaims)
	row("calls left without an answer", r.unanswered)
	row("attempts answered -32013 with the store up", r.unavailableOutside)
	row("calls answered outcome unknown (-32012)", r.ambiguous)
	row("completed calls verified after the run", r.verification)
	if r.longestFailover > 0 {
		row("longest failover (from the fault until a write is acknowledged by a replica again)", r.longestFailover.Round(time.Millisecond))
	}
	for _, k := range slices.Sorted(maps.Keys(r.faults)) {
		row("fault: "+k, r.faults[k])
	}
	for _, k := range slices.Sorted(maps.Keys(r.codes)) {
		row("answer: "+k, r.codes[k])
	}
	row("test goroutines before/after", fmt.Sprintf("%d / %d", r.goroutines[0], r.goroutines[1]))
	row("sidecar goroutines start/end (max of 3)", fmt.Sprintf("%.0f / %.0f", r.sidecarGor[0], r.sidecarGor[1]))
	row("sidecar heap in use start/end (max of 3)", fmt.Sprintf("%.1f MiB / %.1f MiB", r.sidecarHeap[0]/(1<<20), r.sidecarHeap[1]/(1<<20)))
	return b.String()
}

// write records the run in results.md (section per onAbandoned value)
// when CHAOS_RECORD=1 (make chaos-record); other runs only print it, so a
// test run leaves the checkout clean.
func (r *report) write(t *testing.T) {
	if os.Getenv("CHAOS_RECORD") != "1" {
		return
	}
	sections := readResults()
	sections[r.title] = "\n" + r.String()
	writeResults(t, sections)
}

// writeSeed records the run as one row, by seed, of a section of
// results.md that holds a run of each seed, when CHAOS_RECORD_SEEDS=1
// (make chaos-sentinel-seeds).
func (r *report) writeSeed(t *testing.T) {
	if os.Getenv("CHAOS_RECORD_SEEDS") != "1" {
		return
	}
	const header = "| seed | logical calls | executions | failovers (forced / primary killed / unplanned) | longest failover | duplicates | replays that differed | replayed, then lost in a failover | lost claims | test |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
	title := r.title + ", by seed"
	sections := readResults()
	rows := map[int]string{}
	for _, line := range strings.Split(sections[title], "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 3 {
			continue
		}
		if seed, err := strconv.Atoi(strings.TrimSpace(cells[1])); err == nil {
			rows[seed] = line
		}
	}
	verdict := "pass"
	if t.Failed() {
		verdict = "FAIL"
	}
	rows[int(r.seed)] = fmt.Sprintf("| %d | %d | %d | %d / %d / %d | %v | %d | %d | %d | %d | %s |", r.seed, r.logical, r.executions,
		r.faults[faultFailoverForced], r.faults[faultFailoverKilled], r.faults[faultFailoverUnplanned], r.longestFailover.Round(time.Millisecond),
		r.duplicates, r.mismatches, r.replayedLost, r.lostClaims, verdict)
	var b strings.Builder
	fmt.Fprintf(&b, "\nWritten by `make chaos-sentinel-seeds`: one run of %v per seed, each row the last run of its seed.\n\n%s", r.duration, header)
	for _, seed := range slices.Sorted(maps.Keys(rows)) {
		b.WriteString(rows[seed] + "\n")
	}
	sections[title] = b.String()
	writeResults(t, sections)
}

const resultsPath = "results.md"

// readResults reads the sections of results.md by title.
func readResults() map[string]string {
	old, _ := os.ReadFile(resultsPath)
	sections := map[string]string{}
	for _, part := range strings.Split(string(old), "\n## ")[1:] {
		title, rest, _ := strings.Cut(part, "\n")
		sections[title] = rest
	}
	return sections
}

func writeResults(t *testing.T, sections map[string]string) {
	path := resultsPath
	var b strings.Builder
	b.WriteString("# Chaos run results\n\nWritten by `make chaos-record` (`CHAOS_RECORD=1 go test -race ./test/chaos`); `make test` runs the same tests and prints the same table. Each section is the last recorded run of its test; a section \"by seed\" holds the last run of each seed (`make chaos-sentinel-seeds`).\n")
	for _, k := range slices.Sorted(maps.Keys(sections)) {
		fmt.Fprintf(&b, "\n## %s\n%s", k, strings.TrimLeft(sections[k], "\n"))
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Errorf("writing %s: %v", path, err)
	}
}
