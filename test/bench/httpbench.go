package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/storeopen"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/test/mcpserver"
)

// What a go-sdk v1.8.0 client sends on 2026-07-28 (streamable_headers.go,
// streamable.go, and client.go's injectRequestMeta for SEP-2575): every
// request carries the protocol version, the client's info and capabilities
// in params._meta, and its method (and tool name) in headers.
const (
	protocolVersion = "2026-07-28"
	requestMeta     = `{"io.modelcontextprotocol/clientCapabilities":{"roots":{"listChanged":true}},` +
		`"io.modelcontextprotocol/clientInfo":{"name":"idemcp-bench","version":"1.0.0"},` +
		`"io.modelcontextprotocol/protocolVersion":"` + protocolVersion + `"}`
)

// policyYAML makes refund a Passthrough tool; charge_card is deduplicated
// (Auto: the server does not mark it read-only).
const policyYAML = "spec: {tools: [{name: refund, mode: Passthrough}]}\n"

// uniq numbers the cards of the unique-argument calls across the run, so
// no two are ever the same call.
var uniq atomic.Int64

// scenario is one kind of request.
type scenario struct {
	name   string
	note   string
	method string // Mcp-Method
	tool   string // Mcp-Name and params.name; "" for methods without one
	args   func() string
	// counter is the server's execution counter for this tool ("" for none).
	counter string
	// sidecarReplays: through the sidecar every timed request is a replay
	// and never reaches the server; otherwise every request runs the tool.
	sidecarReplays bool
}

func (sc *scenario) body(id int64) []byte {
	b := make([]byte, 0, 512)
	b = append(b, `{"jsonrpc":"2.0","id":`...)
	b = strconv.AppendInt(b, id, 10)
	b = append(b, `,"method":"`...)
	b = append(b, sc.method...)
	b = append(b, `","params":{"_meta":`...)
	b = append(b, requestMeta...)
	if sc.tool != "" {
		b = append(b, `,"name":"`...)
		b = append(b, sc.tool...)
		b = append(b, `","arguments":`...)
		b = append(b, sc.args()...)
	}
	return append(b, "}}"...)
}

func uniqueCharge() string {
	return `{"amount":10,"card":"4000-` + strconv.FormatInt(uniq.Add(1), 10) + `"}`
}

func sameCharge() string { return `{"amount":10,"card":"4242-4242"}` }

var httpScenarios = []*scenario{
	{name: "tools/list", note: "passthrough, classified from Mcp-Method; the sidecar keeps a copy of the response and parses it after the response is sent, to learn readOnlyHint (Auto mode)", method: "tools/list"},
	{name: "tools/call refund", note: "Passthrough tool, classified from Mcp-Name", method: "tools/call", tool: "refund", args: uniqueCharge, counter: "refund"},
	{name: "tools/call charge_card, unique args", note: "deduplicated and executed: claim, forward, store", method: "tools/call", tool: "charge_card", args: uniqueCharge, counter: "charge_card"},
	{name: "tools/call charge_card, same args", note: "sidecar: replay from the store; direct and proxy run the tool", method: "tools/call", tool: "charge_card", args: sameCharge, counter: "charge_card", sidecarReplays: true},
}

const (
	tDirect  = "direct"
	tProxy   = "plain proxy"
	tSidecar = "sidecar"
)

type target struct {
	name   string
	url    string
	client *http.Client
	ids    atomic.Int64
}

type httpEnv struct {
	srv     *mcpserver.Server
	targets []*target // direct, plain proxy, sidecar
	servers []*http.Server
	tmp     string

	directURL string
	// dedupSeen counts the deduplicated calls sent to the main sidecar.
	dedupSeen int
}

func listenLoopback() (net.Listener, string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	return ln, "http://" + ln.Addr().String(), nil
}

func newClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:               nil,
		MaxIdleConns:        256,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     90 * time.Second,
	}}
}

func (e *httpEnv) serve(h http.Handler) (string, error) {
	ln, u, err := listenLoopback()
	if err != nil {
		return "", err
	}
	s := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	e.servers = append(e.servers, s)
	go func() { _ = s.Serve(ln) }()
	return u, nil
}

