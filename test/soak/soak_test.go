//go:build soak

// Package soak_test runs mixed traffic at a bounded rate through two idemcp
// sidecar processes sharing a real Redis, for an hour by default, and
// checks the guarantees and the sidecars' resources at the end. It is not
// part of make test: `make soak` runs it (SOAK_DURATION, SOAK_RATE) and
// records the result in results.md.
package soak_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/sidecar/store/redis/redistest"
	"github.com/idemcp/idemcp/test/history"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/test/procs"
)

const (
	agents   = 16
	sidecars = 2
	lease    = 5 * time.Second
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
		t.Fatalf("%s=%q: want a positive Go duration such as 1h or 90s", name, v)
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

// sample is one reading of a sidecar's resources.
type sample struct {
	at         time.Duration
	rss, heap  float64
	goroutines float64
}

type soak struct {
	t     *testing.T
	sc    []*procs.Sidecar
	mu    sync.Mutex
	execs map[string][]time.Time // card -> when each execution was dispatched
	// completions: the answers each deduplicated call got.
	completions map[string][]history.Completion
	passthrough map[string]int // passthrough call -> successful attempts
	codes       map[string]int
	kinds       map[string]int
	drops       atomic.Int64
}

func (s *soak) code(c string) {
	s.mu.Lock()
	s.codes[c]++
	s.mu.Unlock()
}

func TestSoak(t *testing.T) {
	duration := envDuration(t, "SOAK_DURATION", time.Hour)
	rate := envInt(t, "SOAK_RATE", 20)
	every := envDuration(t, "SOAK_SAMPLE", max(duration/60, 5*time.Second))
	warmup := max(duration/10, every)
	t.Logf("soak: %v at %d logical calls/s, %d agents, %d sidecars, resources sampled every %v after a %v warm-up", duration, rate, agents, sidecars, every, warmup)

	s := &soak{t: t, execs: map[string][]time.Time{}, completions: map[string][]history.Completion{}, passthrough: map[string]int{}, codes: map[string]int{}, kinds: map[string]int{}}
	redis := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction")
	srv := mcpserver.New()
	srv.MCP.AddReceivingMiddleware(s.countExecutions)
	upstream := httptest.NewServer(srv.Handler(false))
	defer upstream.Close()
	policy := filepath.Join(t.TempDir(), "policy.yaml")
	body := fmt.Sprintf("spec: {keyScope: Principal, ttl: 1h, leaseDuration: %v, store: {type: Redis, redis: {external: {addresses: [%q]}}}, tools: [{name: refund, mode: Passthrough}]}\n", lease, redis.Addr)
	if err := os.WriteFile(policy, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	bin := procs.Binary(t)
	for range sidecars {
		s.sc = append(s.sc, procs.StartSidecar(t, bin, nil, "--upstream", upstream.URL, "--policy-file", policy, "--redis-key-prefix", "idemcp:soak:", "--log-level", "warn"))
	}

	start := time.Now()
	ctx, stop := context.WithTimeout(context.Background(), duration)
	defer stop()
	samples := make([][]sample, sidecars)
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			for i, sc := range s.sc {
				var r sample
				r.at = time.Since(start)
				r.rss, _ = sc.RSS()
				r.heap, _ = sc.Metric("go_memstats_heap_inuse_bytes")
				r.goroutines, _ = sc.Metric("go_goroutines")
				samples[i] = append(samples[i], r)
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	})
	// One token per logical call, at a fixed rate: the traffic stays
	// bounded however fast the sidecars answer.
	tokens := make(chan struct{})
	wg.Go(func() {
		tick := time.NewTicker(time.Second / time.Duration(rate))
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				close(tokens)
				return
			case <-tick.C:
				select {
				case tokens <- struct{}{}:
				case <-ctx.Done():
				}
			}
		}
	})
	var logical atomic.Int64
	for a := range agents {
		wg.Go(func() {
			ag := &agent{s: s, n: a, rnd: rand.New(rand.NewPCG(uint64(a), 17)), sessions: make([]*mcp.ClientSession, sidecars)}
			defer ag.close()
			for range tokens {
				ag.logicalCall(int(logical.Add(1)))
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)

	s.mu.Lock()
	defer s.mu.Unlock()
	h := &history.History{Lease: lease, Retry: true, Executions: map[string][]time.Time{}, Completions: s.completions, Logf: t.Logf}
	passthroughMissing, executions := 0, 0
	for call, ex := range s.execs {
		executions += len(ex)
		if kind, _, _ := strings.Cut(call, "/"); kind == "passthrough" {
			if len(ex) != s.passthrough[call] {
				passthroughMissing++
			}
			continue
		}
		h.Executions[call] = ex
	}
	for call, n := range s.passthrough {
		if _, ran := s.execs[call]; !ran && n > 0 {
			passthroughMissing++
		}
	}
	// The faults here are not injected: a starved machine makes Redis
	// answer late, or a sidecar miss its renewals. A sidecar that could
	// not reach the store logs it; each such line marks a lease before it
	// in which that sidecar's claims may have lapsed.
	takeOvers := 0
	for i, sc := range s.sc {
		trouble, took := storeTrouble(t, sc.Log())
		takeOvers += took
		for _, at := range trouble {
			w := history.Window{From: at.Add(-lease), To: at, Sidecar: i}
			h.Lapses = append(h.Lapses, w)
			h.Outages = append(h.Outages, w)
		}
	}
	v := h.Classify()
	other := 0
	for k, n := range s.codes {
		if code, err := strconv.Atoi(k); k != "ok" && !strings.HasPrefix(k, "client gave up") && (err != nil || code > -32010 || code < -32019) {
			other += n
		}
	}
	res := &result{
		duration: elapsed, rate: rate, logical: int(logical.Load()), kinds: maps.Clone(s.kinds), codes: maps.Clone(s.codes),
		executions: executions, duplicates: v.Duplicates, mismatches: v.Mismatches, takenOver: v.TakenOver, takeOversLogged: takeOvers,
		passthroughMissing: passthroughMissing, drops: int(s.drops.Load()),
		samples: samples, warmup: warmup,
	}
	res.check(t, other)
	if len(res.failures) != 0 {
		keepLogs(t, s.sc)
	}
	t.Log("\n" + res.String())
	res.write(t)
}

type result struct {
	duration                                   time.Duration
	rate, logical, executions                  int
	duplicates, mismatches, passthroughMissing int
	takenOver, takeOversLogged                 int
	drops                                      int
	kinds, codes                               map[string]int
	samples                                    [][]sample
	warmup                                     time.Duration
	growth                                     []string
	failures                                   []string
}

// check compares each sidecar's resources late in the run with the first
// quarter after warm-up: memory and goroutines must stay flat (a generous
// margin: this is a leak check, not a measurement).
func (r *result) check(t *testing.T, otherErrors int) {
	fail := func(format string, args ...any) {
		msg := fmt.Sprintf(format, args...)
		r.failures = append(r.failures, msg)
		t.Error(msg)
	}
	if r.duplicates != 0 {
		fail("%d executions of deduplicated calls ran while their result was stored", r.duplicates)
	}
	if r.mismatches != 0 {
		fail("%d deduplicated calls were answered differently on retry", r.mismatches)
	}
	if r.passthroughMissing != 0 {
		fail("%d passthrough calls did not run once per attempt", r.passthroughMissing)
	}
	if otherErrors != 0 {
		fail("%d attempts got neither a result, a clear idemcp error nor an injected drop", otherErrors)
	}
	for i, ss := range r.samples {
		var early, late sample
		var nEarly, nLate int
		span := r.duration - r.warmup
		for _, s := range ss {
			switch {
			case s.at < r.warmup:
			case s.at < r.warmup+span/4:
				early = maxSample(early, s)
				nEarly++
			case s.at >= r.warmup+3*span/4:
				late = maxSample(late, s)
				nLate++
			}
		}
		if nEarly == 0 || nLate == 0 {
			fail("sidecar %d: too few resource samples (%d early, %d late)", i, nEarly, nLate)
			continue
		}
		r.growth = append(r.growth, fmt.Sprintf("sidecar %d: RSS %.1f -> %.1f MiB, heap in use %.1f -> %.1f MiB, goroutines %.0f -> %.0f",
			i, early.rss/(1<<20), late.rss/(1<<20), early.heap/(1<<20), late.heap/(1<<20), early.goroutines, late.goroutines))
		if late.rss > 1.5*early.rss+32<<20 {
			fail("sidecar %d: RSS grew from %.1f MiB after warm-up to %.1f MiB at the end", i, early.rss/(1<<20), late.rss/(1<<20))
		}
		if late.heap > 1.5*early.heap+16<<20 {
			fail("sidecar %d: heap in use grew from %.1f MiB after warm-up to %.1f MiB at the end", i, early.heap/(1<<20), late.heap/(1<<20))
		}
		// Goroutines follow the calls in flight; a leak grows with the
		// calls made, far past twice the early count.
		if late.goroutines > 2*early.goroutines+50 {
			fail("sidecar %d: goroutines grew from %.0f after warm-up to %.0f at the end", i, early.goroutines, late.goroutines)
		}
	}
}

func maxSample(a, b sample) sample {
	return sample{rss: max(a.rss, b.rss), heap: max(a.heap, b.heap), goroutines: max(a.goroutines, b.goroutines)}
}

func (r *result) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "| soak | %v at %d logical calls/s, %d agents, %d sidecars, one Redis |\n| --- | --- |\n", r.duration.Round(time.Second), r.rate, agents, sidecars)
	row := func(k string, v any) { fmt.Fprintf(&b, "| %s | %v |\n", k, v) }
	row("logical calls", r.logical)
	for _, k := range slices.Sorted(maps.Keys(r.kinds)) {
		row("logical calls: "+k, r.kinds[k])
	}
	row("executions", r.executions)
	row("duplicates (must be 0)", r.duplicates)
	row("retries answered differently (must be 0)", r.mismatches)
	row("re-run after the owner's claim lapsed while it could not reach Redis (onAbandoned: Retry)", r.takenOver)
	row("take-overs the sidecars logged", r.takeOversLogged)
	row("passthrough calls not run once per attempt (must be 0)", r.passthroughMissing)
	row("client drops mid-call (injected)", r.drops)
	for _, k := range slices.Sorted(maps.Keys(r.codes)) {
		row("answer: "+k, r.codes[k])
	}
	for _, g := range r.growth {
		row("resources after warm-up -> end (max of samples)", g)
	}
	if len(r.failures) == 0 {
		row("result", "passed")
	} else {
		row("result", "FAILED: "+strings.Join(r.failures, "; "))
	}
	return b.String()
}

