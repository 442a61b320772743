package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/freeport"
)

// The separate-process section: the load generator (this process), the
// MCP server, the plain Go proxy, nginx and the sidecar each run in a
// process of their own, so that every proxy's CPU is read from
// its threads' /proc/PID/task/TID/schedstat and its peak RSS from
// /proc/PID/status.

// proc is a child process the section started.
type proc struct {
	name string
	cmd  *exec.Cmd
	url  string // http://host:port
	addr string
	logs bytes.Buffer
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) stop() {
	if p == nil || p.cmd.Process == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
}

// cpuTime is the CPU time the process used: the sum over its threads of
// their time on a CPU from /proc/PID/task/TID/schedstat (nanoseconds),
// else utime+stime from /proc/PID/stat (clock ticks of 10 ms, too coarse
// for 250 calls of half a millisecond). A Go process's threads live as
// long as it does, so none of its time is lost with a thread.
func cpuTime(pid int) time.Duration {
	if hasSchedstat {
		d, _ := schedTime(pid)
		return d // 0 if it failed: never a tick count beside nanoseconds
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the parenthesised command name; utime and stime are
	// fields 14 and 15 of the whole line.
	i := bytes.LastIndexByte(b, ')')
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+s) * 10 * time.Millisecond
}

// hasSchedstat is whether this kernel has per-thread schedstat, decided
// once so that a batch's two reads are never one in nanoseconds and one
// in clock ticks.
var _, hasSchedstat = schedTime(os.Getpid())

func schedTime(pid int) (time.Duration, bool) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) == 0 {
		return 0, false
	}
	var sum time.Duration
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, t.Name()))
		if err != nil {
			continue // the thread ended between the listing and now
		}
		f := strings.Fields(string(b))
		if len(f) == 0 {
			return 0, false
		}
		ns, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, false
		}
		sum += time.Duration(ns)
	}
	return sum, true
}

// memKB reads a field of /proc/PID/status, such as VmRSS or VmHWM (peak).
func memKB(pid int, field string) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return math.NaN()
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), ":"); ok && k == field {
			n, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			return n
		}
	}
	return math.NaN()
}

func freeAddr() (string, error) {
	return freeport.Addr("127.0.0.1")
}

// startProc starts bin with args; addrFlag names the flag that receives a
// free loopback address ("" when args hold it already, at addr).
func startProc(name, bin string, args []string, addr string) (*proc, error) {
	return startProcEnv(name, bin, args, addr, nil)
}

// startProcEnv is startProc with env added to the bench's environment.
func startProcEnv(name, bin string, args []string, addr string, env []string) (*proc, error) {
	p := &proc{name: name, addr: addr, url: "http://" + addr}
	p.cmd = exec.Command(bin, args...)
	if env != nil {
		p.cmd.Env = append(os.Environ(), env...)
	}
	p.cmd.Stdout = &p.logs
	p.cmd.Stderr = &p.logs
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	return p, nil
}

// waitServing polls until the process answers an HTTP request.
func waitServing(p *proc, start time.Time, limit time.Duration) error {
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true, Proxy: nil}, Timeout: time.Second}
	for time.Since(start) < limit {
		resp, err := c.Get(p.url + "/")
		if err == nil {
			_ = resp.Body.Close()
			return nil
		}
		time.Sleep(500 * time.Microsecond)
	}
	return fmt.Errorf("%s did not serve within %s: %.500s", p.name, limit, p.logs.String())
}

// procRow is one line of the headline table.
type procRow struct {
	name  string
	short string // label in the chart
	t     *target
	sc    *scenario
	proxy *proc // nil for direct
	// per mode: one stat per round
	st   map[string]series
	cpu  map[string][]float64 // ms per 1000 calls, per round
	fail int
	// large: a row of the 1 MiB result, run from 1 client only.
	large bool
}