func newHTTPEnv() (_ *httpEnv, err error) {
	e := &httpEnv{srv: mcpserver.New()}
	if e.tmp, err = os.MkdirTemp("", "idemcp-bench-"); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			e.close()
		}
	}()
	direct, err := e.serve(e.srv.Handler(true))
	if err != nil {
		return nil, err
	}
	e.directURL = direct
	up, _ := url.Parse(direct)
	plain := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(up)
			pr.Out.Host = pr.In.Host // as the sidecar does
		},
		// The same pool size as the sidecar's transport, so the baseline
		// does not pay for reconnecting under concurrency.
		Transport: &http.Transport{Proxy: nil, MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024, IdleConnTimeout: 90 * time.Second},
	}
	proxyURL, err := e.serve(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Without full duplex, Go's HTTP/1 server closes the request body
		// when the response headers are written; the Go SDK server sends
		// its SSE headers before the transport has finished writing the
		// streamed request body, and about 1 response in 3,000 is cut
		// short (golang/go#40747). A baseline must not fail.
		_ = http.NewResponseController(w).EnableFullDuplex()
		plain.ServeHTTP(w, r)
	}))
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(e.policyFile(), []byte(procPolicyYAML), 0o600); err != nil {
		return nil, err
	}
	side, err := e.newSidecar(tSidecar)
	if err != nil {
		return nil, err
	}
	e.targets = []*target{
		{name: tDirect, url: direct + "/", client: newClient()},
		{name: tProxy, url: proxyURL + "/", client: newClient()},
		side,
	}
	return e, nil
}

func (e *httpEnv) policyFile() string { return filepath.Join(e.tmp, "policy.yaml") }

// newSidecar starts a sidecar, with its own memory store, in front of the
// server.
func (e *httpEnv) newSidecar(name string) (*target, error) {
	sc, err := sidecar.New(sidecar.Options{
		Upstream:   e.directURL,
		PolicyFile: e.policyFile(),
		LogLevel:   "error",
		Store:      storeopen.Options{Kind: "memory", MemoryMaxEntries: store.DefaultMaxEntries},
	})
	if err != nil {
		return nil, err
	}
	u, err := e.serve(sc.Handler())
	if err != nil {
		return nil, err
	}
	return &target{name: name, url: u + "/", client: newClient()}, nil
}

func (e *httpEnv) close() {
	for _, s := range e.servers {
		_ = s.Close()
	}
	_ = os.RemoveAll(e.tmp)
}

// reply is one response, as read by the client.
type reply struct {
	status   int
	ctype    string
	replayed bool
	body     []byte
}

func (t *target) call(sc *scenario) (time.Duration, reply, error) {
	body := sc.body(t.ids.Add(1))
	req, err := http.NewRequest(http.MethodPost, t.url, bytes.NewReader(body))
	if err != nil {
		return 0, reply{}, err
	}
	h := req.Header
	h.Set("Content-Type", "application/json")
	h.Set("Accept", "application/json, text/event-stream")
	h.Set("Mcp-Protocol-Version", protocolVersion)
	h.Set("Mcp-Method", sc.method)
	// A stateless server has no sessions: the caller's Authorization scopes
	// its derived keys (an anonymous caller is not deduplicated).
	h.Set("Authorization", "Bearer idemcp-bench")
	if sc.tool != "" {
		h.Set("Mcp-Name", sc.tool)
	}
	start := time.Now()
	resp, err := t.client.Do(req)
	if err != nil {
		return 0, reply{}, err
	}
	data, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	d := time.Since(start)
	if err != nil {
		return 0, reply{}, err
	}
	r := reply{status: resp.StatusCode, ctype: resp.Header.Get("Content-Type"), replayed: resp.Header.Get("Idempotent-Replayed") == "true", body: data}
	if r.status != http.StatusOK || !bytes.Contains(data, []byte(`"result"`)) || bytes.Contains(data, []byte(`"isError":true`)) {
		return 0, r, fmt.Errorf("%s %s: HTTP %d, not a successful result: %.300s", t.name, sc.name, r.status, data)
	}
	return d, r, nil
}

// tally is what a batch did, for the checks table.
type tally struct {
	requests, replayed, executions, failed int
	firstErr                               string
}

func (a *tally) add(b tally) {
	a.requests += b.requests
	a.replayed += b.replayed
	a.executions += b.executions
	a.failed += b.failed
	if a.firstErr == "" {
		a.firstErr = b.firstErr
	}
}

