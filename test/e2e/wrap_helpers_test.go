package e2e_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/test/procs"
)

// The wrap tests run real processes: the idemcp binary and a stdio MCP
// server (test/mcpserver/cmd/stdioserver), built once per test run. When
// the tests run with -race the binaries are built with it too, so a race in
// the wrapper fails its exit code.
func TestMain(m *testing.M) {
	code := m.Run()
	procs.Cleanup()
	os.Exit(code)
}

type wrapBins struct {
	idemcp string
	server string // the Go SDK stdio server
}

// buildFlags are the go build flags of the binaries the tests run.
func buildFlags() []string {
	if raceEnabled {
		return []string{"-race"}
	}
	return nil
}

func buildWrapBins(t *testing.T) wrapBins {
	t.Helper()
	return wrapBins{
		idemcp: procs.Build(t, "github.com/idemcp/idemcp", buildFlags()...),
		server: procs.Build(t, "github.com/idemcp/idemcp/test/mcpserver/cmd/stdioserver", buildFlags()...),
	}
}

// lockedBuffer collects a process's stderr while it runs.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// counter reads the stdio server's COUNT_FILE: one line per execution.
type counter struct{ path string }

func newCounter(t *testing.T) counter {
	return counter{path: filepath.Join(t.TempDir(), "executions")}
}

func (c counter) env() string { return "COUNT_FILE=" + c.path }

func (c counter) get(t *testing.T, event string) int {
	t.Helper()
	b, err := os.ReadFile(c.path)
	if errors.Is(err, os.ErrNotExist) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if line == event {
			n++
		}
	}
	return n
}

// wrapCmd is `idemcp wrap FLAGS -- SERVER` with extra environment, its
// stderr collected and logged when the test ends.
func wrapCmd(t *testing.T, bins wrapBins, flags []string, env ...string) (*exec.Cmd, *lockedBuffer) {
	t.Helper()
	args := append(append([]string{"wrap", "--log-level", "debug"}, flags...), "--", bins.server)
	cmd := exec.Command(bins.idemcp, args...)
	// Race-enabled binaries sleep a second at exit unless told not to.
	cmd.Env = append(os.Environ(), "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	cmd.Env = append(cmd.Env, env...)
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	t.Cleanup(func() {
		if t.Failed() || os.Getenv("E2E_TRACE") != "" {
			t.Logf("idemcp wrap stderr:\n%s", stderr.String())
		}
	})
	return cmd, stderr
}

// wrapped is a Go SDK client session over stdio with `idemcp wrap` as the
// server process.
type wrapped struct {
	cmd    *exec.Cmd
	cs     *mcp.ClientSession
	stderr *lockedBuffer
}

func connectWrap(t *testing.T, bins wrapBins, rev revision, flags []string, env ...string) *wrapped {
	t.Helper()
	cmd, stderr := wrapCmd(t, bins, flags, env...)
	client := mcp.NewClient(&mcp.Implementation{Name: "e2e-wrap-client", Version: "1.0.0"}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cs, err := client.Connect(ctx, &mcp.CommandTransport{Command: cmd}, &mcp.ClientSessionOptions{ProtocolVersion: rev.client})
	if err != nil {
		t.Fatalf("connecting through idemcp wrap: %v\nstderr:\n%s", err, stderr.String())
	}
	w := &wrapped{cmd: cmd, cs: cs, stderr: stderr}
	t.Cleanup(func() { _ = w.cs.Close() })
	return w
}

// close ends the session as a client does (stdin closed, then signals)
// and returns the wrapper's exit code.
func (w *wrapped) close(t *testing.T) int {
	t.Helper()
	_ = w.cs.Close()
	if w.cmd.ProcessState == nil {
		t.Fatal("the wrapper's process state is unknown after the session closed")
	}
	checkNoRace(t, w.stderr)
	return exitStatus(w.cmd.ProcessState)
}

func exitStatus(ps *os.ProcessState) int {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ps.ExitCode()
}

func checkNoRace(t *testing.T, stderr *lockedBuffer) {
	t.Helper()
	if strings.Contains(stderr.String(), "WARNING: DATA RACE") {
		t.Error("the race detector found a data race in idemcp wrap (see its stderr)")
	}
}

// rawWrap is `idemcp wrap` driven line by line over pipes, for what an SDK
// client would never send.
type rawWrap struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr *lockedBuffer
	exit   chan struct{}
}

func startRawWrap(t *testing.T, bins wrapBins, flags []string, env ...string) *rawWrap {
	t.Helper()
	cmd, stderr := wrapCmd(t, bins, flags, env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r := &rawWrap{cmd: cmd, stdin: stdin, lines: make(chan string, 64), stderr: stderr, exit: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 16<<20)
		for sc.Scan() {
			r.lines <- sc.Text()
		}
		close(r.lines)
		// Wait closes stdout: only once all of it is read.
		_ = cmd.Wait()
		close(r.exit)
	}()
	t.Cleanup(func() {
		_ = stdin.Close()
		go func() {
			for range r.lines {
			}
		}()
		select {
		case <-r.exit:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-r.exit
		}
	})
	return r
}

func (r *rawWrap) send(t *testing.T, line string) {
	t.Helper()
	if _, err := io.WriteString(r.stdin, line+"\n"); err != nil {
		t.Fatalf("writing to idemcp wrap: %v", err)
	}
}

// next returns the next line the wrapper wrote to stdout.
func (r *rawWrap) next(t *testing.T) string {
	t.Helper()
	select {
	case l, ok := <-r.lines:
		if !ok {
			t.Fatalf("idemcp wrap closed its stdout; stderr:\n%s", r.stderr.String())
		}
		return l
	case <-time.After(20 * time.Second):
		t.Fatalf("no line from idemcp wrap in 20s; stderr:\n%s", r.stderr.String())
	}
	return ""
}

// wait returns the wrapper's exit code once it has exited.
func (r *rawWrap) wait(t *testing.T) int {
	t.Helper()
	go func() {
		for range r.lines {
		}
	}()
	select {
	case <-r.exit:
	case <-time.After(20 * time.Second):
		t.Fatalf("idemcp wrap did not exit in 20s; stderr:\n%s", r.stderr.String())
	}
	checkNoRace(t, r.stderr)
	return exitStatus(r.cmd.ProcessState)
}