type procEnv struct {
	tmp                           string
	bins                          map[string]string
	procs                         []*proc
	server, plain, nginx          *proc
	sideMem, sideRedis, redisProc *proc
	// plainLarge and sideLarge (memory store) serve only the 1 MiB rows:
	// hundreds of 1 MiB results stored in sideMem would make its peak RSS
	// that of the store, not of the passthrough path it is compared on.
	plainLarge, sideLarge *proc
	// sideTraced is sideRedis with tracing on; traceEnv, the environment
	// start gives the process being started. sideStoreSpans is sideTraced
	// under a policy with spec.tracing.storeSpans.
	sideTraced, sideStoreSpans *proc
	// sideUnsampled is sideTraced sampling nothing (always_off): what a
	// call the sampler drops costs over tracing off.
	sideUnsampled *proc
	// sideNoTracing is sideRedis built with the notracing tag: no tracing
	// code on a call's path, against which tracing off is measured.
	sideNoTracing *proc
	traceEnv      []string
	rows          []*procRow
	p999          map[*procRow]map[string][]float64
	nginxNote     string
	// pingHot and pingGapped: PING p50 back to back and with pingGap
	// between pings, per round.
	pingHot, pingGapped []float64
	// redisPerCall: commands clients sent Redis per executed and per
	// replayed call of the Redis sidecar.
	redisPerCall [2]float64
	startup      []time.Duration
	// The same sidecar run from the full idemcp binary (manager linked
	// in), for the data-plane binary question.
	fullStartup                []time.Duration
	fullIdleRSS, proxyIdleRSS  float64
	idleRSS, sessRSS, sessPeak float64
	// idleAnon is idleRSS's private part (RssAnon); the rest is file
	// pages, mostly the binary's, which every sidecar of one image on a
	// node shares in the page cache.
	idleAnon float64
	sessions int
	dup      [][3]string
	// rounds the section ran, and whether it stopped because every
	// headline ratio settled within the noise bound.
	rounds  int
	settled bool
	// inFlightKB: the sidecar's peak RSS over its idle RSS per 1 MiB call
	// in flight, KiB, per repetition.
	inFlightKB []float64
	inFlightK  int
}

func (e *procEnv) close() {
	for _, p := range e.procs {
		p.stop()
	}
	_ = os.RemoveAll(e.tmp)
}

func (e *procEnv) start(name, bin string, args func(addr string) []string) (*proc, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	p, err := startProcEnv(name, bin, args(addr), addr, e.traceEnv)
	if err != nil {
		return nil, err
	}
	e.procs = append(e.procs, p)
	if err := waitServing(p, t0, 60*time.Second); err != nil {
		return nil, err
	}
	return p, nil
}

func (e *procEnv) build() error {
	e.bins = map[string]string{}
	for name, pkg := range map[string]string{
		"idemcp":     ".",
		"proxy":      "./cmd/idemcp-proxy",
		"httpserver": "./test/mcpserver/cmd/httpserver",
		"plainproxy": "./test/bench/cmd/plainproxy",
	} {
		out := filepath.Join(e.tmp, name)
		cmd := exec.Command("go", "build", "-o", out, pkg)
		if b, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s: %w: %s", pkg, err, b)
		}
		e.bins[name] = out
	}
	// The data plane without tracing code on a call's path, for what
	// tracing off costs.
	out := filepath.Join(e.tmp, "proxy-notracing")
	if b, err := exec.Command("go", "build", "-tags", "notracing", "-o", out, "./cmd/idemcp-proxy").CombinedOutput(); err != nil {
		return fmt.Errorf("go build -tags notracing ./cmd/idemcp-proxy: %w: %s", err, b)
	}
	e.bins["proxy-notracing"] = out
	return nil
}

func (e *procEnv) sidecar(name, upstream string, extra ...string) (*proc, error) {
	return e.sidecarOf(e.bins["proxy"], name, upstream, extra...)
}

func (e *procEnv) sidecarOf(bin, name, upstream string, extra ...string) (*proc, error) {
	return e.sidecarWith(bin, "policy.yaml", name, upstream, extra...)
}

// sidecarWith starts a sidecar of bin under the policy file policy (in
// e.tmp).
func (e *procEnv) sidecarWith(bin, policy, name, upstream string, extra ...string) (*proc, error) {
	return e.start(name, bin, func(a string) []string {
		return append([]string{"sidecar", "--listen", a, "--upstream", upstream, "--policy-file", filepath.Join(e.tmp, policy),
			"--admin-listen", "", "--log-level", "error"}, extra...)
	})
}