// maxFailed is the share of failed requests in a batch past which the run
// stops: a rare failure is reported, a broken target is not measured.
const maxFailed = 0.01

// runBatch sends n requests from workers concurrent clients.
func (e *httpEnv) runBatch(t *target, sc *scenario, workers, n int) (batch, tally, error) {
	before := 0
	if sc.counter != "" {
		before = e.srv.Counts.Get(sc.counter)
	}
	lats := make([][]time.Duration, workers)
	replayed := make([]int, workers)
	failed := make([]int, workers)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	startGate := make(chan struct{})
	for w := range workers {
		k := n / workers
		if w < n%workers {
			k++
		}
		lats[w] = make([]time.Duration, 0, k)
		wg.Go(func() {
			<-startGate
			for range k {
				d, r, err := t.call(sc)
				if err != nil {
					// Not timed; counted and reported.
					failed[w]++
					if errs[w] == nil {
						errs[w] = err
					}
					continue
				}
				lats[w] = append(lats[w], d)
				if r.replayed {
					replayed[w]++
				}
			}
		})
	}
	start := time.Now()
	close(startGate)
	wg.Wait()
	b := batch{elapsed: time.Since(start)}
	tl := tally{requests: n}
	for w := range workers {
		b.lat = append(b.lat, lats[w]...)
		tl.replayed += replayed[w]
		tl.failed += failed[w]
		if errs[w] != nil && tl.firstErr == "" {
			tl.firstErr = errs[w].Error()
		}
	}
	if float64(tl.failed) > maxFailed*float64(n) || len(b.lat) == 0 {
		return b, tl, fmt.Errorf("%d of %d requests failed: %w", tl.failed, n, errors.Join(errs...))
	}
	if sc.counter != "" {
		tl.executions = e.srv.Counts.Get(sc.counter) - before
	}
	if t.name == tSidecar && sc.tool == "charge_card" {
		e.dedupSeen += n
	}
	return b, tl, nil
}

type mode struct {
	name    string
	workers int
	n       int
}

type cellKey struct{ mode, scenario, target string }

type httpResults struct {
	rounds    int
	modes     []mode
	scenarios []*scenario
	series    map[cellKey]series
	tally     map[cellKey]*tally
	// seen is how many deduplicated calls the sidecar had received when
	// a scenario's timed rounds began and ended (all within a minute or
	// so, so still remembered by its cancel-tracking set).
	seen   map[cellKey][2]int
	verify string
}

