package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// seedAddedP50 is the seed project's published figure for `idemcp wrap`:
// the p50 latency it adds to a stdio round trip, with the memory store.
const seedAddedP50 = 0.07 // ms

// stdioProc is an MCP server process spoken to over its stdin and stdout,
// one JSON-RPC message per line.
type stdioProc struct {
	name   string
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Reader
	stderr *bytes.Buffer
	ids    int64
}

func startStdio(name string, argv ...string) (*stdioProc, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	p := &stdioProc{name: name, cmd: cmd, in: in, out: bufio.NewReaderSize(out, 1<<16), stderr: &bytes.Buffer{}}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return p, nil
}

// call writes one request and reads lines until its response.
func (p *stdioProc) call(method, params string) (time.Duration, []byte, error) {
	p.ids++
	line := make([]byte, 0, 512)
	line = append(line, `{"jsonrpc":"2.0","id":`...)
	line = strconv.AppendInt(line, p.ids, 10)
	line = append(line, `,"method":"`...)
	line = append(line, method...)
	line = append(line, `","params":`...)
	line = append(line, params...)
	line = append(line, "}\n"...)
	want := strconv.AppendInt(nil, p.ids, 10)
	start := time.Now()
	if _, err := p.in.Write(line); err != nil {
		return 0, nil, fmt.Errorf("%s: writing a request: %w", p.name, err)
	}
	for {
		resp, err := p.out.ReadBytes('\n')
		if err != nil {
			return 0, nil, fmt.Errorf("%s: reading the response: %w (stderr: %.500s)", p.name, err, p.stderr.String())
		}
		var m struct {
			ID json.RawMessage `json:"id"`
		}
		if json.Unmarshal(resp, &m) == nil && bytes.Equal(m.ID, want) {
			return time.Since(start), resp, nil
		}
		// A notification or a log line: not ours, keep reading.
	}
}

func (p *stdioProc) close() {
	_ = p.in.Close()
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

func toolParams(tool, args string) string {
	return `{"_meta":` + requestMeta + `,"name":"` + tool + `","arguments":` + args + `}`
}

type stdioScenario struct {
	name    string
	note    string
	tool    string
	args    func() string
	replays bool // through the wrapper, every timed call is a replay
}

var stdioScenarios = []*stdioScenario{
	{name: "tools/call refund", note: "Passthrough tool: relayed as is", tool: "refund", args: uniqueCharge},
	{name: "tools/call charge_card, unique args", note: "deduplicated and executed: claim, forward, store", tool: "charge_card", args: uniqueCharge},
	{name: "tools/call charge_card, same args", note: "wrapped: replay from the store; direct runs the tool", tool: "charge_card", args: sameCharge, replays: true},
}

var replayedMark = []byte(`"idemcp.io/replayed":true`)

func (p *stdioProc) batch(sc *stdioScenario, n int) (batch, int, error) {
	b := batch{lat: make([]time.Duration, 0, n)}
	replayed := 0
	start := time.Now()
	for range n {
		d, resp, err := p.call("tools/call", toolParams(sc.tool, sc.args()))
		if err != nil {
			return b, 0, err
		}
		if !bytes.Contains(resp, []byte(`"result"`)) || bytes.Contains(resp, []byte(`"isError":true`)) {
			return b, 0, fmt.Errorf("%s %s: not a successful result: %.300s", p.name, sc.name, resp)
		}
		if bytes.Contains(resp, replayedMark) {
			replayed++
		}
		b.lat = append(b.lat, d)
	}
	b.elapsed = time.Since(start)
	return b, replayed, nil
}

// buildStdio builds `idemcp` and the stdio test server into dir.
func buildStdio(dir string) (idemcp, server string, err error) {
	idemcp, server = filepath.Join(dir, "idemcp"), filepath.Join(dir, "stdioserver")
	for bin, pkg := range map[string]string{
		idemcp: "github.com/idemcp/idemcp",
		server: "github.com/idemcp/idemcp/test/mcpserver/cmd/stdioserver",
	} {
		out, err := exec.Command("go", "build", "-o", bin, pkg).CombinedOutput()
		if err != nil {
			return "", "", fmt.Errorf("go build %s: %w: %s", pkg, err, strings.TrimSpace(string(out)))
		}
	}
	return idemcp, server, nil
}

const (
	sDirect  = "direct"
	sWrapped = "idemcp wrap"
)

func stdioSection(w *bytes.Buffer, c config) {
	fmt.Fprintf(w, "\n## 2. stdio: `idemcp wrap`\n\n")
	res, err := measureStdio(c)
	if err != nil {
		fmt.Fprintf(w, "skipped: %v\n", oneLine(err.Error()))
		progress("stdio skipped: " + err.Error())
		return
	}
	res.write(w)
}

func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 600 {
		s = s[:600] + "…"
	}
	return s
}

type stdioResults struct {
	rounds    int
	scenarios []*stdioScenario
	handshake string
	series    map[[2]string]series // scenario, target
	tally     map[[2]string]*tally
}