func (e *procEnv) startNginx() error {
	bin, err := exec.LookPath("nginx")
	if err != nil {
		for _, p := range []string{"/usr/sbin/nginx", "/sbin/nginx"} {
			if _, serr := os.Stat(p); serr == nil {
				bin, err = p, nil
			}
		}
	}
	if err != nil {
		e.nginxNote = "nginx is not installed (`make bench` installs Debian's nginx-light with apt-get); its row is missing"
		return nil
	}
	addr, err := freeAddr()
	if err != nil {
		return err
	}
	dir := filepath.Join(e.tmp, "nginx")
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return err
	}
	conf := fmt.Sprintf(`daemon off;
master_process off;
worker_processes 1;
error_log stderr error;
pid %[1]s/nginx.pid;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path %[1]s/body;
  proxy_temp_path %[1]s/proxy;
  fastcgi_temp_path %[1]s/fastcgi;
  uwsgi_temp_path %[1]s/uwsgi;
  scgi_temp_path %[1]s/scgi;
  upstream mcp { server %[2]s; keepalive 256; }
  server {
    listen %[3]s;
    location / {
      proxy_pass http://mcp;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $http_host;
      proxy_buffering off;
      proxy_request_buffering off;
    }
  }
}
`, dir, e.server.addr, addr)
	cf := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(cf, []byte(conf), 0o644); err != nil {
		return err
	}
	t0 := time.Now()
	p, err := startProc("nginx", bin, []string{"-c", cf, "-p", dir, "-e", "stderr"}, addr)
	if err != nil {
		return err
	}
	e.procs = append(e.procs, p)
	if err := waitServing(p, t0, 30*time.Second); err != nil {
		return err
	}
	out, _ := exec.Command(bin, "-v").CombinedOutput()
	e.nginxNote = strings.TrimSpace(string(out)) + ", `master_process off` (one process, so its CPU is one /proc entry), keepalive upstream, `proxy_buffering off`, `proxy_request_buffering off`"
	e.nginx = p
	return nil
}

