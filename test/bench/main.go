// Command bench measures what idemcp adds to an MCP tool call, as ratios
// against baselines measured in the same run: the MCP server called
// directly, and the same server behind a plain reverse proxy (HTTP), or the
// stdio server run directly (stdio). These machines are noisy, so the
// targets are measured in alternating rounds and every figure is a median
// over rounds; a ratio is the median of the per-round ratios.
//
//	go run ./test/bench -out test/bench/results.md   (make bench)
//
// Everything runs on loopback: the counting MCP server of test/mcpserver,
// a plain httputil.ReverseProxy and the idemcp sidecar in this process, and
// for stdio the stdioserver and `idemcp wrap` built into a temporary
// directory. It finishes with the engine's Go benchmarks, which are
// absolute figures and labelled as such.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"strings"
	"time"
)

type config struct {
	out        string
	rounds     int
	seqN       int
	concN      int
	workers    int
	stdioN     int
	warmup     int
	sections   string
	scenarios  string
	modes      string
	cpuprofile string
	memprofile string
	blkprofile string
	growth     bool

	procRounds    int
	procMaxRounds int
	noise         float64
	largeN        int
	inFlight      int
	procConcN     int
	procClients   int
	sessions      int
}

func main() {
	var c config
	flag.StringVar(&c.out, "out", "", "write the Markdown report here (default: stdout)")
	flag.IntVar(&c.rounds, "rounds", 8, "alternating rounds per scenario; every figure is a median over them")
	flag.IntVar(&c.seqN, "n", 250, "requests per target per round, sequential")
	flag.IntVar(&c.concN, "conc-n", 600, "requests per target per round in the concurrent runs")
	flag.IntVar(&c.workers, "c", 8, "concurrent clients in the concurrent runs")
	flag.IntVar(&c.stdioN, "stdio-n", 250, "requests per target per round over stdio")
	flag.IntVar(&c.warmup, "warmup", 100, "untimed requests per target before each scenario")
	flag.StringVar(&c.sections, "sections", "procs,http,stdio,go", "comma-separated sections to run: procs (the headline: separate processes), http, stdio, go")
	flag.IntVar(&c.procRounds, "proc-rounds", 3, "rounds of the separate-process section, at least")
	flag.IntVar(&c.procMaxRounds, "proc-max-rounds", 8, "rounds of the separate-process section at most: rounds are added until every headline ratio's range is within -noise of its median")
	flag.Float64Var(&c.noise, "noise", 0.15, "a headline ratio whose range over the rounds reaches further than this share of its median is marked noisy")
	flag.IntVar(&c.largeN, "large-n", 100, "calls with a 1 MiB result per row per round, 1 client, in the separate-process section")
	flag.IntVar(&c.inFlight, "in-flight", 16, "concurrent 1 MiB calls when measuring the sidecar's extra RSS per call in flight")
	flag.IntVar(&c.procConcN, "proc-conc-n", 3000, "calls per row per round from -proc-c clients in the separate-process section")
	flag.IntVar(&c.procClients, "proc-c", 64, "concurrent clients in the separate-process section")
	flag.IntVar(&c.sessions, "sessions", 1000, "concurrent sessions when measuring the sidecar's RSS")
	flag.StringVar(&c.scenarios, "scenarios", "", "only the HTTP and stdio scenarios whose name contains this (default: all)")
	flag.StringVar(&c.modes, "modes", "seq,conc", "HTTP runs: seq (1 client), conc (-c clients), or both")
	flag.BoolVar(&c.growth, "growth", true, "measure the sidecar's cost as its recent deduplicated calls grow (section 1b)")
	flag.StringVar(&c.cpuprofile, "cpuprofile", "", "write a CPU profile of the HTTP and stdio sections here (for a throwaway run)")
	flag.StringVar(&c.memprofile, "memprofile", "", "write an allocation profile of the HTTP and stdio sections here")
	flag.StringVar(&c.blkprofile, "blockprofile", "", "write a blocking profile of the HTTP and stdio sections here (every blocking event is sampled)")
	flag.Parse()
	if err := run(c); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(c config) error {
	if c.rounds < 1 || c.seqN < 1 || c.concN < c.workers || c.workers < 1 || c.stdioN < 1 {
		return fmt.Errorf("-rounds, -n, -c, -stdio-n must be positive and -conc-n at least -c")
	}
	want := map[string]bool{}
	for _, s := range strings.Split(c.sections, ",") {
		want[strings.TrimSpace(s)] = true
	}
	c.procMaxRounds = max(c.procMaxRounds, c.procRounds)
	start := time.Now()
	progress("load average (1, 5, 15 min) at the start: " + loadavg())
	defer func() { progress("load average (1, 5, 15 min) at the end: " + loadavg()) }()
	var doc bytes.Buffer
	writeHeader(&doc, c, start)

	if c.cpuprofile != "" {
		f, err := os.Create(c.cpuprofile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer func() {
			pprof.StopCPUProfile()
			_ = f.Close()
		}()
	}

	if c.memprofile != "" {
		runtime.MemProfileRate = 4096
	}
	if c.blkprofile != "" {
		runtime.SetBlockProfileRate(1)
	}
	if want["procs"] {
		progress("processes: starting")
		if err := procSection(&doc, c); err != nil {
			return fmt.Errorf("separate-process section: %w", err)
		}
	}
	if want["http"] {
		progress("HTTP: starting")
		if err := httpSection(&doc, c); err != nil {
			return fmt.Errorf("HTTP section: %w", err)
		}
	}
	if want["stdio"] {
		progress("stdio: starting")
		stdioSection(&doc, c)
	}
	if c.cpuprofile != "" {
		pprof.StopCPUProfile()
	}
	for _, p := range []struct{ name, file string }{{"allocs", c.memprofile}, {"block", c.blkprofile}} {
		if p.file == "" {
			continue
		}
		if err := writeProfile(p.name, p.file); err != nil {
			return err
		}
	}
	if want["go"] {
		progress("Go benchmarks: starting")
		goBenchSection(&doc)
		progress("middleware and store benchmarks: starting")
		libBenchSection(&doc)
	}
	fmt.Fprintf(&doc, "\n---\nLoad average at the end: %s. Total run time %s.\n", loadavg(), time.Since(start).Round(time.Second))

	if c.out == "" {
		_, err := os.Stdout.Write(doc.Bytes())
		return err
	}
	if err := os.WriteFile(c.out, doc.Bytes(), 0o644); err != nil {
		return err
	}
	progress("wrote " + c.out)
	return nil
}

func writeProfile(name, file string) error {
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if err := pprof.Lookup(name).WriteTo(f, 0); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

func progress(msg string) {
	fmt.Fprintf(os.Stderr, "%s bench: %s\n", time.Now().Format("15:04:05"), msg)
}

func writeHeader(w *bytes.Buffer, c config, start time.Time) {
	fmt.Fprintf(w, "# idemcp benchmark results\n\n")
	fmt.Fprintf(w, "Generated by `make bench` (`go run ./test/bench -out test/bench/results.md`). Do not edit by hand.\n\n")
	fmt.Fprintf(w, "| | |\n| --- | --- |\n")
	fmt.Fprintf(w, "| date | %s |\n", start.UTC().Format("2006-01-02 15:04:05 MST"))
	fmt.Fprintf(w, "| go version | %s |\n", goVersion())
	fmt.Fprintf(w, "| CPU | %s |\n", cpuModel())
	fmt.Fprintf(w, "| cores | %d (GOMAXPROCS %d) |\n", runtime.NumCPU(), runtime.GOMAXPROCS(0))
	fmt.Fprintf(w, "| load average at start (1, 5, 15 min) | %s |\n", loadavg())
	fmt.Fprintf(w, "| rounds | %d per scenario, targets alternating (order rotated each round) |\n", c.rounds)
	fmt.Fprintf(w, "| requests per target per round | %d sequential, %d with %d concurrent clients, %d over stdio; %d untimed warm-up requests first |\n",
		c.seqN, c.concN, c.workers, c.stdioN, c.warmup)
	fmt.Fprintf(w, "\nEvery figure is the median over the rounds of that round's figure. A ratio is the median of the\n")
	fmt.Fprintf(w, "per-round ratios (its range over the rounds in brackets), so both sides of a ratio were measured\n")
	fmt.Fprintf(w, "within seconds of each other. Ratios are the figures to compare between runs; absolute times\n")
	fmt.Fprintf(w, "depend on the machine and on whatever else it runs.\n")
}

func goVersion() string {
	out, err := exec.Command("go", "version").Output()
	if err != nil {
		return runtime.Version() + " (runtime; `go version` failed)"
	}
	return strings.TrimSpace(string(out))
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return runtime.GOARCH + " (no /proc/cpuinfo)"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return runtime.GOARCH
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], ", ")
}

func maxProcs() int { return runtime.GOMAXPROCS(0) }
