//go:build soak

// Package soak_test runs mixed traffic at a bounded rate through two idemcp
// sidecar processes sharing a real Redis, for an hour by default, and
// checks the guarantees and the sidecars' resources at the end. It is not
// part of make test: `make soak` runs it (SOAK_DURATION, SOAK_RATE,
// SOAK_DROPS) and
// records the result in results.md.
package soak_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
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

// envFraction reads a probability.
func envFraction(t *testing.T, name string, def float64) float64 {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f < 0 || f > 1 {
		t.Fatalf("%s=%q: want a probability between 0 and 1", name, v)
	}
	return f
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
	t  *testing.T
	sc []*procs.Sidecar
	// keys derives each deduplicated call's store key as the sidecars do,
	// to tie the take-overs they log to logical calls.
	keys *engine.Engine
	mu   sync.Mutex
	runs map[string][]*run // card -> the executions that took effect
	// exchanges: every tools/call request the server got, by the number
	// the upstream recorder gave it.
	exchanges map[int]*exchange
	deleted   map[string]time.Time // session -> when its DELETE reached the server
	keyCall   map[string]string    // store key -> card
	// completions: the answers each deduplicated call got.
	completions map[string][]history.Completion
	passthrough map[string]int // passthrough call -> successful attempts
	codes       map[string]int
	kinds       map[string]int
	drops       atomic.Int64
}

// run is one execution of a tool that took effect, as the server saw it.
type run struct {
	exchange int // the request that carried it (headerExchange)
	at, done time.Time
	// cancelled: the call's context was done when the tool returned (a
	// forwarded cancel, or its session closing).
	cancelled bool
}

// exchange is one tools/call request the server got from a sidecar, and
// what became of its response.
type exchange struct {
	sidecar    int
	session    string
	id         json.RawMessage
	start, end time.Time
	// responded: the server wrote a JSON-RPC response to the call.
	responded bool
	writeErr  error
	// hungUp: the sidecar's request was gone when the server returned.
	hungUp bool
}

// headerExchange tags a request with its exchange number on its way into
// the MCP server, so the tool's run can be tied to its HTTP exchange.
const headerExchange = "X-Soak-Exchange"

func (s *soak) code(c string) {
	s.mu.Lock()
	s.codes[c]++
	s.mu.Unlock()
}

