package e2e_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/internal/storeopen"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/test/poll"
)

// sharedStore is a store that several sidecars share; the tests that are
// the same for every shared store run once per store (forEachStore).
type sharedStore struct {
	// options reach the store, with this key prefix.
	options func(prefix string) storeopen.Options
	// process is how an `idemcp sidecar` process is told the same: flags
	// and environment (a pod's secretKeyRef variables).
	process func(prefix string) (flags, env []string)
	// Stop and Start take the store down and up again.
	Stop, Start func()
	// keepsData: what was stored before a Stop is there after the Start.
	keepsData bool
}

func redisStore(srv *redistest.Server) *sharedStore {
	return redisAt([]string{srv.Addr}, srv.Stop, srv.Start)
}

func redisAt(addrs []string, stop, start func()) *sharedStore {
	joined := strings.Join(addrs, ",")
	return &sharedStore{
		options: func(prefix string) storeopen.Options {
			return storeopen.Options{Kind: "redis", RedisAddrs: joined, RedisKeyPrefix: prefix}
		},
		process: func(prefix string) ([]string, []string) {
			return []string{"--store", "redis", "--redis-addr", joined, "--redis-key-prefix", prefix}, nil
		},
		Stop: stop, Start: start,
	}
}

func postgresStore(pg *pgtest.Server) *sharedStore {
	return &sharedStore{
		options: func(prefix string) storeopen.Options {
			return storeopen.Options{Kind: "postgres", PostgresURL: pg.URL, PostgresKeyPrefix: prefix}
		},
		process: func(prefix string) ([]string, []string) {
			// The URL arrives as it does in a pod: in the environment.
			return []string{"--store", "postgres", "--postgres-key-prefix", prefix}, []string{"IDEMCP_POSTGRES_URL=" + pg.URL}
		},
		Stop: pg.Stop, Start: pg.Start, keepsData: true,
	}
}

// forEachStore runs fn once against a fresh Redis (without persistence)
// and once against a fresh PostgreSQL.
func forEachStore(t *testing.T, fn func(t *testing.T, st *sharedStore)) {
	t.Run("Redis", func(t *testing.T) { fn(t, redisStore(redistest.Start(t))) })
	t.Run("Postgres", func(t *testing.T) { fn(t, postgresStore(pgtest.Start(t))) })
}

// testPrefix gives each test its own keys in a shared store.
func testPrefix(t *testing.T) string {
	return fmt.Sprintf("idemcp:test/%s-%d:", strings.ReplaceAll(t.Name(), "/", "-"), time.Now().UnixNano())
}

// fleet is several sidecars sharing one store, in front of one server, as
// the replicas of a Deployment are.
type fleet struct {
	*harness
	proxies  []*httptest.Server
	sidecars []*sidecar.Sidecar
}

func writePolicy(t *testing.T, yaml string) string {
	t.Helper()
	if yaml == "" {
		yaml = "spec: {}" // the defaults; an empty file is refused
	}
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// newFleet starts n sidecars with policyYAML on the store st, sharing one
// key prefix. The harness's own sidecar (unused) keeps the memory store.
func newFleet(t *testing.T, rev revision, policyYAML string, st *sharedStore, n int) *fleet {
	t.Helper()
	return newFleetWith(t, rev, policyYAML, st.options(testPrefix(t)), n)
}

func newFleetWith(t *testing.T, rev revision, policyYAML string, opts storeopen.Options, n int) *fleet {
	t.Helper()
	f := &fleet{harness: newHarness(t, rev, "", nil)}
	for range n {
		sc, err := sidecar.New(sidecar.Options{
			Upstream:   f.upstream.URL,
			PolicyFile: writePolicy(t, policyYAML),
			Store:      opts,
			LogLevel:   "error",
		})
		if err != nil {
			t.Fatalf("sidecar.New: %v", err)
		}
		p := httptest.NewServer(sc.Handler())
		t.Cleanup(p.Close)
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = sc.Engine().Drain(ctx)
		})
		f.proxies = append(f.proxies, p)
		f.sidecars = append(f.sidecars, sc)
	}
	return f
}