func (e *procEnv) startRedis() error {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return fmt.Errorf("redis-server is not installed: %w", err)
	}
	addr, err := freeAddr()
	if err != nil {
		return err
	}
	_, port, _ := net.SplitHostPort(addr)
	p, err := startProc("redis-server", bin, []string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"}, addr)
	if err != nil {
		return err
	}
	e.procs = append(e.procs, p)
	rc := redis.NewClient(&redis.Options{Addr: addr})
	defer func() { _ = rc.Close() }()
	deadline := time.Now().Add(20 * time.Second)
	for rc.Ping(context.Background()).Err() != nil {
		if time.Now().After(deadline) {
			return fmt.Errorf("redis-server did not answer: %s", p.logs.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	e.redisProc = p
	return nil
}

// measurePing gives the median PING round trip, one client, the
// yardstick of the Redis store's goal, two ways: back to back (the figure
// a tight loop reports, with redis-server and the client always running)
// and with gap between pings, as a sidecar's calls reach Redis: between two
// calls both sides sleep, and each round trip then pays two wake-ups. On
// this kind of machine the second is 3-5 times the first, so dividing a
// sidecar's added latency by the first overstates the round trips.
func (e *procEnv) measurePing(n int, gap time.Duration) time.Duration {
	rc := redis.NewClient(&redis.Options{Addr: e.redisProc.addr})
	defer func() { _ = rc.Close() }()
	ctx := context.Background()
	var lat []time.Duration
	for range n {
		if gap > 0 {
			time.Sleep(gap)
		}
		t0 := time.Now()
		if rc.Ping(ctx).Err() == nil {
			lat = append(lat, time.Since(t0))
		}
	}
	slices.Sort(lat)
	return percentile(lat, 0.5)
}

// pingGap is the pause between the PINGs of the yardstick: about the time
// between two calls of a 1-client row.
const pingGap = time.Millisecond

// redisCommands counts the commands clients send Redis (MONITOR lines,
// less those a Lua script runs) while fn runs, and a moment after it, as
// a sidecar stores an executed call's result after answering it.
func (e *procEnv) redisCommands(fn func() error) (int, error) {
	conn, err := net.DialTimeout("tcp", e.redisProc.addr, 5*time.Second)
	if err != nil {
		return 0, err
	}
	defer func() { _ = conn.Close() }()
	if _, err := conn.Write([]byte("MONITOR\r\n")); err != nil {
		return 0, err
	}
	r := bufio.NewReader(conn)
	if line, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(line, "+OK") {
		return 0, fmt.Errorf("MONITOR: %q %w", line, err)
	}
	counted := make(chan int, 1)
	go func() {
		n := 0
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				counted <- n
				return
			}
			// +1796098798.688067 [0 127.0.0.1:51132] "evalsha" ...; a
			// script's own commands read [0 lua].
			if _, rest, ok := strings.Cut(line, "["); ok && !strings.HasPrefix(strings.TrimLeft(strings.TrimLeft(rest, "0123456789"), " "), "lua]") {
				n++
			}
		}
	}()
	ferr := fn()
	time.Sleep(300 * time.Millisecond)
	_ = conn.Close()
	n := <-counted
	return n, ferr
}

// countRedis counts the Redis commands per executed and per replayed call
// of the Redis sidecar.
func (e *procEnv) countRedis(execSc, replaySc *scenario, n int) error {
	t := &target{name: e.sideRedis.name, url: e.sideRedis.url + "/", client: newClient()}
	for i, sc := range []*scenario{execSc, replaySc} {
		_, _, _ = t.call(sc) // the replayed call's record exists
		got, err := e.redisCommands(func() error {
			for range n {
				if _, _, err := t.call(sc); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("counting Redis commands: %w", err)
		}
		e.redisPerCall[i] = float64(got) / float64(n)
	}
	return nil
}

func procSection(w *bytes.Buffer, c config) error {
	e := &procEnv{p999: map[*procRow]map[string][]float64{}}
	var err error
	if e.tmp, err = os.MkdirTemp("", "idemcp-procbench-"); err != nil {
		return err
	}
	defer e.close()
	progress("processes: building")
	if err := e.build(); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(e.tmp, "policy.yaml"), []byte(procPolicyYAML), 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(e.tmp, "policy-store-spans.yaml"), []byte(procStoreSpansYAML), 0o600); err != nil {
		return err
	}
	if e.server, err = e.start("MCP server", e.bins["httpserver"], func(a string) []string { return []string{"-listen", a} }); err != nil {
		return err
	}
	if e.plain, err = e.start("plain proxy", e.bins["plainproxy"], func(a string) []string { return []string{"-listen", a, "-upstream", e.server.url} }); err != nil {
		return err
	}
	if err := e.startNginx(); err != nil {
		return err
	}
	if err := e.startRedis(); err != nil {
		return err
	}
	if e.sideMem, err = e.sidecar("sidecar (memory)", e.server.url, "--store", "memory"); err != nil {
		return err
	}
	if e.plainLarge, err = e.start("plain proxy (1 MiB rows)", e.bins["plainproxy"], func(a string) []string { return []string{"-listen", a, "-upstream", e.server.url} }); err != nil {
		return err
	}
	if e.sideLarge, err = e.sidecar("sidecar (memory, 1 MiB rows)", e.server.url, "--store", "memory"); err != nil {
		return err
	}
	if e.sideRedis, err = e.sidecar("sidecar (redis)", e.server.url, "--store", "redis", "--redis-addr", e.redisProc.addr); err != nil {
		return err
	}
	// The same sidecar with tracing on at 100% sampling, exporting to an
	// OTLP/HTTP endpoint that takes every batch and drops it.
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	defer sink.Close()
	e.traceEnv = []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + sink.URL, "OTEL_TRACES_SAMPLER=always_on"}
	if e.sideTraced, err = e.sidecar("sidecar (redis, traced)", e.server.url, "--store", "redis", "--redis-addr", e.redisProc.addr, "--tracing"); err != nil {
		return err
	}
	if e.sideStoreSpans, err = e.sidecarWith(e.bins["proxy"], "policy-store-spans.yaml", "sidecar (redis, traced, store spans)", e.server.url, "--store", "redis", "--redis-addr", e.redisProc.addr, "--tracing"); err != nil {
		return err
	}
	e.traceEnv = []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + sink.URL, "OTEL_TRACES_SAMPLER=always_off"}
	if e.sideUnsampled, err = e.sidecar("sidecar (redis, traced, 0% sampled)", e.server.url, "--store", "redis", "--redis-addr", e.redisProc.addr, "--tracing"); err != nil {
		return err
	}
	e.traceEnv = nil
	if e.sideNoTracing, err = e.sidecarOf(e.bins["proxy-notracing"], "sidecar (redis, built without tracing)", e.server.url, "--store", "redis", "--redis-addr", e.redisProc.addr); err != nil {
		return err
	}

	exec := httpScenarios[2]
	pass := httpScenarios[1]
	replay := httpScenarios[3]
	tgt := func(p *proc) *target { return &target{name: p.name, url: p.url + "/", client: newClient()} }
	add := func(name, short string, p *proc, sc *scenario, proxy bool) *procRow {
		r := &procRow{name: name, short: short, t: tgt(p), sc: sc, st: map[string]series{}, cpu: map[string][]float64{}}
		if proxy {
			r.proxy = p
		}
		e.rows = append(e.rows, r)
		return r
	}
	add("direct", "direct", e.server, exec, false)
	add("Go httputil.ReverseProxy, tuned pool", "Go proxy", e.plain, exec, true)
	if e.nginx != nil {
		add("nginx, 1 worker, keepalive, unbuffered", "nginx", e.nginx, exec, true)
	}
	for _, s := range []struct {
		p    *proc
		name string
	}{{e.sideMem, "memory"}, {e.sideRedis, "redis"}} {
		add("idemcp passthrough, "+s.name, "pass "+s.name, s.p, pass, true)
		add("idemcp executed (new arguments each call), "+s.name, "exec "+s.name, s.p, exec, true)
		add("idemcp replayed, "+s.name, "replay "+s.name, s.p, replay, true)
	}
	add("idemcp executed (new arguments each call), redis, tracing on (100% sampled)", "exec redis traced", e.sideTraced, exec, true)
	add("idemcp executed (new arguments each call), redis, tracing on (100% sampled), with store spans", "exec redis store spans", e.sideStoreSpans, exec, true)
	add("idemcp executed (new arguments each call), redis, tracing on, 0% sampled", "exec redis unsampled", e.sideUnsampled, exec, true)
	add("idemcp executed (new arguments each call), redis, built without tracing code", "exec redis notracing", e.sideNoTracing, exec, true)
	for _, l := range []struct {
		name, short string
		p           *proc
		sc          *scenario
		proxy       bool
	}{
		{"direct, 1 MiB result", "direct 1MiB", e.server, largeExec, false},
		{"Go httputil.ReverseProxy, 1 MiB result", "Go proxy 1MiB", e.plainLarge, largeExec, true},
		{"idemcp executed, memory, 1 MiB result", "exec memory 1MiB", e.sideLarge, largeExec, true},
		{"idemcp replayed, memory, 1 MiB result", "replay memory 1MiB", e.sideLarge, largeReplay, true},
	} {
		add(l.name, l.short, l.p, l.sc, l.proxy).large = true
	}
	// Warm up every row: connections, and the replayed call's record.
	for _, r := range e.rows {
		n := c.warmup
		if r.large {
			n = max(1, c.warmup/10)
		}
		for range n {
			_, _, _ = r.t.call(r.sc)
		}
	}

	modes := []struct {
		name    string
		workers int
		n       int
	}{{"1", 1, c.seqN}, {fmt.Sprint(c.procClients), c.procClients, c.procConcN}}
	for round := range c.procMaxRounds {
		e.pingHot = append(e.pingHot, us(e.measurePing(1000, 0)))
		e.pingGapped = append(e.pingGapped, us(e.measurePing(300, pingGap)))
		for _, m := range modes {
			progress(fmt.Sprintf("processes: round %d (%d-%d), %s clients, load average %s", round+1, c.procRounds, c.procMaxRounds, m.name, loadavg()))
			order := slices.Clone(e.rows)
			k := round % len(order)
			order = append(order[k:], order[:k]...)
			for _, r := range order {
				n := m.n
				if r.large {
					if m.workers != 1 {
						continue
					}
					n = c.largeN
				}
				var before time.Duration
				if r.proxy != nil {
					before = cpuTime(r.proxy.pid())
				}
				b, failed, ferr := procBatch(r.t, r.sc, m.workers, n)
				if failed*100 > n {
					return fmt.Errorf("%s: %d of %d calls failed, first: %w", r.name, failed, n, ferr)
				}
				r.fail += failed
				st := b.stat()
				sorted := slices.Clone(b.lat)
				slices.Sort(sorted)
				if e.p999[r] == nil {
					e.p999[r] = map[string][]float64{}
				}
				e.p999[r][m.name] = append(e.p999[r][m.name], us(percentile(sorted, 0.999)))
				r.st[m.name] = append(r.st[m.name], st)
				if r.proxy != nil {
					used := cpuTime(r.proxy.pid()) - before
					r.cpu[m.name] = append(r.cpu[m.name], float64(used.Milliseconds())*1000/float64(len(b.lat)))
				}
			}
		}
		e.rounds = round + 1
		if e.rounds >= c.procRounds {
			wide := e.unsettled(c, modes[1].name)
			if len(wide) == 0 {
				e.settled = true
				break
			}
			progress(fmt.Sprintf("processes: after %d rounds, %d headline ratios reach beyond ±%.0f%% of their median, first: %s", e.rounds, len(wide), 100*c.noise, wide[0]))
		}
	}
	progress("processes: Redis commands, RSS per 1 MiB call in flight, duplicate rate, startup, sessions")
	if err := e.countRedis(exec, replay, 50); err != nil {
		return err
	}
	if err := e.measureInFlight(c.inFlight, 3); err != nil {
		return err
	}
	if err := e.duplicates(); err != nil {
		return err
	}
	if e.startup, e.proxyIdleRSS, err = e.measureStartup(e.bins["proxy"], 5); err != nil {
		return err
	}
	if e.fullStartup, e.fullIdleRSS, err = e.measureStartup(e.bins["idemcp"], 5); err != nil {
		return err
	}
	if err := e.measureSessions(c.sessions); err != nil {
		return err
	}
	chart := strings.TrimSuffix(c.out, ".md") + ".png"
	if c.out == "" {
		chart = ""
	}
	e.report(w, c, modes[1].name, chart)
	if chart != "" {
		if err := e.chart(chart, modes[1].name, c.noise); err != nil {
			return fmt.Errorf("chart: %w", err)
		}
	}
	return nil
}