// write records the run in results.md when SOAK_RECORD=1 (make soak).
func (r *result) write(t *testing.T) {
	if os.Getenv("SOAK_RECORD") != "1" {
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Soak run results\n\nWritten by `make soak` (SOAK_DURATION, default 1h; SOAK_RATE logical calls/s, default 20): mixed traffic (explicit-key calls retried, some concurrently and some after a dropped connection; derived-key calls retried; passthrough calls) through %d sidecar processes sharing a real Redis. The last run, finished %s:\n\n", sidecars, time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	b.WriteString(r.String())
	if err := os.WriteFile("results.md", []byte(b.String()), 0o644); err != nil {
		t.Errorf("writing results.md: %v", err)
	}
}

// countExecutions counts the calls that took effect, by tool and card.
func (s *soak) countExecutions(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		dispatched := time.Now()
		res, err := next(ctx, method, req)
		ctr, ok := req.(*mcp.CallToolRequest)
		if method != "tools/call" || !ok || err != nil || ctx.Err() != nil {
			return res, err
		}
		var args mcpserver.ChargeArgs
		if json.Unmarshal(ctr.Params.Arguments, &args) == nil {
			s.mu.Lock()
			s.execs[args.Card] = append(s.execs[args.Card], dispatched)
			s.mu.Unlock()
		}
		return res, err
	}
}

