package sidecar

import (
	"bufio"
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// runSidecarEnv makes the test binary run `idemcp sidecar` with its
// arguments instead of the tests: a real sidecar process, whose open
// files and connections a test can count apart from its own.
const runSidecarEnv = "IDEMCP_TEST_RUN_SIDECAR"

func TestMain(m *testing.M) {
	if os.Getenv(runSidecarEnv) == "1" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		err := Main(ctx, os.Args[1:])
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type sidecarProcess struct {
	pid          int
	proxy, admin string
}

// startSidecarProcess runs a sidecar in front of upstream, with the memory
// store, on loopback ports of its choosing.
func startSidecarProcess(t *testing.T, upstream string, args ...string) *sidecarProcess {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
		"--upstream", upstream, "--store", "memory", "--shutdown-timeout", "3s"}, args...)...)
	cmd.Env = append(os.Environ(), runSidecarEnv+"=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	})
	addrs := make(chan [2]string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var line struct{ Msg, Listen, Admin string }
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "Sidecar listening" {
				addrs <- [2]string{line.Listen, line.Admin}
			}
		}
	}()
	select {
	case a := <-addrs:
		return &sidecarProcess{pid: cmd.Process.Pid, proxy: a[0], admin: a[1]}
	case <-time.After(30 * time.Second):
		t.Fatal("the sidecar did not start listening within 30s")
		return nil
	}
}

// openFiles counts the sidecar's open file descriptors.
func (p *sidecarProcess) openFiles(t *testing.T) int {
	t.Helper()
	fds, err := os.ReadDir("/proc/" + strconv.Itoa(p.pid) + "/fd")
	if err != nil {
		t.Fatalf("counting the sidecar's open files: %v", err)
	}
	return len(fds)
}

func (p *sidecarProcess) rssMiB(t *testing.T) int {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(p.pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`VmRSS:\s+(\d+) kB`).FindSubmatch(b)
	if m == nil {
		return 0
	}
	kb, _ := strconv.Atoi(string(m[1]))
	return kb >> 10
}

// flood holds connections open against addr, in turn idle (connected,
// not a byte sent), slowloris (a request's headers, one more byte every
// half second, never finished) and, with keepAlive, idle after one
// request (an unread answer, then nothing).
type flood struct {
	conns []net.Conn
	slow  []net.Conn
	stop  chan struct{}
	done  chan struct{}
}

func startFlood(t *testing.T, addr string, n int, keepAlive bool) *flood {
	t.Helper()
	f := &flood{conns: make([]net.Conn, n), stop: make(chan struct{}), done: make(chan struct{})}
	var wg sync.WaitGroup
	errs := make(chan error, n)
	next := make(chan int)
	for range 64 {
		wg.Go(func() {
			d := net.Dialer{Timeout: 10 * time.Second}
			for i := range next {
				c, err := d.Dial("tcp", addr)
				if err != nil {
					errs <- err
					continue
				}
				switch {
				case i%3 == 1:
					_, _ = io.WriteString(c, "POST /mcp HTTP/1.1\r\nHost: x\r\nX-Slow: ")
				case i%3 == 2 && keepAlive:
					_, _ = io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
				}
				f.conns[i] = c
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("opening %d connections to %s: %v", n, addr, err)
	}
	for i, c := range f.conns {
		if i%3 == 1 {
			f.slow = append(f.slow, c)
		}
	}
	go func() {
		defer close(f.done)
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-f.stop:
				return
			case <-tick.C:
			}
			for _, c := range f.slow {
				_ = c.SetWriteDeadline(time.Now().Add(10 * time.Millisecond))
				_, _ = c.Write([]byte("a"))
			}
		}
	}()
	t.Cleanup(func() {
		close(f.stop)
		<-f.done
		for _, c := range f.conns {
			_ = c.Close()
		}
	})
	return f
}

// stillOpen counts the connections the server has not closed: a read that
// times out finds one open, anything else (the end, a reset) closed.
func (f *flood) stillOpen() int {
	open := 0
	buf := make([]byte, 4096)
	for _, c := range f.conns {
		for {
			_ = c.SetReadDeadline(time.Now().Add(time.Millisecond))
			_, err := c.Read(buf)
			if err == nil {
				continue // an answer such as 503 or 408: the end follows
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				open++
			}
			break
		}
	}
	return open
}

// otherClient is a client from another address (127.0.0.2) than the flood.
var otherClient = &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
	DialContext:       (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}).DialContext,
	DisableKeepAlives: true,
}}