// spread makes `calls` concurrent identical calls, round-robin over the
// sidecars, and returns the result bodies.
func (f *fleet) spread(t *testing.T, calls int, hdr http.Header, tool string, args any, meta mcp.Meta) []string {
	t.Helper()
	sessions := make([]*mcp.ClientSession, len(f.proxies))
	for i, p := range f.proxies {
		sessions[i] = f.connect(t, p.URL, clientOpts{headers: hdr})
	}
	out := make([]string, calls)
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() { out[i] = body(t, mustCall(t, sessions[i%len(sessions)], tool, args, meta)) })
	}
	wg.Wait()
	return out
}

func allSame(t *testing.T, results []string) {
	t.Helper()
	for i, r := range results {
		if r != results[0] {
			t.Fatalf("result %d = %s, want %s like the first", i, r, results[0])
		}
	}
}

func TestThreeSidecarsShareOneStore(t *testing.T) {
	forEachStore(t, func(t *testing.T, st *sharedStore) {
		forEachRevision(t, func(t *testing.T, rev revision) { testThreeSidecars(t, rev, st) })
	})
}

func TestThreeSidecarsShareARedisCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	st := redisAt(cluster.Addrs, nil, nil)
	forEachRevision(t, func(t *testing.T, rev revision) { testThreeSidecars(t, rev, st) })
}

func testThreeSidecars(t *testing.T, rev revision, st *sharedStore) {
	f := newFleet(t, rev, principalPolicy, st, 3)
	alice := http.Header{"Authorization": {"Bearer alice"}}
	args := map[string]any{"card": "4242", "amount": 60, "delayMs": 400}
	allSame(t, f.spread(t, 60, alice, "charge_card", args, nil))
	if n := f.srv.Counts.Get("charge_card"); n != 1 {
		t.Fatalf("60 calls over 3 sidecars (Principal scope) ran charge_card %d times, want 1", n)
	}

	key := mcp.Meta{"idempotency-key": "order-77"}
	other := map[string]any{"card": "4242", "amount": 77, "delayMs": 400}
	aliceResults := f.spread(t, 60, alice, "charge_card", other, key)
	allSame(t, aliceResults)
	if n := f.srv.Counts.Get("charge_card"); n != 2 {
		t.Fatalf("60 calls with one explicit key ran charge_card %d times in all, want 2", n)
	}

	bob := http.Header{"Authorization": {"Bearer bob"}}
	bobResults := f.spread(t, 3, bob, "charge_card", other, key)
	allSame(t, bobResults)
	if n := f.srv.Counts.Get("charge_card"); n != 3 {
		t.Fatalf("another principal's use of the same key ran charge_card %d times in all, want 3", n)
	}
	if bobResults[0] == aliceResults[0] {
		t.Fatalf("bob got alice's result %s", bobResults[0])
	}

	// The same key with other arguments is a conflict, whichever sidecar.
	cs := f.connect(t, f.proxies[2].URL, clientOpts{headers: alice})
	_, err := call(context.Background(), cs, "charge_card", map[string]any{"card": "4242", "amount": 78}, key)
	if rpcCode(err) != mcpmsg.CodeKeyConflict {
		t.Fatalf("reusing the key for other arguments: %v, want code %d", err, mcpmsg.CodeKeyConflict)
	}
	if n := f.srv.Counts.Get("charge_card"); n != 3 {
		t.Fatalf("the conflicting call ran: %d executions", n)
	}
}

func TestStoreOutage(t *testing.T) {
	forEachStore(t, func(t *testing.T, st *sharedStore) {
		for _, mode := range []string{"FailClosed", "FailOpen"} {
			t.Run(mode, func(t *testing.T) { testStoreOutage(t, st, mode) })
		}
	})
}