// procPolicyYAML is policyYAML with room to store a 1 MiB result (its
// JSON-RPC envelope makes it larger than the default 1Mi).
const procPolicyYAML = "spec: {maxResultBytes: 4Mi, tools: [{name: refund, mode: Passthrough}]}\n"

// procStoreSpansYAML is procPolicyYAML with spec.tracing.storeSpans.
const procStoreSpansYAML = "spec: {maxResultBytes: 4Mi, tracing: {storeSpans: true}, tools: [{name: refund, mode: Passthrough}]}\n"

// largeResult is the size of the large result rows' padding: 1 MiB.
const largeResult = 1 << 20

var (
	largeExec = &scenario{name: "tools/call charge_card, unique args, 1 MiB result", method: "tools/call", tool: "charge_card", counter: "charge_card",
		args: func() string {
			return `{"amount":10,"card":"4000-` + strconv.FormatInt(uniq.Add(1), 10) + `","size":` + strconv.Itoa(largeResult) + `}`
		}}
	largeReplay = &scenario{name: "tools/call charge_card, same args, 1 MiB result", method: "tools/call", tool: "charge_card", counter: "charge_card",
		args: func() string { return `{"amount":10,"card":"4242-large","size":` + strconv.Itoa(largeResult) + `}` }, sidecarReplays: true}
)