func TestSoak(t *testing.T) {
	duration := envDuration(t, "SOAK_DURATION", time.Hour)
	rate := envInt(t, "SOAK_RATE", 20)
	drops := envFraction(t, "SOAK_DROPS", 0.03)
	every := envDuration(t, "SOAK_SAMPLE", max(duration/60, 5*time.Second))
	warmup := max(duration/10, every)
	t.Logf("soak: %v at %d logical calls/s, %d agents, %d sidecars, %.0f%% of explicit-key calls dropped once, resources sampled every %v after a %v warm-up", duration, rate, agents, sidecars, 100*drops, every, warmup)

	s := &soak{t: t, runs: map[string][]*run{}, exchanges: map[int]*exchange{}, deleted: map[string]time.Time{}, keyCall: map[string]string{},
		completions: map[string][]history.Completion{}, passthrough: map[string]int{}, codes: map[string]int{}, kinds: map[string]int{}}
	redis := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction")
	srv := mcpserver.New()
	srv.MCP.AddReceivingMiddleware(s.countExecutions)
	handler := srv.Handler(false)
	policyFile := filepath.Join(t.TempDir(), "policy.yaml")
	body := fmt.Sprintf("spec: {keyScope: Principal, ttl: 1h, leaseDuration: %v, store: {type: Redis, redis: {external: {addresses: [%q]}}}, tools: [{name: refund, mode: Passthrough}]}\n", lease, redis.Addr)
	if err := os.WriteFile(policyFile, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	pol, err := policy.LoadFile(policyFile)
	if err != nil {
		t.Fatal(err)
	}
	s.keys = engine.New(engine.Options{Policy: pol})
	bin := procs.Binary(t)
	// One listener per sidecar in front of the one MCP server, so that
	// each request's sidecar is known.
	for i := range sidecars {
		upstream := httptest.NewServer(s.recordExchanges(i, handler))
		defer upstream.Close()
		s.sc = append(s.sc, procs.StartSidecar(t, bin, nil, "--upstream", upstream.URL, "--policy-file", policyFile, "--redis-key-prefix", "idemcp:soak:", "--log-level", "warn"))
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
			ag := &agent{s: s, n: a, drops: drops, rnd: rand.New(rand.NewPCG(uint64(a), 17)), sessions: make([]*mcp.ClientSession, sidecars)}
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
	passthroughMissing, executions, neverRan := 0, 0, 0
	runs := map[string][]history.Run{}
	for call, rs := range s.runs {
		executions += len(rs)
		if kind, _, _ := strings.Cut(call, "/"); kind == "passthrough" {
			if len(rs) != s.passthrough[call] {
				passthroughMissing++
			}
			continue
		}
		for _, r := range rs {
			h.Executions[call] = append(h.Executions[call], r.at)
			runs[call] = append(runs[call], s.historyRun(r))
		}
	}
	for call, n := range s.passthrough {
		if _, ran := s.runs[call]; !ran && n > 0 {
			passthroughMissing++
		}
	}
	for _, call := range s.keyCall {
		if _, ran := s.runs[call]; !ran {
			neverRan++
		}
	}
	// The faults here are not injected: a starved machine makes Redis
	// answer late, or a sidecar miss its renewals. A sidecar that could
	// not reach the store logs it; each such line marks a lease before it
	// in which that sidecar's claims may have lapsed.
	takeOvers, takeOversByCall, unmatched := 0, map[string][]time.Time{}, 0
	for i, sc := range s.sc {
		trouble, took := storeTrouble(t, sc.Log())
		takeOvers += len(took)
		for _, to := range took {
			if call, ok := s.keyCall[to.key]; ok {
				takeOversByCall[call] = append(takeOversByCall[call], to.at)
			} else {
				unmatched++
			}
		}
		for _, at := range trouble {
			w := history.Window{From: at.Add(-lease), To: at, Sidecar: i}
			h.Lapses = append(h.Lapses, w)
			h.Outages = append(h.Outages, w)
		}
	}
	if unmatched != 0 {
		t.Errorf("%d take-overs the sidecars logged match no logical call's key", unmatched)
	}
	for call, rs := range s.runs {
		for _, r := range rs {
			if _, ok := s.exchanges[r.exchange]; !ok {
				t.Errorf("%s ran at %s, but no request to the server was recorded for it", call, r.at.Format("15:04:05.000"))
			}
		}
	}
	extras := h.Extras(runs, takeOversByCall)
	for _, x := range extras {
		t.Logf("extra execution of %s at %s through sidecar %d: %s; %s", x.Call, x.Run.At.Format("15:04:05.000"), x.Run.Sidecar, x.Kind, x.Why)
	}
	notStored := map[string]float64{}
	takenOverMetric := 0.0
	for _, sc := range s.sc {
		for _, reason := range []string{engine.ReasonTransport, engine.ReasonHTTPStatus, engine.ReasonRPCError, engine.ReasonToolError, engine.ReasonOutcomeUnknown, engine.ReasonTooLarge} {
			n, _ := sc.Metric(`idemcp_results_not_stored_total{reason="` + reason + `"}`)
			notStored[reason] += n
		}
		n, _ := sc.Metric("idemcp_claims_taken_over_total")
		takenOverMetric += n
	}
	serverCount := srv.Counts.Get("charge_card") + srv.Counts.Get("refund") + srv.Counts.Get("get_balance")
	v := h.Classify()
	other := 0
	for k, n := range s.codes {
		if code, err := strconv.Atoi(k); k != "ok" && !strings.HasPrefix(k, "client gave up") && (err != nil || code > -32010 || code < -32019) {
			other += n
		}
	}
	res := &result{
		duration: elapsed, rate: rate, dropRate: drops, logical: int(logical.Load()), kinds: maps.Clone(s.kinds), codes: maps.Clone(s.codes),
		executions: executions, serverCount: serverCount, neverRan: neverRan, extras: extras,
		cancelledUpstream: srv.Counts.Get(mcpserver.Cancelled), notStored: notStored, takenOverMetric: takenOverMetric,
		duplicates: v.Duplicates, mismatches: v.Mismatches, takenOver: v.TakenOver, takeOversLogged: takeOvers,
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
	dropRate                                   float64
	serverCount, neverRan, cancelledUpstream   int
	extras                                     []history.Extra
	notStored                                  map[string]float64
	takenOverMetric                            float64
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
	if r.serverCount != r.executions {
		fail("the server counted %d executions, the harness %d", r.serverCount, r.executions)
	}
	for _, x := range r.extras {
		if x.Kind.Defect() {
			fail("%s at %s through sidecar %d %s: %s", x.Call, x.Run.At.Format("15:04:05.000"), x.Run.Sidecar, x.Kind, x.Why)
		}
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
	fmt.Fprintf(&b, "| soak | %v at %d logical calls/s, %d agents, %d sidecars, one Redis, %.0f%% of explicit-key calls dropped once |\n| --- | --- |\n", r.duration.Round(time.Second), r.rate, agents, sidecars, 100*r.dropRate)
	row := func(k string, v any) { fmt.Fprintf(&b, "| %s | %v |\n", k, v) }
	row("logical calls", r.logical)
	for _, k := range slices.Sorted(maps.Keys(r.kinds)) {
		row("logical calls: "+k, r.kinds[k])
	}
	row("executions", r.executions)
	row("executions the server counted (must equal executions)", r.serverCount)
	byKind := map[history.ExtraKind]int{}
	for _, x := range r.extras {
		byKind[x.Kind]++
	}
	row("executions beyond one per deduplicated call", len(r.extras))
	for _, k := range slices.Sorted(maps.Keys(byKind)) {
		row("beyond one: "+string(k), byKind[k])
	}
	row("deduplicated calls that never ran", r.neverRan)
	row("calls cancelled upstream before they took effect", r.cancelledUpstream)
	for _, k := range slices.Sorted(maps.Keys(r.notStored)) {
		if r.notStored[k] != 0 {
			row("sidecars: results not stored, "+k, r.notStored[k])
		}
	}
	row("sidecars: claims taken over (idemcp_claims_taken_over_total)", r.takenOverMetric)
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
	for i, x := range r.extras {
		if i == 20 {
			row("extra executions not listed", len(r.extras)-i)
			break
		}
		row(fmt.Sprintf("extra: %s at %s via sidecar %d", x.Call, x.Run.At.UTC().Format("15:04:05.000"), x.Run.Sidecar), string(x.Kind)+": "+x.Why)
	}
	if len(r.failures) == 0 {
		row("result", "passed")
	} else {
		row("result", "FAILED: "+strings.Join(r.failures, "; "))
	}
	return b.String()
}

// notesHeading starts the part of results.md that a run keeps.
const notesHeading = "## Notes"

// write records the run in results.md when SOAK_RECORD=1 (make soak).
func (r *result) write(t *testing.T) {
	if os.Getenv("SOAK_RECORD") != "1" {
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Soak run results\n\nWritten by `make soak` (SOAK_DURATION, default 1h; SOAK_RATE logical calls/s, default 20; SOAK_DROPS, the share of explicit-key calls whose first attempt gives up mid-call, default 0.03): mixed traffic (explicit-key calls retried, some concurrently and some after a dropped connection; derived-key calls retried; passthrough calls) through %d sidecar processes sharing a real Redis. The last run, finished %s:\n\n", sidecars, time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	b.WriteString(r.String())
	// Notes written by hand (diagnoses of earlier runs) are kept.
	if old, err := os.ReadFile("results.md"); err == nil {
		if i := strings.Index(string(old), "\n"+notesHeading); i >= 0 {
			b.WriteString(string(old[i:]))
		}
	}
	if err := os.WriteFile("results.md", []byte(b.String()), 0o644); err != nil {
		t.Errorf("writing results.md: %v", err)
	}
}

// countExecutions records every tool call that took effect: the tool
// answered a result, not an error (charge_card's only error is a cancel
// before it charges). A call cancelled just after it took effect counts.
func (s *soak) countExecutions(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		dispatched := time.Now()
		res, err := next(ctx, method, req)
		ctr, ok := req.(*mcp.CallToolRequest)
		if method != "tools/call" || !ok || !mcpserver.Charged(res, err) {
			return res, err
		}
		var args mcpserver.ChargeArgs
		if json.Unmarshal(ctr.Params.Arguments, &args) == nil {
			r := &run{at: dispatched, done: time.Now(), cancelled: ctx.Err() != nil, exchange: -1}
			if ctr.Extra != nil {
				if n, err := strconv.Atoi(ctr.Extra.Header.Get(headerExchange)); err == nil {
					r.exchange = n
				}
			}
			s.mu.Lock()
			s.runs[args.Card] = append(s.runs[args.Card], r)
			s.mu.Unlock()
		}
		return res, err
	}
}

// recordExchanges sits between sidecar i and the MCP server: it numbers
// each tools/call request, notes each session's DELETE, and records
// whether the server's response to the call was written back.
func (s *soak) recordExchanges(i int, next http.Handler) http.Handler {
	var seq atomic.Int64
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		session := r.Header.Get("Mcp-Session-Id")
		if r.Method == http.MethodDelete {
			s.mu.Lock()
			if _, ok := s.deleted[session]; !ok {
				s.deleted[session] = time.Now()
			}
			s.mu.Unlock()
		}
		if r.Method != http.MethodPost {
			next.ServeHTTP(w, r)
			return
		}
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		var msg struct {
			ID     json.RawMessage `json:"id"`
			Method string          `json:"method"`
		}
		if json.Unmarshal(body, &msg) != nil || msg.Method != "tools/call" || len(msg.ID) == 0 {
			next.ServeHTTP(w, r)
			return
		}
		n := int(seq.Add(1))*sidecars + i
		x := &exchange{sidecar: i, session: session, id: msg.ID, start: time.Now()}
		r.Header.Set(headerExchange, strconv.Itoa(n))
		tw := &teeWriter{ResponseWriter: w}
		next.ServeHTTP(tw, r)
		x.end, x.hungUp, x.writeErr = time.Now(), r.Context().Err() != nil, tw.err
		x.responded = respondsTo(tw.buf.Bytes(), msg.ID)
		s.mu.Lock()
		s.exchanges[n] = x
		s.mu.Unlock()
	})
}

// teeWriter keeps a copy of a response and its first write error.
type teeWriter struct {
	http.ResponseWriter
	buf bytes.Buffer
	err error
}

func (w *teeWriter) Write(b []byte) (int, error) {
	w.buf.Write(b)
	n, err := w.ResponseWriter.Write(b)
	if err != nil && w.err == nil {
		w.err = err
	}
	return n, err
}

func (w *teeWriter) Flush() {
	if err := http.NewResponseController(w.ResponseWriter).Flush(); err != nil && w.err == nil {
		w.err = err
	}
}

func (w *teeWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// respondsTo reports whether a response body (JSON or an event stream)
// holds a JSON-RPC response to id.
func respondsTo(body []byte, id json.RawMessage) bool {
	is := func(b []byte) bool {
		var m struct {
			ID     json.RawMessage `json:"id"`
			Result json.RawMessage `json:"result"`
			Error  json.RawMessage `json:"error"`
		}
		return json.Unmarshal(b, &m) == nil && bytes.Equal(m.ID, id) && (m.Result != nil || m.Error != nil)
	}
	if is(body) {
		return true
	}
	for line := range bytes.Lines(body) {
		if data, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data:")); ok && is(bytes.TrimSpace(data)) {
			return true
		}
	}
	return false
}

// historyRun says what became of a run's response. Call with s.mu held.
func (s *soak) historyRun(r *run) history.Run {
	hr := history.Run{At: r.at, Done: r.done, Sidecar: -1}
	x, ok := s.exchanges[r.exchange]
	if !ok {
		hr.Lost = "no request to the server was recorded for it"
		return hr
	}
	hr.Sidecar = x.sidecar
	if x.responded && x.writeErr == nil {
		return hr // delivered
	}
	var why []string
	if r.cancelled {
		why = append(why, "its context was cancelled just after it took effect")
	}
	if at, ok := s.deleted[x.session]; ok && at.Before(x.end) {
		why = append(why, fmt.Sprintf("its session's DELETE reached the server at %s, %v after the request", at.Format("15:04:05.000"), at.Sub(x.start).Round(time.Microsecond)))
	}
	switch {
	case x.writeErr != nil:
		why = append(why, fmt.Sprintf("writing the response failed: %v", x.writeErr))
	case x.hungUp:
		why = append(why, "the sidecar's request was gone when the server returned")
	}
	why = append(why, "the server's response did not reach the sidecar")
	hr.Lost = strings.Join(why, "; ")
	return hr
}

type agent struct {
	s        *soak
	n        int
	drops    float64 // how often an explicit-key call's first attempt gives up mid-call
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
	a.key(call, "charge_card", args, meta)
	if a.rnd.Float64() < a.drops {
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
	a.key(call, "charge_card", args, nil)
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

// key notes the store key the sidecars derive for a deduplicated call.
func (a *agent) key(call, tool string, args mcpserver.ChargeArgs, meta mcp.Meta) {
	m := map[string]any{"name": tool, "arguments": args}
	if meta != nil {
		m["_meta"] = meta
	}
	params, err := json.Marshal(m)
	if err != nil {
		a.s.t.Fatal(err)
	}
	tc, err := engine.ParseToolCall(params)
	if err != nil {
		a.s.t.Fatal(err)
	}
	p, err := a.s.keys.Plan(tc, engine.Caller{Principal: a.principal()})
	if err != nil || p == nil {
		a.s.t.Fatalf("%s is not deduplicated: %v", call, err)
	}
	a.s.mu.Lock()
	a.s.keyCall[p.Key] = call
	a.s.mu.Unlock()
}

func (a *agent) principal() string { return fmt.Sprintf("Bearer soak-%d", a.n) }

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
		HTTPClient: &http.Client{Transport: &principal{name: a.principal()}},
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

// takeOver is a take-over a sidecar logged.
type takeOver struct {
	at  time.Time
	key string
}

// storeTrouble reads a sidecar's JSON log: when it could not reach the
// store, and the claims it took over.
func storeTrouble(t *testing.T, path string) (trouble []time.Time, took []takeOver) {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Errorf("reading a sidecar's log: %v", err)
		return nil, nil
	}
	for line := range strings.Lines(string(b)) {
		var rec struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
			Key  string    `json:"key"`
		}
		if json.Unmarshal([]byte(line), &rec) != nil {
			continue
		}
		if strings.HasPrefix(rec.Msg, "Took over an abandoned claim") {
			took = append(took, takeOver{at: rec.Time, key: rec.Key})
		}
		for _, m := range troubleMessages {
			if strings.HasPrefix(rec.Msg, m) {
				trouble = append(trouble, rec.Time)
				break
			}
		}
	}
	return trouble, took
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