// TestHostileConnections: thousands of idle and slow connections against
// both ports of a real sidecar process. The admin port holds at most 16 of
// them (one client address) and turns the rest away at once; the proxy
// port holds them until their headers are overdue. Meanwhile another
// client gets its probes, metrics and tool calls answered, and the
// sidecar's open files stay bounded; then every idle and slow connection
// is closed by the sidecar and its open files are back where they were.
// Before the bounds the admin port held every connection, and those idle
// after a request forever (no idle timeout).
// TestHostileConnections floods a sidecar in front of a server in its pod,
// and one in front of a remote HTTPS server (an IdempotentProxy's data
// plane), whose upstream connections are TLS.
func TestHostileConnections(t *testing.T) {
	for _, remote := range []bool{false, true} {
		name := "pod server"
		if remote {
			name = "remote HTTPS server"
		}
		t.Run(name, func(t *testing.T) { hostileConnections(t, remote) })
	}
}

func hostileConnections(t *testing.T, remote bool) {
	if _, err := os.Stat("/proc/self/fd"); err != nil {
		t.Fatal("needs /proc to count the sidecar's open files")
	}
	const n = 3000
	if limit := openFileLimit(); limit > 0 && limit < 2*n+1024 {
		t.Fatalf("the open-file limit is %d; the flood needs %d connections: raise it (ulimit -Hn)", limit, 2*n)
	}
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"ran"}]}}`)
	}))
	var args []string
	if remote {
		up.StartTLS()
		ca := filepath.Join(t.TempDir(), "ca.crt")
		if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: up.Certificate().Raw}), 0o600); err != nil {
			t.Fatal(err)
		}
		args = []string{"--upstream-ca-file", ca, "--upstream-host-header", "upstream"}
	} else {
		up.Start()
	}
	t.Cleanup(up.Close)
	p := startSidecarProcess(t, up.URL, args...)
	if resp, err := otherClient.Get("http://" + p.admin + "/healthz"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("/healthz before the flood: %v", err)
	}
	base := p.openFiles(t)
	baseRSS := p.rssMiB(t)

	start := time.Now()
	admin := startFlood(t, p.admin, n, true)
	proxy := startFlood(t, p.proxy, n, false)
	t.Logf("%d connections opened to each port in %v", n, time.Since(start).Round(time.Millisecond))

	// Another client is served on both ports while the flood holds.
	resp, err := otherClient.Get("http://" + p.admin + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("/healthz from another client during the flood: %v %v", resp, err)
	}
	_ = resp.Body.Close()
	resp, err = otherClient.Get("http://" + p.admin + "/metrics")
	if err != nil {
		t.Fatalf("/metrics during the flood: %v", err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	m := regexp.MustCompile(`idemcp_connections_refused_total\{bound="per_client",listener="admin"\} (\d+)`).FindSubmatch(metrics)
	if m == nil {
		t.Errorf("/metrics has no idemcp_connections_refused_total for the admin port")
	} else if refused, _ := strconv.Atoi(string(m[1])); refused < n/2 {
		t.Errorf("the admin port refused %d of %d connections from one address, want most of them", refused, n)
	}
	req, _ := http.NewRequest(http.MethodPost, "http://"+p.proxy+"/mcp",
		strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"ping","arguments":{}}}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	resp, err = otherClient.Do(req)
	if err != nil {
		t.Fatalf("a tool call from another client during the flood: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"ran"`) {
		t.Fatalf("a tool call from another client during the flood: %d %s", resp.StatusCode, body)
	}

	peak := p.openFiles(t)
	t.Logf("open files: %d before, %d during the flood; RSS %d MiB before, %d MiB during", base, peak, baseRSS, p.rssMiB(t))
	if bound := base + n + adminMaxConnsPerClient + 64; peak > bound {
		t.Errorf("the sidecar holds %d open files during the flood, want at most %d (%d proxy connections, %d admin ones from one address)",
			peak, bound, n, adminMaxConnsPerClient)
	}

	// Every idle and slow connection is closed by the sidecar once its
	// headers are overdue (5s admin, 10s proxy) or, after a request, once
	// it idled for 10s (admin).
	deadline := time.Now().Add(40 * time.Second)
	for {
		a, pr := admin.stillOpen(), proxy.stillOpen()
		if a == 0 && pr == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v the sidecar still holds %d idle or slow admin connections and %d proxy ones", time.Since(start).Round(time.Second), a, pr)
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("all idle and slow connections closed by the sidecar %v after the flood began", time.Since(start).Round(100*time.Millisecond))
	for {
		after := p.openFiles(t)
		if after <= base+16 {
			t.Logf("open files: %d after the flood; RSS %d MiB", after, p.rssMiB(t))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sidecar holds %d open files after the flood, %d before", after, base)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if resp, err := otherClient.Get("http://" + p.admin + "/readyz"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("/readyz after the flood: %v", err)
	}
}
