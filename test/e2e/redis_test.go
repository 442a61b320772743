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

	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/sidecar/mcpmsg"
	"github.com/idemcp/idemcp/sidecar/store/redis/redistest"
	"github.com/idemcp/idemcp/test/mcpserver"
)

// fleet is several sidecars sharing one store, in front of one server, as
// the replicas of a Deployment are.
type fleet struct {
	*harness
	proxies  []*httptest.Server
	sidecars []*sidecar.Sidecar
}

func writePolicy(t *testing.T, yaml string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func newFleet(t *testing.T, rev revision, policyYAML string, redisAddrs []string, n int) *fleet {
	t.Helper()
	f := &fleet{harness: newHarness(t, rev, policyYAML, nil)}
	prefix := fmt.Sprintf("idemcp:test/%s-%d:", strings.ReplaceAll(t.Name(), "/", "-"), time.Now().UnixNano())
	for range n {
		sc, err := sidecar.New(sidecar.Options{
			Upstream:   f.upstream.URL,
			PolicyFile: writePolicy(t, policyYAML),
			Store:      sidecar.StoreOptions{Kind: "redis", RedisAddrs: strings.Join(redisAddrs, ","), RedisKeyPrefix: prefix},
			LogLevel:   "error",
		})
		if err != nil {
			t.Fatalf("sidecar.New: %v", err)
		}
		p := httptest.NewServer(sc.Handler())
		t.Cleanup(p.Close)
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

const principalRedisPolicy = `apiVersion: idemcp.io/v1alpha1
kind: IdempotencyPolicy
metadata: {name: payments, namespace: shop}
spec:
  keyScope: Principal
  store: {type: Redis, redis: {external: {addresses: ["127.0.0.1:1"]}}}
`

func TestThreeSidecarsShareOneRedis(t *testing.T) {
	srv := redistest.Start(t)
	forEachRevision(t, func(t *testing.T, rev revision) {
		testThreeSidecars(t, rev, []string{srv.Addr})
	})
}

func TestThreeSidecarsShareARedisCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	forEachRevision(t, func(t *testing.T, rev revision) {
		testThreeSidecars(t, rev, cluster.Addrs)
	})
}

func testThreeSidecars(t *testing.T, rev revision, addrs []string) {
	f := newFleet(t, rev, principalRedisPolicy, addrs, 3)
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
}

func TestRedisOutage(t *testing.T) {
	for _, mode := range []string{"FailClosed", "FailOpen"} {
		t.Run(mode, func(t *testing.T) {
			srv := redistest.Start(t)
			policy := fmt.Sprintf("spec: {onStoreUnavailable: %s, store: {type: Redis, redis: {external: {addresses: [%q]}}}}", mode, srv.Addr)
			f := newFleet(t, revisions[0], policy, []string{srv.Addr}, 1)
			cs := f.connect(t, f.proxies[0].URL, clientOpts{})

			// A call in flight when Redis goes away still answers its client.
			inflight := make(chan *mcp.CallToolResult, 1)
			go func() {
				inflight <- mustCall(t, cs, "charge_card", map[string]any{"card": "1", "amount": 1, "delayMs": 600}, nil)
			}()
			time.Sleep(200 * time.Millisecond)
			srv.Stop()
			if res := <-inflight; res.IsError {
				t.Fatalf("the call in flight during the outage failed: %s", body(t, res))
			}
			before := f.srv.Counts.Get("charge_card")

			// New calls while Redis is down.
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

			// Redis comes back (empty): dedup resumes without a restart.
			srv.Start()
			args := map[string]any{"card": "3", "amount": 3}
			waitFor(t, func() bool {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				_, err := call(ctx, cs, "charge_card", args, nil)
				return err == nil
			}, "calls to succeed after Redis is back")
			n := f.srv.Counts.Get("charge_card")
			if res := mustCall(t, cs, "charge_card", args, nil); !replayed(res) {
				t.Error("after Redis came back the retry was not replayed")
			}
			if f.srv.Counts.Get("charge_card") != n {
				t.Error("after Redis came back the retry ran again")
			}
		})
	}
}

// TestRedisRoundTrips counts the commands Redis serves for a call that
// runs (at most 2) and for a replay (1).
func TestRedisRoundTrips(t *testing.T) {
	srv := redistest.Start(t)
	f := newFleet(t, revisions[0], "spec: {store: {type: Redis, redis: {external: {addresses: [\"x:1\"]}}}}", []string{srv.Addr}, 1)
	cs := f.connect(t, f.proxies[0].URL, clientOpts{})
	mustCall(t, cs, "charge_card", map[string]any{"card": "warm", "amount": 1}, nil) // connections up, scripts loaded
	// A result is stored just after its client is answered: wait for that
	// before and after each measurement.
	idle := func() {
		if err := f.sidecars[0].Engine().Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	measure := func(what string, fn func()) int {
		idle()
		if _, err := redistest.Do(srv.Addr, "CONFIG", "RESETSTAT"); err != nil {
			t.Fatal(err)
		}
		fn()
		idle()
		stats, err := redistest.Do(srv.Addr, "INFO", "commandstats")
		if err != nil {
			t.Fatal(err)
		}
		// Every store operation is one script: a round trip is an EVAL or
		// EVALSHA (the commands a script runs inside Redis are counted
		// too, under their own names, and are not round trips).
		total := 0
		for _, line := range strings.Split(stats, "\n") {
			name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
			if !ok || !strings.HasPrefix(name, "cmdstat_") || name == "cmdstat_info" || name == "cmdstat_config|resetstat" {
				continue
			}
			calls, _, _ := strings.Cut(strings.TrimPrefix(rest, "calls="), ",")
			n, _ := strconv.Atoi(calls)
			if strings.HasPrefix(name, "cmdstat_eval") {
				total += n
			} else if !scriptCommands[strings.TrimPrefix(name, "cmdstat_")] && !connectionSetup[strings.TrimPrefix(name, "cmdstat_")] {
				t.Errorf("%s: a command outside the scripts reached Redis: %s", what, line)
			}
		}
		t.Logf("%s: %d Redis round trips", what, total)
		return total
	}
	executed := measure("executed call", func() { mustCall(t, cs, "charge_card", card, nil) })
	replay := measure("replay", func() { mustCall(t, cs, "charge_card", card, nil) })
	if executed > 2 || replay != 1 {
		t.Fatalf("an executed call cost %d Redis round trips (want at most 2) and a replay %d (want 1)", executed, replay)
	}
}

// TestSidecarKilledMidCall kills a sidecar process with SIGKILL while its
// call runs, then retries through another sidecar sharing the Redis.
func TestSidecarKilledMidCall(t *testing.T) {
	bin := buildWrapBins(t).idemcp // built once for the package
	srv := redistest.Start(t)
	for _, onAbandoned := range []string{"Retry", "Error"} {
		t.Run(onAbandoned, func(t *testing.T) {
			policy := fmt.Sprintf("spec: {leaseDuration: 1s, onAbandoned: %s, keyScope: Principal, store: {type: Redis, redis: {external: {addresses: [%q]}}}}", onAbandoned, srv.Addr)
			f := newFleet(t, revisions[0], policy, []string{srv.Addr}, 1)
			prefix := "idemcp:killed/" + onAbandoned + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
			// The survivor shares the dead sidecar's keys.
			sc, err := sidecar.New(sidecar.Options{Upstream: f.upstream.URL, PolicyFile: writePolicy(t, policy), Store: sidecar.StoreOptions{Kind: "redis", RedisAddrs: srv.Addr, RedisKeyPrefix: prefix}, LogLevel: "error"})
			if err != nil {
				t.Fatal(err)
			}
			survivor := httptest.NewServer(sc.Handler())
			defer survivor.Close()

			addr := freeAddr(t)
			cmd := exec.Command(bin, "sidecar", "--listen", addr, "--admin-listen", "", "--upstream", f.upstream.URL,
				"--policy-file", writePolicy(t, policy), "--redis-key-prefix", prefix, "--log-level", "error")
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
			waitFor(t, func() bool {
				c, err := net.Dial("tcp", addr)
				if err == nil {
					_ = c.Close()
				}
				return err == nil
			}, "the sidecar process to listen")

			alice := http.Header{"Authorization": {"Bearer alice"}}
			doomed := f.connect(t, "http://"+addr, clientOpts{headers: alice})
			args := map[string]any{"card": "4242", "amount": 9, "delayMs": 1500}
			go func() { _, _ = call(context.Background(), doomed, "charge_card", args, nil) }()
			time.Sleep(300 * time.Millisecond)
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
		})
	}
}

// scriptCommands are the commands the store's Lua scripts run.
var scriptCommands = map[string]bool{
	"time": true, "hmget": true, "hset": true, "hexists": true, "hdel": true,
	"pexpire": true, "del": true, "publish": true, "hget": true, "exists": true,
}

// connectionSetup is what go-redis sends when it opens a pooled connection.
var connectionSetup = map[string]bool{"hello": true, "client|setname": true, "client|setinfo": true, "auth": true, "select": true}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	return l.Addr().String()
}
