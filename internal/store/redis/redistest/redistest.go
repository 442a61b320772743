// Package redistest runs real redis-server processes for tests: a
// standalone server that can be stopped and started again on the same
// port, a primary with replicas, a Redis Cluster, and Sentinels.
//
// The processes run under test/procs. When redis-server is not installed
// a test is skipped, except under CI (CI=true), where a missing dependency
// fails it; under -short (make test-unit) it is skipped.
package redistest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/test/poll"
	"github.com/idemcp/idemcp/test/procs"
	"github.com/idemcp/idemcp/test/testdeps"
)

// startTimeout bounds how long a server may take to answer PING.
const startTimeout = 10 * time.Second

// Binary returns the path of a Redis program (redis-server, redis-cli), or
// ends the test: Skip on a developer's machine, Fatal under CI.
func Binary(tb testing.TB, name string) string {
	tb.Helper()
	testdeps.Real(tb, "runs "+name)
	path, err := exec.LookPath(name)
	if err == nil {
		return path
	}
	testdeps.Missing(tb, fmt.Sprintf("%s not installed: %v (apt-get install redis-server redis-tools)", name, err))
	return ""
}

// Server is one redis-server process on a loopback port. Stop and Start
// bring the same server down and up again at the same Addr; it comes back
// empty (nothing is persisted), as a Redis without persistence does after
// a crash.
type Server struct {
	// Addr is host:port, stable across Stop and Start.
	Addr string

	tb   testing.TB
	proc *procs.Process
}

// Start runs a standalone redis-server; extra arguments are passed to it
// (e.g. "--maxmemory-policy", "noeviction"). It is stopped when the test
// ends.
func Start(tb testing.TB, extra ...string) *Server {
	tb.Helper()
	return launch(tb, "redis", func(dir string) []string {
		return append(confArgs(tb, dir, ""), extra...)
	})
}

// StartReplica runs a redis-server that replicates primary, with extra
// arguments as Start, and waits until its first sync is done. Its
// replicaof is in its configuration file, which Sentinel rewrites when it
// promotes or repoints it, so a restarted server keeps its role.
func StartReplica(tb testing.TB, primary *Server, extra ...string) *Server {
	tb.Helper()
	host, port, err := net.SplitHostPort(primary.Addr)
	if err != nil {
		tb.Fatalf("primary address %q: %v", primary.Addr, err)
	}
	r := launch(tb, "replica", func(dir string) []string {
		return append(confArgs(tb, dir, fmt.Sprintf("replicaof %s %s\n", host, port)), extra...)
	})
	_, rport, _ := net.SplitHostPort(r.Addr)
	poll.Within(tb, startTimeout, fmt.Sprintf("replica %s to sync with %s", r.Addr, primary.Addr), func() error {
		info, err := Do(r.Addr, "INFO", "replication")
		if err == nil && !strings.Contains(info, "master_link_status:up") {
			err = fmt.Errorf("not synced:\n%s", info)
		}
		if err != nil {
			return err
		}
		// The replica's side is up before the primary counts it: WAIT
		// counts only replicas the primary has online.
		info, err = Do(primary.Addr, "INFO", "replication")
		if err == nil && !strings.Contains(info, "port="+rport+",state=online") {
			err = fmt.Errorf("the primary does not have it online:\n%s", info)
		}
		return err
	})
	return r
}

// confArgs writes a configuration file holding conf (which CONFIG REWRITE
// may rewrite) and returns the arguments that start a server with it.
func confArgs(tb testing.TB, dir, conf string) []string {
	path := filepath.Join(dir, "redis.conf")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		tb.Fatalf("writing %s: %v", path, err)
	}
	return append([]string{path}, baseArgs(tb, dir)...)
}

func baseArgs(tb testing.TB, dir string) []string {
	return []string{
		"--port", strconv.Itoa(freePort(tb)),
		"--bind", "127.0.0.1",
		"--save", "",
		"--appendonly", "no",
		// A replica's full sync starts at once, not after Redis's default
		// 5s wait for more replicas to share it.
		"--repl-diskless-sync-delay", "0",
		"--daemonize", "no",
		"--dir", dir,
		"--logfile", filepath.Join(dir, "redis.log"),
	}
}

// launch starts a server whose arguments args makes, retrying with fresh
// ports when one was taken between choosing and binding it.
func launch(tb testing.TB, name string, args func(dir string) []string) *Server {
	tb.Helper()
	bin := Binary(tb, "redis-server")
	var lastErr error
	for range 5 {
		dir := tb.TempDir()
		argv := args(dir)
		s := &Server{tb: tb, Addr: "127.0.0.1:" + argValue(argv, "--port")}
		s.proc = procs.New(procs.Spec{
			Name: "redis-server", Path: bin, Args: argv, Log: filepath.Join(dir, "redis.log"),
			Ready:        func() error { _, err := Do(s.Addr, "PING"); return err },
			ReadyTimeout: startTimeout,
		})
		if err := s.proc.Start(); err != nil {
			lastErr = err
			continue
		}
		tb.Cleanup(s.Stop)
		return s
	}
	tb.Fatalf("starting %s: %v", name, lastErr)
	return nil
}