func testStoreOutage(t *testing.T, st *sharedStore, mode string) {
	f := newFleet(t, revisions[0], "spec: {onStoreUnavailable: "+mode+"}", st, 1)
	cs := f.connect(t, f.proxies[0].URL, clientOpts{})
	st.Start()                                                                    // after an earlier subtest's outage
	mustCall(t, cs, "charge_card", map[string]any{"card": "0", "amount": 0}, nil) // stored before the outage

	// A call in flight when the store goes away still answers its client.
	inflight := make(chan *mcp.CallToolResult, 1)
	go func() {
		inflight <- mustCall(t, cs, "charge_card", map[string]any{"card": "1", "amount": 1, "delayMs": 600}, nil)
	}()
	time.Sleep(200 * time.Millisecond)
	st.Stop()
	if res := <-inflight; res.IsError {
		t.Fatalf("the call in flight during the outage failed: %s", body(t, res))
	}
	before := f.srv.Counts.Get("charge_card")

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := call(ctx, cs, "charge_card", map[string]any{"card": "2", "amount": 2}, nil)
	ran := f.srv.Counts.Get("charge_card") - before
	switch mode {
	case "FailClosed":
		if rpcCode(err) != mcpmsg.CodeStoreUnavailable || ran != 0 {
			t.Fatalf("FailClosed during the outage: err %v, ran %d; want code %d and nothing run", err, ran, mcpmsg.CodeStoreUnavailable)
		}
		if !strings.Contains(err.Error(), "store is unreachable") {
			t.Errorf("the error does not say why: %v", err)
		}
	case "FailOpen":
		if err != nil || res.IsError || ran != 1 {
			t.Fatalf("FailOpen during the outage: err %v, ran %d; want it forwarded", err, ran)
		}
	}

	// The store comes back: dedup resumes without a restart.
	st.Start()
	args := map[string]any{"card": "3", "amount": 3}
	poll.Within(t, 5*time.Second, "calls to succeed after the store is back", poll.True(func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := call(ctx, cs, "charge_card", args, nil)
		return err == nil
	}))
	n := f.srv.Counts.Get("charge_card")
	if res := mustCall(t, cs, "charge_card", args, nil); !replayed(res) {
		t.Error("after the store came back the retry was not replayed")
	}
	if st.keepsData {
		if res := mustCall(t, cs, "charge_card", map[string]any{"card": "0", "amount": 0}, nil); !replayed(res) {
			t.Error("the result stored before the outage was not replayed after it")
		}
	}
	if f.srv.Counts.Get("charge_card") != n {
		t.Error("after the store came back a retry ran again")
	}
}

// TestSidecarKilledMidCall kills a sidecar process with SIGKILL while its
// call runs, then retries through another sidecar sharing the store.
func TestSidecarKilledMidCall(t *testing.T) {
	bin := buildWrapBins(t).idemcp // built once for the package
	forEachStore(t, func(t *testing.T, st *sharedStore) {
		for _, onAbandoned := range []string{"Retry", "Error"} {
			t.Run(onAbandoned, func(t *testing.T) { testSidecarKilledMidCall(t, bin, st, onAbandoned) })
		}
	})
}

func testSidecarKilledMidCall(t *testing.T, bin string, st *sharedStore, onAbandoned string) {
	policy := fmt.Sprintf("spec: {leaseDuration: 1s, onAbandoned: %s, keyScope: Principal}", onAbandoned)
	prefix := "idemcp:killed/" + onAbandoned + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
	// The survivor shares the dead sidecar's keys.
	f := newFleetWith(t, revisions[0], policy, st.options(prefix), 1)
	survivor := f.proxies[0]

	addr := freeAddr(t)
	flags, env := st.process(prefix)
	cmd := exec.Command(bin, append([]string{"sidecar", "--listen", addr, "--admin-listen", "", "--upstream", f.upstream.URL,
		"--policy-file", writePolicy(t, policy), "--log-level", "error"}, flags...)...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	poll.Within(t, 5*time.Second, "the sidecar process to listen", poll.True(func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	}))

	alice := http.Header{"Authorization": {"Bearer alice"}}
	doomed := f.connect(t, "http://"+addr, clientOpts{headers: alice})
	args := map[string]any{"card": "4242", "amount": 9, "delayMs": 1500}
	posts := f.posts.Load()
	go func() { _, _ = call(context.Background(), doomed, "charge_card", args, nil) }()
	// Kill it once the call runs upstream (claimed, then forwarded).
	poll.Within(t, 5*time.Second, "the call to reach the server", poll.True(func() bool { return f.posts.Load() > posts }))
	time.Sleep(100 * time.Millisecond)
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()

	retry := f.connect(t, survivor.URL, clientOpts{headers: alice})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := call(ctx, retry, "charge_card", args, nil)
	switch onAbandoned {
	case "Retry":
		if err != nil || res.IsError {
			t.Fatalf("retry after the owner died: %v", err)
		}
		if n := f.srv.Counts.Get("charge_card"); n != 1 {
			t.Fatalf("charge_card ran %d times, want 1 (the retry, once the lease ran out)", n)
		}
	case "Error":
		if rpcCode(err) != mcpmsg.CodeOutcomeUnknown || !strings.Contains(err.Error(), "outcome unknown") {
			t.Fatalf("retry after the owner died: err %v, want code %d (outcome unknown)", err, mcpmsg.CodeOutcomeUnknown)
		}
		if n := f.srv.Counts.Get("charge_card"); n != 0 {
			t.Fatalf("charge_card ran %d times, want 0", n)
		}
	}
	if n := f.srv.Counts.Get(mcpserver.Cancelled); n != 1 {
		t.Errorf("the dead sidecar's call was cancelled upstream %d times, want 1", n)
	}
}