type agent struct {
	s        *soak
	n        int
	rnd      *rand.Rand
	sessions []*mcp.ClientSession
	calls    int
}

func (a *agent) close() {
	for i, cs := range a.sessions {
		if cs != nil {
			_ = cs.Close()
			a.sessions[i] = nil
		}
	}
}

// logicalCall makes one call of a random kind and its retries.
func (a *agent) logicalCall(n int) {
	// Sessions come and go as agents restart.
	if a.calls++; a.calls%200 == 0 {
		a.close()
	}
	p := a.rnd.Float64()
	switch {
	case p < 0.6:
		a.keyed(n)
	case p < 0.8:
		a.derived(n)
	default:
		a.passthrough(n)
	}
}

// keyed: an explicit-key charge, retried once to three times through
// either sidecar; sometimes two attempts run at once, sometimes the first
// one's client gives up mid-call.
func (a *agent) keyed(n int) {
	call := fmt.Sprintf("keyed/%d", n)
	args := mcpserver.ChargeArgs{Card: call, Amount: 1, DelayMS: a.rnd.IntN(100)}
	meta := mcp.Meta{"idempotency-key": fmt.Sprintf("soak-%d", n)}
	a.kind("explicit key, retried")
	if a.rnd.Float64() < 0.03 {
		a.s.drops.Add(1)
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(a.rnd.IntN(80))*time.Millisecond)
		a.attempt(ctx, call, "charge_card", args, meta, true)
		cancel()
	}
	if a.rnd.Float64() < 0.2 {
		var wg sync.WaitGroup
		for i := range sidecars {
			wg.Go(func() { a.attemptOn(i, call, "charge_card", args, meta) })
		}
		wg.Wait()
	}
	for range 1 + a.rnd.IntN(3) {
		a.attemptOn(a.rnd.IntN(sidecars), call, "charge_card", args, meta)
	}
}

