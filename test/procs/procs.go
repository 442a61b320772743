// Package procs runs the idemcp binary as real processes for tests that
// need them (chaos, load, soak): one build per test binary, and sidecars
// that can be SIGKILLed and started again on the same addresses, whose
// metrics and memory the tests read.
package procs

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/freeport"
)

var build struct {
	once sync.Once
	dir  string
	bin  string
	err  error
}

// Binary builds the idemcp binary once per test binary and returns its
// path. Call Cleanup from TestMain to remove it.
func Binary(tb testing.TB) string {
	tb.Helper()
	build.once.Do(func() {
		goBin, err := exec.LookPath("go")
		if err != nil {
			build.err = err
			return
		}
		if build.dir, err = os.MkdirTemp("", "idemcp-procs-bin-"); err != nil {
			build.err = err
			return
		}
		build.bin = filepath.Join(build.dir, "idemcp")
		out, err := exec.Command(goBin, "build", "-o", build.bin, "github.com/idemcp/idemcp").CombinedOutput()
		if err != nil {
			build.err = errors.Join(err, errors.New(string(out)))
		}
	})
	if build.err != nil {
		tb.Fatalf("building idemcp: %v", build.err)
	}
	return build.bin
}

// Cleanup removes the binary Binary built.
func Cleanup() {
	if build.dir != "" {
		_ = os.RemoveAll(build.dir)
	}
}

// Sidecar is one `idemcp sidecar` process that can be SIGKILLed and
// started again on the same addresses.
type Sidecar struct {
	// Addr is the proxy's listen address, Admin the admin listener's
	// (/metrics).
	Addr  string
	Admin string

	tb     testing.TB
	bin    string
	args   []string
	env    []string
	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
	stderr *os.File
}

// StartSidecar runs `idemcp sidecar` with args after the listen flags it
// sets itself, and the extra environment env; it is killed when the test
// ends.
func StartSidecar(tb testing.TB, bin string, env []string, args ...string) *Sidecar {
	tb.Helper()
	p := &Sidecar{tb: tb, bin: bin, env: env, Addr: FreeAddr(tb), Admin: FreeAddr(tb)}
	p.args = append([]string{"sidecar", "--listen", p.Addr, "--admin-listen", p.Admin, "--log-level", "error"}, args...)
	f, err := os.Create(filepath.Join(tb.TempDir(), "sidecar.log"))
	if err != nil {
		tb.Fatal(err)
	}
	p.stderr = f
	p.Start()
	tb.Cleanup(p.Kill)
	return p
}

// Log is the path of the file the process writes its stderr to.
func (p *Sidecar) Log() string { return p.stderr.Name() }

// Start runs the process and waits until it accepts connections.
func (p *Sidecar) Start() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		return
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Env = append(os.Environ(), p.env...)
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		p.tb.Errorf("starting the sidecar: %v", err)
		return
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("tcp", p.Addr)
		if err == nil {
			_ = c.Close()
			break
		}
		select {
		case <-exited:
			p.tb.Errorf("the sidecar exited at start; see %s", p.stderr.Name())
			return
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.tb.Errorf("the sidecar did not listen on %s within 10s", p.Addr)
			return
		}
	}
	p.cmd, p.exited = cmd, exited
}

// Kill ends the process with SIGKILL, as an OOM kill or a lost node would.
func (p *Sidecar) Kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
	p.cmd, p.exited = nil, nil
}

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
	p.mu.Lock()
	cmd := p.cmd
	p.mu.Unlock()
	if cmd == nil {
		return 0, errors.New("the sidecar is not running")
	}
	return RSS(cmd.Process.Pid)
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