// verify sends one request of each scenario directly to the server and
// checks that it answers 200 with a result, not an error.
func (e *httpEnv) verify() (string, error) {
	var out bytes.Buffer
	for _, sc := range httpScenarios {
		_, r, err := e.targets[0].call(sc)
		if err != nil {
			return "", fmt.Errorf("the server refused what the benchmark sends (is the request what a 2026-07-28 client sends?): %w", err)
		}
		data := r.body
		if i := bytes.Index(data, []byte("data: ")); i >= 0 {
			data = bytes.TrimSpace(data[i+len("data: "):])
		}
		var m struct {
			Result json.RawMessage `json:"result"`
			Error  json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal(data, &m); err != nil || len(m.Result) == 0 || len(m.Error) > 0 {
			return "", fmt.Errorf("direct %s: not a JSON-RPC result: %.300s", sc.name, r.body)
		}
		fmt.Fprintf(&out, "| %s | %d | %s | %d bytes |\n", sc.name, r.status, r.ctype, len(r.body))
	}
	return out.String(), nil
}

func httpSection(w *bytes.Buffer, c config) error {
	e, err := newHTTPEnv()
	if err != nil {
		return err
	}
	defer e.close()
	res := &httpResults{
		rounds:    c.rounds,
		scenarios: selected(httpScenarios, c.scenarios, func(sc *scenario) string { return sc.name }),
		series:    map[cellKey]series{},
		tally:     map[cellKey]*tally{},
		seen:      map[cellKey][2]int{},
	}
	if strings.Contains(c.modes, "seq") {
		res.modes = append(res.modes, mode{"sequential (1 client)", 1, c.seqN})
	}
	if strings.Contains(c.modes, "conc") {
		res.modes = append(res.modes, mode{fmt.Sprintf("concurrency %d", c.workers), c.workers, c.concN})
	}
	if res.verify, err = e.verify(); err != nil {
		return err
	}
	for _, m := range res.modes {
		for _, sc := range res.scenarios {
			progress(fmt.Sprintf("HTTP %s: %s", m.name, sc.name))
			for _, t := range e.targets {
				// Warm up connections, and for the replay scenario make
				// the sidecar run and store the call once.
				if _, tl, err := e.runBatch(t, sc, m.workers, max(c.warmup, m.workers)); err != nil {
					return err
				} else if tl.failed > 0 {
					progress(fmt.Sprintf("warm-up via %s: %d failed: %s", t.name, tl.failed, tl.firstErr))
				}
			}
			seen := [2]int{e.dedupSeen}
			for r := range c.rounds {
				for k := range e.targets {
					t := e.targets[(r+k)%len(e.targets)]
					b, tl, err := e.runBatch(t, sc, m.workers, m.n)
					if err != nil {
						return err
					}
					key := cellKey{m.name, sc.name, t.name}
					res.series[key] = append(res.series[key], b.stat())
					if res.tally[key] == nil {
						res.tally[key] = &tally{}
					}
					res.tally[key].add(tl)
				}
			}
			seen[1] = e.dedupSeen
			res.seen[cellKey{m.name, sc.name, tSidecar}] = seen
		}
	}
	res.write(w, e)

	if c.growth {
		start := time.Now()
		rows, err := e.growthProbe(c)
		if err != nil {
			return fmt.Errorf("section 1b: %w", err)
		}
		writeGrowth(w, c, rows, time.Since(start))
	}
	return nil
}

func (res *httpResults) write(w *bytes.Buffer, e *httpEnv) {
	fmt.Fprintf(w, "\n## 1. Streamable HTTP sidecar (2026-07-28, stateless server)\n\n")
	fmt.Fprintf(w, "The counting MCP server of `test/mcpserver` (Go SDK, stateless, 2026-07-28) on loopback, reached three ways\n")
	fmt.Fprintf(w, "by a keep-alive `net/http` client sending what a go-sdk client sends on 2026-07-28 (headers `Mcp-Protocol-Version`,\n")
	fmt.Fprintf(w, "`Mcp-Method`, `Mcp-Name`, `Accept: application/json, text/event-stream`, and the SEP-2575 `_meta` in every request):\n\n")
	fmt.Fprintf(w, "- **direct**: to the server;\n")
	fmt.Fprintf(w, "- **plain proxy**: through an `httputil.ReverseProxy` (baseline 2: the cost of any HTTP hop), with full duplex\n")
	fmt.Fprintf(w, "  enabled: without it Go's HTTP/1 server cuts short about 1 in 3,000 of these SSE responses when the request\n")
	fmt.Fprintf(w, "  body is streamed through (golang/go#40747); the sidecar streams the body of header-classified passthrough\n")
	fmt.Fprintf(w, "  requests the same way, and any request that failed is listed under Checks;\n")
	fmt.Fprintf(w, "- **sidecar**: through `idemcp sidecar` (memory store, policy `%s`).\n\n", trimNL(policyYAML))
	fmt.Fprintf(w, "Client, proxies and server share this process and its %d cores, as a sidecar shares a pod's.\n", maxProcs())
	fmt.Fprintf(w, "Latency is measured by the client: request written to response body read.\n\n")
	fmt.Fprintf(w, "Request check, one request of each scenario sent directly to the server before measuring:\n\n")
	fmt.Fprintf(w, "| scenario | status | content type | response |\n| --- | ---: | --- | ---: |\n%s\n", res.verify)
	fmt.Fprintf(w, "Scenarios:\n\n")
	for _, sc := range res.scenarios {
		fmt.Fprintf(w, "- `%s`: %s.\n", sc.name, sc.note)
	}
	for _, m := range res.modes {
		fmt.Fprintf(w, "\n### %s\n\n", m.name)
		fmt.Fprintf(w, "| scenario | target | p50 µs | p90 µs | p99 µs | req/s |\n| --- | --- | ---: | ---: | ---: | ---: |\n")
		for _, sc := range res.scenarios {
			for _, t := range e.targets {
				s := res.series[cellKey{m.name, sc.name, t.name}]
				fmt.Fprintf(w, "| %s | %s | %.0f | %.0f | %.0f | %.0f |\n", sc.name, t.name, s.med(p50us), s.med(p90us), s.med(p99us), s.med(rps))
			}
		}
		fmt.Fprintf(w, "\nRatios (median of the %d per-round ratios, [min–max] over the rounds); added latency is the median\n", res.rounds)
		fmt.Fprintf(w, "of the per-round differences of p50:\n\n")
		fmt.Fprintf(w, "| scenario | p50 sidecar/direct | p50 sidecar/proxy | p50 proxy/direct | p99 sidecar/direct | p99 sidecar/proxy | req/s sidecar/direct | req/s sidecar/proxy | added p50 µs vs direct | added p50 µs vs proxy |\n")
		fmt.Fprintf(w, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
		for _, sc := range res.scenarios {
			d := res.series[cellKey{m.name, sc.name, tDirect}]
			p := res.series[cellKey{m.name, sc.name, tProxy}]
			s := res.series[cellKey{m.name, sc.name, tSidecar}]
			fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", sc.name,
				fmtRatio(pair(s, d, ratioP50)), fmtRatio(pair(s, p, ratioP50)), fmtRatio(pair(p, d, ratioP50)),
				fmtRatio(pair(s, d, ratioP99)), fmtRatio(pair(s, p, ratioP99)),
				fmtRatio(pair(s, d, ratioRPS)), fmtRatio(pair(s, p, ratioRPS)),
				fmtDiff(pair(s, d, diffP50)), fmtDiff(pair(s, p, diffP50)))
		}
	}
	fmt.Fprintf(w, "\n### Checks\n\n")
	fmt.Fprintf(w, "What the timed requests did (warm-up excluded), counted by the client (`Idempotent-Replayed: true`) and\n")
	fmt.Fprintf(w, "by the server's own execution counters:\n\n")
	fmt.Fprintf(w, "The last column is how many deduplicated calls the sidecar had received since it started (warm-up included)\n")
	fmt.Fprintf(w, "when the scenario's timed rounds began and ended: see section 1b for why it matters.\n\n")
	fmt.Fprintf(w, "| run | scenario | target | requests | failed | replayed | tool executions | as expected | sidecar's dedup calls so far |\n| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |\n")
	var failures []string
	for _, m := range res.modes {
		for _, sc := range res.scenarios {
			for _, t := range e.targets {
				tl := res.tally[cellKey{m.name, sc.name, t.name}]
				execs, ok := "–", tl.replayed == 0
				if sc.counter != "" {
					execs = strconv.Itoa(tl.executions)
					wantExec, wantReplay := tl.requests, 0
					if sc.sidecarReplays && t.name == tSidecar {
						wantExec, wantReplay = 0, tl.requests-tl.failed
					}
					ok = tl.executions == wantExec && tl.replayed == wantReplay
				}
				ok = ok && tl.failed == 0
				seen := ""
				if t.name == tSidecar {
					sn := res.seen[cellKey{m.name, sc.name, t.name}]
					seen = fmt.Sprintf("%d → %d", sn[0], sn[1])
				}
				fmt.Fprintf(w, "| %s | %s | %s | %d | %d | %d | %s | %s | %s |\n", m.name, sc.name, t.name, tl.requests, tl.failed, tl.replayed, execs, yesNo(ok), seen)
				if tl.failed > 0 {
					failures = append(failures, fmt.Sprintf("- %s, %s, %s: %d of %d failed (not timed); the first: `%s`",
						m.name, sc.name, t.name, tl.failed, tl.requests, oneLine(tl.firstErr)))
				}
			}
		}
	}
	if len(failures) > 0 {
		fmt.Fprintf(w, "\nFailed requests (a failed request ran on the server if it reached it; its latency is left out):\n\n%s\n", strings.Join(failures, "\n"))
	}
}

func trimNL(s string) string { return string(bytes.TrimSpace([]byte(s))) }

func yesNo(ok bool) string {
	if ok {
		return "yes"
	}
	return "**NO**"
}

func fmtRatio(p paired) string {
	return fmt.Sprintf("%.2f [%.2f–%.2f]", p.med, p.lo, p.hi)
}

func fmtDiff(p paired) string {
	return fmt.Sprintf("%+.0f [%+.0f…%+.0f]", p.med, p.lo, p.hi)
}

// selected keeps the items whose name contains filter (all if it is empty).
func selected[T any](all []T, filter string, name func(T) string) []T {
	var out []T
	for _, x := range all {
		if strings.Contains(name(x), filter) {
			out = append(out, x)
		}
	}
	return out
}

// growthSteps are how many deduplicated calls a fresh sidecar has received
// (all within the last minute) when it is measured in section 1b.
var growthSteps = []int{0, 4000, 8000, 16000, 32000}

const (
	growthRounds = 3
	growthSeqN   = 200
	growthConcN  = 400
)

type growthRow struct {
	seen       [2]int
	sSeq, dSeq series
	sCon, dCon series
}

// growthProbe measures a replay through a fresh sidecar as the number of
// deduplicated calls it received in the last minute grows. The sidecar
// remembers the request id of every deduplicated call for a minute (so
// that a late notifications/cancelled is not forwarded); this shows what
// that memory costs per call.
func (e *httpEnv) growthProbe(c config) ([]growthRow, error) {
	side, err := e.newSidecar("fresh sidecar")
	if err != nil {
		return nil, err
	}
	direct := e.targets[0]
	var replay *scenario
	for _, sc := range httpScenarios {
		if sc.sidecarReplays {
			replay = sc
		}
	}
	if _, _, err := side.call(replay); err != nil { // runs and stores it
		return nil, err
	}
	sent := 1
	var rows []growthRow
	for _, step := range growthSteps {
		if step > sent {
			progress(fmt.Sprintf("HTTP 1b: filling the fresh sidecar to %d deduplicated calls", step))
			if _, _, err := e.runBatch(side, replay, c.workers, step-sent); err != nil {
				return nil, err
			}
			sent = step
		}
		row := growthRow{seen: [2]int{sent}}
		for r := range growthRounds {
			order := []*target{side, direct}
			if r%2 == 1 {
				order[0], order[1] = order[1], order[0]
			}
			for _, t := range order {
				seq, _, err := e.runBatch(t, replay, 1, growthSeqN)
				if err != nil {
					return nil, err
				}
				con, _, err := e.runBatch(t, replay, c.workers, growthConcN)
				if err != nil {
					return nil, err
				}
				if t == side {
					row.sSeq, row.sCon = append(row.sSeq, seq.stat()), append(row.sCon, con.stat())
					sent += growthSeqN + growthConcN
				} else {
					row.dSeq, row.dCon = append(row.dSeq, seq.stat()), append(row.dCon, con.stat())
				}
			}
		}
		row.seen[1] = sent
		rows = append(rows, row)
	}
	return rows, nil
}

func writeGrowth(w *bytes.Buffer, c config, rows []growthRow, took time.Duration) {
	fmt.Fprintf(w, "\n## 1b. Sidecar cost vs. deduplicated calls received in the last minute\n\n")
	fmt.Fprintf(w, "A fresh sidecar (same policy, its own memory store) in front of the same server. Between measurements it is\n")
	fmt.Fprintf(w, "sent replays of `tools/call charge_card, same args` (%d concurrent clients, each request with a new JSON-RPC id, as\n", c.workers)
	fmt.Fprintf(w, "an SDK client numbers its requests) until it has received the number of deduplicated calls in the first column;\n")
	fmt.Fprintf(w, "the whole section took %s, so none of them is older than a minute. At each step, %d alternating rounds of\n", took.Round(time.Second), growthRounds)
	fmt.Fprintf(w, "%d sequential and %d concurrent (%d clients) `same args` calls, to the sidecar (replays) and to the server directly.\n\n", growthSeqN, growthConcN, c.workers)
	fmt.Fprintf(w, "| dedup calls received (start → end of step) | sidecar replay p50 µs, 1 client | vs first step | p50 sidecar/direct | sidecar replay req/s, %d clients | vs first step | req/s sidecar/direct |\n", c.workers)
	fmt.Fprintf(w, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	if len(rows) == 0 {
		return
	}
	p0, r0 := rows[0].sSeq.med(p50us), rows[0].sCon.med(rps)
	for _, r := range rows {
		p, q := r.sSeq.med(p50us), r.sCon.med(rps)
		fmt.Fprintf(w, "| %d → %d | %.0f | %.2f | %s | %.0f | %.2f | %s |\n", r.seen[0], r.seen[1],
			p, p/p0, fmtRatio(pair(r.sSeq, r.dSeq, ratioP50)), q, q/r0, fmtRatio(pair(r.sCon, r.dCon, ratioRPS)))
	}
}