// measureInFlight measures, reps times, a fresh sidecar's peak RSS over
// its idle RSS while k executed calls with a 1 MiB result are in flight at
// once, per call. The sidecar uses the Redis store, so stored results live
// in redis-server, not in the sidecar; it is fresh each time because the Go
// runtime keeps the heap a first batch grew. The peak is VmHWM, reset
// through /proc/PID/clear_refs after the warm-up.
func (e *procEnv) measureInFlight(k, reps int) error {
	e.inFlightK = k
	for range reps {
		side, err := e.sidecar("sidecar (in flight)", e.server.url, "--store", "redis", "--redis-addr", e.redisProc.addr)
		if err != nil {
			return err
		}
		err = func() error {
			defer side.stop()
			t := &target{name: side.name, url: side.url + "/", client: newClient()}
			for range 20 {
				if _, _, err := t.call(httpScenarios[2]); err != nil {
					return err
				}
			}
			runtimeSettle()
			base := memKB(side.pid(), "VmRSS")
			if err := os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", side.pid()), []byte("5"), 0); err != nil {
				return fmt.Errorf("resetting the sidecar's peak RSS: %w", err)
			}
			if _, failed, ferr := procBatch(t, largeExec, k, k); failed > 0 {
				return fmt.Errorf("1 MiB calls in flight: %d of %d failed: %w", failed, k, ferr)
			}
			peak := memKB(side.pid(), "VmHWM")
			e.inFlightKB = append(e.inFlightKB, (peak-base)/float64(k))
			return nil
		}()
		if err != nil {
			return err
		}
	}
	return nil
}

