// Package procs supervises the real processes the tests run, one way for
// all of them: redis-server (through redistest), PostgreSQL and PgBouncer
// (through pgtest), the idemcp binary and MCP servers. A Process dies with
// the test binary, is started and waited for until it serves, stopped as a
// crash would stop it, and started again with the same arguments. Build
// builds a main package once per test binary; Sidecar is an `idemcp
// sidecar` process whose metrics and memory the tests read.
//
// Under go test -short (make test-unit) a test that builds a binary is
// skipped; make test runs it.
package procs

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/test/testdeps"
)

var builds struct {
	mu   sync.Mutex
	dir  string
	bins map[string]*built
}

type built struct {
	once sync.Once
	path string
	err  error
}

// Binary builds the idemcp binary once per test binary and returns its
// path. Call Cleanup from TestMain to remove it.
func Binary(tb testing.TB) string {
	tb.Helper()
	return Build(tb, "github.com/idemcp/idemcp")
}

// Build builds the main package pkg once per test binary, with the extra
// go build flags, and returns its path; the same pkg and flags share one
// build. Call Cleanup from TestMain to remove what it built.
func Build(tb testing.TB, pkg string, flags ...string) string {
	tb.Helper()
	testdeps.Real(tb, "builds and runs "+path.Base(pkg))
	key := strings.Join(append([]string{pkg}, flags...), " ")
	builds.mu.Lock()
	if builds.bins == nil {
		builds.bins = map[string]*built{}
	}
	b := builds.bins[key]
	if b == nil {
		b = &built{}
		builds.bins[key] = b
	}
	builds.mu.Unlock()
	b.once.Do(func() {
		goBin, err := exec.LookPath("go")
		if err != nil {
			b.err = err
			return
		}
		builds.mu.Lock()
		if builds.dir == "" {
			builds.dir, err = os.MkdirTemp("", "idemcp-procs-bin-")
		}
		dir := builds.dir
		builds.mu.Unlock()
		if err != nil {
			b.err = err
			return
		}
		// One directory a build keeps the program's own name.
		sub, err := os.MkdirTemp(dir, "build-")
		if err != nil {
			b.err = err
			return
		}
		b.path = filepath.Join(sub, path.Base(pkg))
		args := append(append([]string{"build", "-o", b.path}, flags...), pkg)
		if out, err := exec.Command(goBin, args...).CombinedOutput(); err != nil {
			b.err = errors.Join(err, errors.New(string(out)))
		}
	})
	if b.err != nil {
		tb.Fatalf("building %s: %v", pkg, b.err)
	}
	return b.path
}

// Cleanup removes the binaries Build built.
func Cleanup() {
	builds.mu.Lock()
	defer builds.mu.Unlock()
	if builds.dir != "" {
		_ = os.RemoveAll(builds.dir)
	}
}

// Listening is a Ready check: addr accepts TCP connections.
func Listening(addr string) func() error {
	return func() error {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			_ = c.Close()
		}
		return err
	}
}

// Sidecar is one `idemcp sidecar` process that can be SIGKILLed and
// started again on the same addresses.
type Sidecar struct {
	// Addr is the proxy's listen address, Admin the admin listener's
	// (/metrics).
	Addr  string
	Admin string

	tb   testing.TB
	log  string
	proc *Process
}

// StartSidecar runs `idemcp sidecar` with args after the listen flags it
// sets itself, and the extra environment env; it is killed when the test
// ends.
func StartSidecar(tb testing.TB, bin string, env []string, args ...string) *Sidecar {
	tb.Helper()
	p := &Sidecar{tb: tb, Addr: FreeAddr(tb), Admin: FreeAddr(tb), log: filepath.Join(tb.TempDir(), "sidecar.log")}
	p.proc = New(Spec{
		Name:  "the sidecar",
		Path:  bin,
		Args:  append([]string{"sidecar", "--listen", p.Addr, "--admin-listen", p.Admin, "--log-level", "error"}, args...),
		Env:   append(os.Environ(), env...),
		Log:   p.log,
		Ready: Listening(p.Addr),
	})
	p.Start()
	tb.Cleanup(p.Kill)
	return p
}

// Log is the path of the file the process writes its stderr to.
func (p *Sidecar) Log() string { return p.log }

// Start runs the process and waits until it accepts connections.
func (p *Sidecar) Start() {
	if err := p.proc.Start(); err != nil {
		p.tb.Errorf("starting the sidecar on %s: %v (its log: %s)", p.Addr, err, p.log)
	}
}

// Kill ends the process with SIGKILL, as an OOM kill or a lost node would.
func (p *Sidecar) Kill() { p.proc.Kill() }

// metricsClient keeps no connections, so none outlives a reading.
var metricsClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}

// Metric reads one unlabelled sample from the sidecar's /metrics.
func (p *Sidecar) Metric(name string) (float64, error) {
	resp, err := metricsClient.Get("http://" + p.Admin + "/metrics")
	if err != nil {
		return 0, err
	}
	defer func() { _ = resp.Body.Close() }()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, name+" "); ok {
			return strconv.ParseFloat(strings.TrimSpace(rest), 64)
		}
	}
	return 0, fmt.Errorf("no %s in /metrics of %s", name, p.Admin)
}

// RSS is the process's resident set in bytes, from /proc (Linux).
func (p *Sidecar) RSS() (float64, error) {
	pid := p.proc.PID()
	if pid == 0 {
		return 0, errors.New("the sidecar is not running")
	}
	return RSS(pid)
}

// RSS reads VmRSS of process pid from /proc, in bytes.
func RSS(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 64)
			return kb * 1024, err
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

// FreeAddr returns a loopback host:port that was free a moment ago.
func FreeAddr(tb testing.TB) string {
	tb.Helper()
	return freeport.Loopback(tb)
}