func argValue(args []string, name string) string {
	for i, a := range args {
		if a == name && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

// freePort returns a loopback port that was free a moment ago.
func freePort(tb testing.TB) int {
	tb.Helper()
	return freeport.LoopbackPort(tb)
}

// Start brings a stopped server up again on the same port.
func (s *Server) Start() {
	s.tb.Helper()
	if err := s.proc.Start(); err != nil {
		s.tb.Fatalf("restarting redis at %s: %v", s.Addr, err)
	}
}

// Stop kills the server, as a crash or a lost node would: clients see
// their connections drop. Stopping a stopped server does nothing.
func (s *Server) Stop() { s.proc.Kill() }

// PID is the process id while the server runs, else 0.
func (s *Server) PID() int { return s.proc.PID() }

// Pause stops the server with SIGSTOP, as a stalled VM or a long fork
// would: connections stay open and nothing answers. Resume continues it.
func (s *Server) Pause() {
	s.tb.Helper()
	if err := s.proc.Signal(syscall.SIGSTOP); err != nil {
		s.tb.Errorf("pausing redis at %s: %v", s.Addr, err)
	}
}

// Resume continues a paused server.
func (s *Server) Resume() {
	s.tb.Helper()
	if err := s.proc.Signal(syscall.SIGCONT); err != nil {
		s.tb.Errorf("resuming redis at %s: %v", s.Addr, err)
	}
}

// Cluster is a Redis Cluster of masters without replicas.
type Cluster struct {
	// Addrs of every node; any of them is a seed for a cluster client.
	Addrs []string
	Nodes []*Server
}

// StartCluster runs a Redis Cluster of n masters (at least 3, as
// redis-cli --cluster create requires) and waits until every node serves
// all slots. It is stopped when the test ends.
func StartCluster(tb testing.TB, n int) *Cluster {
	tb.Helper()
	if n < 3 {
		tb.Fatalf("a Redis Cluster needs at least 3 masters, not %d", n)
	}
	cli := Binary(tb, "redis-cli")
	c := &Cluster{}
	for range n {
		node := launch(tb, "cluster node", func(dir string) []string {
			return append(baseArgs(tb, dir),
				"--cluster-enabled", "yes",
				"--cluster-config-file", filepath.Join(dir, "nodes.conf"),
				// An explicit bus port: port+10000 may be taken or out of range.
				"--cluster-port", strconv.Itoa(freePort(tb)),
				"--cluster-node-timeout", "2000",
			)
		})
		c.Nodes = append(c.Nodes, node)
		c.Addrs = append(c.Addrs, node.Addr)
	}
	args := append([]string{"--cluster", "create"}, c.Addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		tb.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	// create returns once the nodes agree on the slots; gossip may still
	// be marking the cluster up on some of them.
	for _, addr := range c.Addrs {
		poll.Within(tb, startTimeout, "cluster node "+addr+" to be ready", func() error {
			info, err := Do(addr, "CLUSTER", "INFO")
			ready := strings.Contains(info, "cluster_state:ok") && strings.Contains(info, "cluster_known_nodes:"+strconv.Itoa(n)+"\r")
			if err == nil && !ready {
				err = fmt.Errorf("not ready:\n%s", info)
			}
			return err
		})
	}
	return c
}

// StartSentinel runs a Sentinel that monitors master under the given name;
// its Addr is what a Sentinel client is given. It is stopped when the test
// ends.
func StartSentinel(tb testing.TB, master *Server, name string) *Server {
	tb.Helper()
	return StartSentinelWith(tb, master, name, time.Second)
}

// StartSentinelWith is StartSentinel with the time after which Sentinel
// holds an unanswering master down and fails it over
// (down-after-milliseconds; Sentinel's own default is 30s).
func StartSentinelWith(tb testing.TB, master *Server, name string, downAfter time.Duration) *Server {
	tb.Helper()
	host, port, err := net.SplitHostPort(master.Addr)
	if err != nil {
		tb.Fatalf("master address %q: %v", master.Addr, err)
	}
	return launch(tb, "sentinel", func(dir string) []string {
		// Sentinel rewrites its configuration file, so it gets its own.
		conf := filepath.Join(dir, "sentinel.conf")
		body := fmt.Sprintf("sentinel monitor %s %s %s 1\nsentinel down-after-milliseconds %s %d\nsentinel failover-timeout %s %d\n",
			name, host, port, name, downAfter.Milliseconds(), name, max(3*downAfter, 3*time.Second).Milliseconds())
		if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
			tb.Fatalf("writing %s: %v", conf, err)
		}
		return append([]string{conf, "--sentinel"}, baseArgs(tb, dir)...)
	})
}

// Do sends one command to addr on a fresh connection and returns the
// reply as text (a bulk string, a status or an integer; the elements of an
// array of those, one per line). It needs no
// client library, so the helpers work before any client is set up.
func Do(addr string, args ...string) (string, error) {
	conn, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return "", err
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := conn.Write([]byte(b.String())); err != nil {
		return "", err
	}
	return readReply(bufio.NewReader(conn))
}

func readReply(r *bufio.Reader) (string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimSuffix(line, "\r\n")
	if line == "" {
		return "", errors.New("empty reply")
	}
	switch line[0] {
	case '+', ':':
		return line[1:], nil
	case '-':
		return "", errors.New(line[1:])
	case '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < 0 {
			return "", fmt.Errorf("bulk reply %q", line)
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	case '*':
		n, err := strconv.Atoi(line[1:])
		if err != nil {
			return "", fmt.Errorf("array reply %q", line)
		}
		elems := make([]string, 0, max(n, 0))
		for range n {
			e, err := readReply(r)
			if err != nil {
				return "", err
			}
			elems = append(elems, e)
		}
		return strings.Join(elems, "\n"), nil
	}
	return "", fmt.Errorf("unsupported reply %q", line)
}