func measureStdio(c config) (*stdioResults, error) {
	dir, err := os.MkdirTemp("", "idemcp-bench-stdio-")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	idemcp, server, err := buildStdio(dir)
	if err != nil {
		return nil, err
	}
	pol := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(pol, []byte(policyYAML), 0o600); err != nil {
		return nil, err
	}
	direct, err := startStdio(sDirect, server)
	if err != nil {
		return nil, err
	}
	defer direct.close()
	wrapped, err := startStdio(sWrapped, idemcp, "wrap", "--log-level", "error", "--store", "memory", "--policy-file", pol, "--", server)
	if err != nil {
		return nil, fmt.Errorf("starting idemcp wrap: %w", err)
	}
	defer wrapped.close()
	procs := []*stdioProc{direct, wrapped}

	// The 2026-07-28 handshake a go-sdk client does once: server/discover
	// (it replaces initialize; every request then carries its _meta).
	res := &stdioResults{rounds: c.rounds, series: map[[2]string]series{}, tally: map[[2]string]*tally{}}
	for _, p := range procs {
		d, resp, err := p.call("server/discover", `{"_meta":`+requestMeta+`}`)
		if err != nil {
			return nil, err
		}
		if !bytes.Contains(resp, []byte(`"supportedVersions"`)) {
			return nil, fmt.Errorf("%s: server/discover answered %.300s", p.name, resp)
		}
		res.handshake += fmt.Sprintf("%s %.2f ms; ", p.name, float64(d)/float64(time.Millisecond))
	}
	res.scenarios = selected(stdioScenarios, c.scenarios, func(sc *stdioScenario) string { return sc.name })
	for _, sc := range res.scenarios {
		progress("stdio: " + sc.name)
		for _, p := range procs {
			if _, _, err := p.batch(sc, c.warmup); err != nil {
				return nil, err
			}
		}
		for r := range c.rounds {
			for k := range procs {
				p := procs[(r+k)%len(procs)]
				b, replayed, err := p.batch(sc, c.stdioN)
				if err != nil {
					return nil, err
				}
				key := [2]string{sc.name, p.name}
				res.series[key] = append(res.series[key], b.stat())
				if res.tally[key] == nil {
					res.tally[key] = &tally{}
				}
				res.tally[key].add(tally{requests: c.stdioN, replayed: replayed})
			}
		}
	}
	for _, sc := range res.scenarios {
		for _, p := range procs {
			tl := res.tally[[2]string{sc.name, p.name}]
			want := 0
			if sc.replays && p == wrapped {
				want = tl.requests
			}
			if tl.replayed != want {
				return nil, errors.New(sc.name + " via " + p.name + ": " + strconv.Itoa(tl.replayed) + " of " +
					strconv.Itoa(tl.requests) + " responses marked replayed, want " + strconv.Itoa(want))
			}
		}
	}
	return res, nil
}

func (res *stdioResults) write(w *bytes.Buffer) {
	fmt.Fprintf(w, "The stdio test server (`test/mcpserver/cmd/stdioserver`, the same counting server) run directly, and run as\n")
	fmt.Fprintf(w, "`idemcp wrap --store memory --policy-file P -- stdioserver` (policy `%s`), both built with `go build` into a\n", trimNL(policyYAML))
	fmt.Fprintf(w, "temporary directory. One client per process writes a request line and reads its response line (newline-delimited\n")
	fmt.Fprintf(w, "JSON-RPC over pipes), sequentially, after the 2026-07-28 handshake (`server/discover`, which replaces `initialize`;\n")
	fmt.Fprintf(w, "first call: %s).\n\n", strings.TrimSuffix(res.handshake, "; "))
	for _, sc := range res.scenarios {
		fmt.Fprintf(w, "- `%s`: %s.\n", sc.name, sc.note)
	}
	fmt.Fprintf(w, "\n| scenario | target | p50 ms | p99 ms | calls/s | replayed |\n| --- | --- | ---: | ---: | ---: | ---: |\n")
	for _, sc := range res.scenarios {
		for _, t := range []string{sDirect, sWrapped} {
			s := res.series[[2]string{sc.name, t}]
			tl := res.tally[[2]string{sc.name, t}]
			fmt.Fprintf(w, "| %s | %s | %.3f | %.3f | %.0f | %d/%d |\n", sc.name, t, s.med(p50us)/1000, s.med(p99us)/1000, s.med(rps), tl.replayed, tl.requests)
		}
	}
	fmt.Fprintf(w, "\n| scenario | p50 wrap/direct | p99 wrap/direct | added p50 ms | seed project's published added p50 |\n| --- | ---: | ---: | ---: | ---: |\n")
	for _, sc := range res.scenarios {
		d := res.series[[2]string{sc.name, sDirect}]
		s := res.series[[2]string{sc.name, sWrapped}]
		added := pair(s, d, diffP50)
		fmt.Fprintf(w, "| %s | %s | %s | %+.3f [%+.3f…%+.3f] | %.2f ms (in-memory store) |\n", sc.name,
			fmtRatio(pair(s, d, ratioP50)), fmtRatio(pair(s, d, ratioP99)),
			added.med/1000, added.lo/1000, added.hi/1000, seedAddedP50)
	}
	fmt.Fprintf(w, "\nAdded p50 is the median over the %d rounds of (wrap p50 − direct p50), [range over the rounds].\n", res.rounds)
	fmt.Fprintf(w, "The seed figure was measured on other hardware; only the ratios here are comparable between machines.\n")
}