// derived: a charge keyed by its arguments (Principal scope), retried once.
func (a *agent) derived(n int) {
	call := fmt.Sprintf("derived/%d", n)
	args := mcpserver.ChargeArgs{Card: call, Amount: 2}
	a.kind("derived key, retried")
	for range 2 {
		a.attemptOn(a.rnd.IntN(sidecars), call, "charge_card", args, nil)
	}
}

// passthrough: a read-only tool (Auto) or one a rule names Passthrough;
// each attempt runs.
func (a *agent) passthrough(n int) {
	call := fmt.Sprintf("passthrough/%d", n)
	tool := "get_balance"
	if n%2 == 0 {
		tool = "refund"
	}
	a.kind("passthrough (" + tool + ")")
	a.attemptOn(a.rnd.IntN(sidecars), call, tool, mcpserver.ChargeArgs{Card: call, Amount: 3}, nil)
}

func (a *agent) kind(k string) {
	a.s.mu.Lock()
	a.s.kinds[k]++
	a.s.mu.Unlock()
}

func (a *agent) attemptOn(i int, call, tool string, args mcpserver.ChargeArgs, meta mcp.Meta) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	a.attemptAt(ctx, i, call, tool, args, meta, false)
}

func (a *agent) attempt(ctx context.Context, call, tool string, args mcpserver.ChargeArgs, meta mcp.Meta, dropped bool) {
	a.attemptAt(ctx, a.rnd.IntN(sidecars), call, tool, args, meta, dropped)
}

