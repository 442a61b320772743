// Package load_test holds 1,000 MCP sessions open through one idemcp
// sidecar process on a real Redis for a minute, each making deduplicated
// calls and retries, and checks that nothing fails, nothing runs twice,
// and the sidecar's memory stays flat once warmed up. It is a functional
// check, not a measurement: `make load` runs it (LOAD_DURATION,
// LOAD_SESSIONS, LOAD_INTERVAL override the defaults).
package load_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/test/procs"
)

func TestMain(m *testing.M) {
	code := m.Run()
	procs.Cleanup()
	os.Exit(code)
}

func envDuration(t *testing.T, name string, def time.Duration) time.Duration {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("%s=%q: want a positive Go duration such as 60s", name, v)
	}
	return d
}

func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

type sample struct {
	at                    time.Duration
	rss, heap, goroutines float64
}

func TestLoad(t *testing.T) {
	duration := envDuration(t, "LOAD_DURATION", 60*time.Second)
	sessions := envInt(t, "LOAD_SESSIONS", 1000)
	interval := envDuration(t, "LOAD_INTERVAL", 2*time.Second)
	warmup := duration / 3
	t.Logf("load: %d concurrent sessions for %v through one sidecar, a call every %v per session; memory compared after a %v warm-up", sessions, duration, interval, warmup)

	redis := redistest.Start(t, "--maxmemory-policy", "noeviction")
	srv := mcpserver.New()
	var mu sync.Mutex
	execs := map[string]int{}
	srv.MCP.AddReceivingMiddleware(func(next mcp.MethodHandler) mcp.MethodHandler {
		return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
			res, err := next(ctx, method, req)
			if ctr, ok := req.(*mcp.CallToolRequest); ok && method == "tools/call" && err == nil {
				var args mcpserver.ChargeArgs
				if json.Unmarshal(ctr.Params.Arguments, &args) == nil {
					mu.Lock()
					execs[args.Card]++
					mu.Unlock()
				}
			}
			return res, err
		}
	})
	upstream := httptest.NewServer(srv.Handler(false))
	defer upstream.Close()
	policy := filepath.Join(t.TempDir(), "policy.yaml")
	body := fmt.Sprintf("spec: {keyScope: Principal, store: {type: Redis, redis: {external: {addresses: [%q]}}}}\n", redis.Addr)
	if err := os.WriteFile(policy, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	sc := procs.StartSidecar(t, procs.Binary(t), nil, "--upstream", upstream.URL, "--policy-file", policy, "--redis-key-prefix", "idemcp:load:")

	// Idle connections are dropped before the sidecar's idle timeout would
	// close them under a request (a POST is not retried on EOF).
	transport := &http.Transport{MaxIdleConnsPerHost: sessions, IdleConnTimeout: 30 * time.Second}
	defer transport.CloseIdleConnections()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()

	// Open every session first, a few at a time, then run them all.
	open := make([]*mcp.ClientSession, sessions)
	var wg sync.WaitGroup
	gate := make(chan struct{}, 32)
	var openErrs atomic.Int64
	for i := range sessions {
		wg.Go(func() {
			gate <- struct{}{}
			defer func() { <-gate }()
			client := mcp.NewClient(&mcp.Implementation{Name: "load", Version: "1.0.0"}, nil)
			cctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			cs, err := client.Connect(cctx, &mcp.StreamableClientTransport{
				Endpoint:   "http://" + sc.Addr,
				HTTPClient: &http.Client{Transport: &principal{name: fmt.Sprintf("Bearer load-%d", i%50), next: transport}},
				MaxRetries: -1,
			}, nil)
			if err != nil {
				openErrs.Add(1)
				t.Errorf("opening session %d: %v", i, err)
				return
			}
			open[i] = cs
		})
	}
	wg.Wait()
	if openErrs.Load() > 0 {
		t.FailNow()
	}
	defer func() {
		for _, cs := range open {
			_ = cs.Close()
		}
	}()

	start := time.Now()
	var samples []sample
	var sampling sync.WaitGroup
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampling.Go(func() {
		tick := time.NewTicker(2 * time.Second)
		defer tick.Stop()
		for {
			s := sample{at: time.Since(start)}
			var errs [3]error
			s.rss, errs[0] = sc.RSS()
			s.heap, errs[1] = sc.Metric("go_memstats_heap_inuse_bytes")
			s.goroutines, errs[2] = sc.Metric("go_goroutines")
			// A reading that timed out is left out, not taken as zero.
			if errs[0] == nil && errs[1] == nil && errs[2] == nil {
				samples = append(samples, s)
			}
			select {
			case <-sampleCtx.Done():
				return
			case <-tick.C:
			}
		}
	})

	var calls, replays, failures atomic.Int64
	answers := make([]map[string]string, sessions)
	end := start.Add(duration)
	for i, cs := range open {
		answers[i] = map[string]string{}
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(uint64(i), 1))
			// Spread the sessions' calls over the interval.
			time.Sleep(time.Duration(rnd.Int64N(int64(interval))))
			for n := 0; time.Now().Before(end); n++ {
				// Every other call retries the one before.
				id := fmt.Sprintf("s%d-c%d", i, n/2*2)
				args := mcpserver.ChargeArgs{Card: id, Amount: 1}
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				res, err := cs.CallTool(cctx, &mcp.CallToolParams{Name: "charge_card", Arguments: args, Meta: mcp.Meta{"idempotency-key": id}})
				cancel()
				calls.Add(1)
				if err != nil || res.IsError {
					if failures.Add(1) <= 10 {
						t.Errorf("session %d, call %s: %v %v", i, id, err, res)
					}
				} else {
					b, _ := json.Marshal(res.StructuredContent)
					if prev, ok := answers[i][id]; ok {
						replays.Add(1)
						if prev != string(b) {
							t.Errorf("session %d: the retry of %s got %s, the first call %s", i, id, b, prev)
						}
					}
					answers[i][id] = string(b)
				}
				time.Sleep(interval/2 + time.Duration(rnd.Int64N(int64(interval))))
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	stopSampling()
	sampling.Wait()

	mu.Lock()
	dups, keys := 0, 0
	for _, n := range execs {
		keys++
		dups += n - 1
	}
	mu.Unlock()
	var early, late sample
	for _, s := range samples {
		switch {
		case s.at >= warmup && s.at < warmup+duration/6:
			early = maxSample(early, s)
		case s.at >= duration-duration/6:
			late = maxSample(late, s)
		}
	}
	t.Logf("load: %d sessions, %v: %d calls (%d/s), %d replays, %d failed, %d executions for %d keys (%d duplicates); sidecar after warm-up -> end: RSS %.1f -> %.1f MiB, heap %.1f -> %.1f MiB, goroutines %.0f -> %.0f",
		sessions, elapsed.Round(time.Second), calls.Load(), calls.Load()*int64(time.Second)/int64(elapsed), replays.Load(), failures.Load(),
		keys, keys, dups, early.rss/(1<<20), late.rss/(1<<20), early.heap/(1<<20), late.heap/(1<<20), early.goroutines, late.goroutines)
	if failures.Load() != 0 {
		t.Errorf("%d of %d calls failed", failures.Load(), calls.Load())
	}
	if dups != 0 {
		t.Errorf("%d executions ran for a key whose result was stored", dups)
	}
	if replays.Load() == 0 {
		t.Error("no retry was replayed")
	}
	if early.rss == 0 || late.rss == 0 || early.heap == 0 || late.heap == 0 {
		t.Fatalf("too few memory samples: %d", len(samples))
	}
	// Generous margins: a leak check, not a measurement.
	if late.rss > 1.5*early.rss+32<<20 {
		t.Errorf("sidecar RSS grew after warm-up: %.1f MiB -> %.1f MiB", early.rss/(1<<20), late.rss/(1<<20))
	}
	if late.heap > 1.5*early.heap+16<<20 {
		t.Errorf("sidecar heap in use grew after warm-up: %.1f MiB -> %.1f MiB", early.heap/(1<<20), late.heap/(1<<20))
	}
	if late.goroutines > 1.5*early.goroutines+100 {
		t.Errorf("sidecar goroutines grew after warm-up: %.0f -> %.0f", early.goroutines, late.goroutines)
	}
}

func maxSample(a, b sample) sample {
	return sample{rss: max(a.rss, b.rss), heap: max(a.heap, b.heap), goroutines: max(a.goroutines, b.goroutines)}
}

type principal struct {
	name string
	next http.RoundTripper
}

func (p *principal) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", p.name)
	return p.next.RoundTrip(r)
}