// runtimeSettle gives a process a moment to return what it freed (the Go
// runtime scavenges in the background).
func runtimeSettle() { time.Sleep(time.Second) }

// procBatch sends n calls from workers concurrent clients.
func procBatch(t *target, sc *scenario, workers, n int) (batch, int, error) {
	lats := make([][]time.Duration, workers)
	fails := make([]int, workers)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for w := range workers {
		k := n / workers
		if w < n%workers {
			k++
		}
		wg.Go(func() {
			<-gate
			for range k {
				d, _, err := t.call(sc)
				if err != nil {
					fails[w]++
					errs[w] = err
					continue
				}
				lats[w] = append(lats[w], d)
			}
		})
	}
	start := time.Now()
	close(gate)
	wg.Wait()
	b := batch{elapsed: time.Since(start)}
	failed := 0
	var first error
	for w := range workers {
		b.lat = append(b.lat, lats[w]...)
		failed += fails[w]
		if first == nil {
			first = errs[w]
		}
	}
	return b, failed, first
}

func (e *procEnv) count(name string) (int, error) {
	resp, err := http.Get(e.server.url + "/counts?name=" + name)
	if err != nil {
		return 0, err
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// duplicates sends 5 identical calls directly and through the sidecar,
// and counts how often the tool ran.
func (e *procEnv) duplicates() error {
	same := func(card string) *scenario {
		return &scenario{method: "tools/call", tool: "charge_card", args: func() string { return `{"amount":10,"card":"` + card + `"}` }}
	}
	for _, p := range []struct {
		name string
		pr   *proc
	}{{"direct", e.server}, {"through idemcp (memory store)", e.sideMem}, {"through idemcp (redis store)", e.sideRedis}} {
		before, err := e.count("charge_card")
		if err != nil {
			return err
		}
		t := &target{name: p.name, url: p.pr.url + "/", client: newClient()}
		sc := same("dup-" + strconv.FormatInt(time.Now().UnixNano(), 10))
		for range 5 {
			if _, _, err := t.call(sc); err != nil {
				return err
			}
		}
		after, err := e.count("charge_card")
		if err != nil {
			return err
		}
		e.dup = append(e.dup, [3]string{p.name, "5", strconv.Itoa(after - before)})
	}
	return nil
}

// waitServed polls with a deduplicated tools/call (new arguments, so it
// runs upstream) until one is answered with its result, and says how long
// that took from start: process start to the first served request.
func waitServed(p *proc, sc *scenario, start time.Time, limit time.Duration) (time.Duration, error) {
	t := &target{name: p.name, url: p.url + "/", client: &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: 5 * time.Second}}
	var last error
	for time.Since(start) < limit {
		_, r, err := t.call(sc)
		if err == nil {
			return time.Since(start), nil
		}
		if r.status != 0 {
			return 0, fmt.Errorf("%s: first call not served: %w", p.name, err)
		}
		last = err
		time.Sleep(200 * time.Microsecond)
	}
	return 0, fmt.Errorf("%s did not serve within %s: %w: %.500s", p.name, limit, last, p.logs.String())
}

// measureStartup starts a fresh sidecar from bin n times and times process
// start to its first served request (a deduplicated tools/call answered
// with the tool's result); it also gives the last one's VmRSS a second
// after that answer.
func (e *procEnv) measureStartup(bin string, n int) (starts []time.Duration, idleKB float64, err error) {
	for i := range n {
		addr, err := freeAddr()
		if err != nil {
			return nil, 0, err
		}
		t0 := time.Now()
		p, err := startProc("sidecar (startup)", bin, []string{"sidecar", "--listen", addr, "--upstream", e.server.url,
			"--policy-file", filepath.Join(e.tmp, "policy.yaml"), "--admin-listen", "", "--log-level", "error", "--store", "memory"}, addr)
		if err != nil {
			return nil, 0, err
		}
		d, err := waitServed(p, httpScenarios[2], t0, 30*time.Second)
		if err == nil && i == n-1 {
			time.Sleep(time.Second)
			idleKB = memKB(p.pid(), "VmRSS")
		}
		p.stop()
		if err != nil {
			return nil, 0, err
		}
		starts = append(starts, d)
	}
	return starts, idleKB, nil
}

// measureSessions starts a sidecar in front of a session-keeping server,
// reads its idle RSS, opens n sessions (initialize, initialized, one
// deduplicated call each) and reads its RSS with all of them open.
func (e *procEnv) measureSessions(n int) error {
	e.sessions = n
	srv, err := e.start("MCP server (sessions)", e.bins["httpserver"], func(a string) []string { return []string{"-listen", a, "-sessions"} })
	if err != nil {
		return err
	}
	side, err := e.sidecar("sidecar (sessions)", srv.url, "--store", "memory")
	if err != nil {
		return err
	}
	time.Sleep(time.Second)
	e.idleRSS = memKB(side.pid(), "VmRSS")
	e.idleAnon = memKB(side.pid(), "RssAnon")
	client := newClient()
	post := func(sid, body string) (string, error) {
		req, _ := http.NewRequest(http.MethodPost, side.url+"/", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		if sid != "" {
			req.Header.Set("Mcp-Session-Id", sid)
			req.Header.Set("Mcp-Protocol-Version", "2025-11-25")
		}
		resp, err := client.Do(req)
		if err != nil {
			return "", err
		}
		b, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode >= 300 {
			return "", fmt.Errorf("HTTP %d: %.300s", resp.StatusCode, b)
		}
		if bytes.Contains(b, []byte(`"error"`)) || bytes.Contains(b, []byte(`"isError":true`)) {
			return "", fmt.Errorf("not a result: %.300s", b)
		}
		return resp.Header.Get("Mcp-Session-Id"), nil
	}
	sem := make(chan struct{}, 64)
	var mu sync.Mutex
	var first error
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			err := func() error {
				init, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": map[string]any{
					"protocolVersion": "2025-11-25", "capabilities": map[string]any{}, "clientInfo": map[string]any{"name": "bench", "version": "1"}}})
				sid, err := post("", string(init))
				if err != nil || sid == "" {
					return fmt.Errorf("initialize: session %q: %w", sid, err)
				}
				if _, err := post(sid, `{"jsonrpc":"2.0","method":"notifications/initialized"}`); err != nil {
					return fmt.Errorf("initialized: %w", err)
				}
				_, err = post(sid, fmt.Sprintf(`{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"charge_card","arguments":{"amount":1,"card":"s-%d"}}}`, i))
				return err
			}()
			if err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if first != nil {
		return fmt.Errorf("sessions: %w", first)
	}
	e.sessRSS = memKB(side.pid(), "VmRSS")
	e.sessPeak = memKB(side.pid(), "VmHWM")
	return nil
}