func (a *agent) attemptAt(ctx context.Context, i int, call, tool string, args mcpserver.ChargeArgs, meta mcp.Meta, dropped bool) {
	start := time.Now()
	cs, err := a.session(ctx, i)
	if err == nil {
		var res *mcp.CallToolResult
		res, err = cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args, Meta: meta})
		if err == nil && !res.IsError {
			b, _ := json.Marshal(res.StructuredContent)
			replayed, _ := res.Meta["idemcp.io/replayed"].(bool)
			now := time.Now()
			a.s.mu.Lock()
			if strings.HasPrefix(call, "passthrough/") {
				a.s.passthrough[call]++
			} else {
				from := start
				if replayed {
					from = now
				}
				a.s.completions[call] = append(a.s.completions[call], history.Completion{From: from, At: now, Body: string(b), Replayed: replayed, Sidecar: i})
			}
			a.s.codes["ok"]++
			a.s.mu.Unlock()
			return
		}
		if err == nil {
			err = fmt.Errorf("tool error: %v", res.Content)
		}
	}
	var we *jsonrpc.Error
	switch {
	case dropped && ctx.Err() != nil:
		a.s.code("client gave up (injected)")
	case errors.As(err, &we):
		a.s.code(strconv.FormatInt(we.Code, 10))
		a.s.t.Logf("%s through sidecar %d: %v", call, i, err)
	default:
		a.s.code("other")
		a.s.t.Logf("%s through sidecar %d: %v", call, i, err)
	}
	// The session may be broken: open a fresh one next time.
	if a.sessions[i] != nil {
		_ = a.sessions[i].Close()
		a.sessions[i] = nil
	}
}

func (a *agent) session(ctx context.Context, i int) (*mcp.ClientSession, error) {
	if a.sessions[i] != nil {
		return a.sessions[i], nil
	}
	client := mcp.NewClient(&mcp.Implementation{Name: "soak-agent", Version: "1.0.0"}, nil)
	cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{
		Endpoint:   "http://" + a.s.sc[i].Addr,
		HTTPClient: &http.Client{Transport: &principal{name: fmt.Sprintf("Bearer soak-%d", a.n)}},
		MaxRetries: -1,
	}, nil)
	if err != nil {
		return nil, err
	}
	a.sessions[i] = cs
	return cs, nil
}

var sharedTransport = &http.Transport{MaxIdleConnsPerHost: 64}

type principal struct{ name string }

func (p *principal) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", p.name)
	return sharedTransport.RoundTrip(r)
}

// troubleMessages start the log lines of a sidecar that could not reach
// the store while it owned a claim, or found its claim taken over.
var troubleMessages = []string{
	"Renewing the claim failed",
	"Lost the claim",
	"Claim was taken over",
	"Store write",
	"Store unavailable",
}

// storeTrouble reads a sidecar's JSON log: when it could not reach the
// store, and how many claims it took over.
func storeTrouble(t *testing.T, path string) (trouble []time.Time, tookOver int) {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Errorf("reading a sidecar's log: %v", err)
		return nil, 0
	}
	for line := range strings.Lines(string(b)) {
		var rec struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal([]byte(line), &rec) != nil {
			continue
		}
		if strings.HasPrefix(rec.Msg, "Took over an abandoned claim") {
			tookOver++
		}
		for _, m := range troubleMessages {
			if strings.HasPrefix(rec.Msg, m) {
				trouble = append(trouble, rec.Time)
				break
			}
		}
	}
	return trouble, tookOver
}

// keepLogs copies the sidecars' logs out of the test's temporary directory,
// which is removed at its end, so that a failed hour can be read.
func keepLogs(t *testing.T, sc []*procs.Sidecar) {
	for i, p := range sc {
		b, err := os.ReadFile(p.Log())
		if err != nil {
			continue
		}
		path := filepath.Join(os.TempDir(), fmt.Sprintf("idemcp-soak-sidecar-%d.log", i))
		if err := os.WriteFile(path, b, 0o644); err == nil {
			t.Logf("sidecar %d's log is kept in %s", i, path)
		}
	}
}