// TestRedisMinReplicas: with --redis-min-replicas a call runs once its
// claim is on the replica; while the replica is stopped the claim fails
// as a store failure (FailClosed: a clear error, nothing runs), and it is
// released, not left to lapse: once the replica is back the retry runs,
// even with onAbandoned: Error.
func TestRedisMinReplicas(t *testing.T) {
	primary := redistest.Start(t)
	replica := redistest.StartReplica(t, primary)
	prefix := testPrefix(t)
	opts := redisStore(primary).options(prefix)
	opts.RedisMinReplicas, opts.RedisReplicaTimeout = 1, 2*time.Second
	f := newFleetWith(t, revisions[0], "spec: {onAbandoned: Error, onStoreUnavailable: FailClosed}", opts, 1)
	cs := f.connect(t, f.proxies[0].URL, clientOpts{})

	mustCall(t, cs, "charge_card", map[string]any{"card": "1", "amount": 1}, nil)
	if n := f.srv.Counts.Get("charge_card"); n != 1 {
		t.Fatalf("with the replica up charge_card ran %d times, want 1", n)
	}
	// The sidecar stores the result just after answering: the replay below
	// is of a result the replica acknowledged (a result only the primary
	// has is not replayed; TestReplayOnlyWhatReplicasHave in the store).
	acknowledged := `local n = 0
for _, k in ipairs(redis.call('KEYS', ARGV[1])) do
  if redis.call('TYPE', k).ok == 'hash' and redis.call('HGET', k, 'a') == '1' then n = n + 1 end
end
return n`
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, err := redistest.Do(primary.Addr, "EVAL", acknowledged, "0", prefix+"*")
		if err == nil && n == "1" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the first result was not acknowledged by the replica within 10s: %q, %v", n, err)
		}
		time.Sleep(20 * time.Millisecond)
	}

	replica.Pause()
	defer replica.Resume()
	args := map[string]any{"card": "2", "amount": 2}
	_, err := call(context.Background(), cs, "charge_card", args, nil)
	if rpcCode(err) != mcpmsg.CodeStoreUnavailable || !strings.Contains(err.Error(), "0 of the 1 replicas") {
		t.Fatalf("with the replica stopped: %v, want code %d saying 0 of the 1 replicas acknowledged", err, mcpmsg.CodeStoreUnavailable)
	}
	if n := f.srv.Counts.Get("charge_card"); n != 1 {
		t.Fatalf("the call whose claim no replica acknowledged ran: charge_card ran %d times, want 1", n)
	}
	// A result the replica acknowledged is still replayed: that replay
	// writes nothing and waits for nobody.
	if res := mustCall(t, cs, "charge_card", map[string]any{"card": "1", "amount": 1}, nil); !replayed(res) {
		t.Error("with the replica stopped a stored result was not replayed")
	}

	replica.Resume()
	res := mustCall(t, cs, "charge_card", args, nil)
	if replayed(res) || f.srv.Counts.Get("charge_card") != 2 {
		t.Fatalf("once the replica is back the retry: replayed %v, charge_card ran %d times; want it run (2)", replayed(res), f.srv.Counts.Get("charge_card"))
	}
}
