// Package pgtest runs real PostgreSQL servers (and PgBouncer in front of
// them) for tests, from Debian's postgresql and pgbouncer packages: a server
// on a free loopback port, in a temporary directory, that can be stopped
// (an immediate shutdown, as a crash) and started again with its data.
//
// PostgreSQL refuses to run as root; as root the servers run as the user
// nobody. The processes run under test/procs. When the programs are not
// installed a test is skipped, except under CI (CI=true), where a missing
// dependency fails it; under -short (make test-unit) it is skipped.
package pgtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/test/procs"
	"github.com/idemcp/idemcp/test/testdeps"
)

const startTimeout = 30 * time.Second

// Dir returns the directory holding initdb and postgres (the newest of
// /usr/lib/postgresql/*/bin, else the one on PATH), or ends the test.
func Dir(tb testing.TB) string {
	tb.Helper()
	testdeps.Real(tb, "runs PostgreSQL")
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) < version(dirs[j]) })
	for i := len(dirs) - 1; i >= 0; i-- {
		if _, err := os.Stat(filepath.Join(dirs[i], "postgres")); err == nil {
			return dirs[i]
		}
	}
	if p, err := exec.LookPath("postgres"); err == nil {
		return filepath.Dir(p)
	}
	testdeps.Missing(tb, "PostgreSQL not installed: no /usr/lib/postgresql/*/bin/postgres (apt-get install postgresql)")
	return ""
}

func version(dir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
	return n
}

// runAs returns the credentials to run servers with: none, or nobody's
// when the tests run as root.
func runAs(tb testing.TB) *syscall.Credential {
	tb.Helper()
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup("nobody")
	if err != nil {
		tb.Fatalf("running as root, PostgreSQL needs another user: %v", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
}

// env is the servers' whole environment.
var env = []string{"LC_ALL=C", "PATH=/usr/bin:/bin", "HOME=/tmp"}

func command(cred *syscall.Credential, name string, args ...string) *exec.Cmd {
	cmd := procs.Command(cred, name, args...)
	cmd.Env = env
	return cmd
}

// tempDir makes a directory the servers' user owns; it is removed when the
// test ends.
func tempDir(tb testing.TB, cred *syscall.Credential) string {
	tb.Helper()
	dir, err := os.MkdirTemp("", "idemcp-pgtest-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = os.RemoveAll(dir) })
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			tb.Fatal(err)
		}
	}
	return dir
}

var template struct {
	once sync.Once
	dir  string
	err  error
}

// initTemplate runs initdb once per test binary; every server starts from
// a copy, which takes a fraction of initdb's time.
func initTemplate(bin string, cred *syscall.Credential) (string, error) {
	template.once.Do(func() {
		dir, err := os.MkdirTemp("", "idemcp-pgtemplate-")
		if err != nil {
			template.err = err
			return
		}
		if cred != nil {
			if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
				template.err = err
				return
			}
		}
		data := filepath.Join(dir, "data")
		out, err := command(cred, filepath.Join(bin, "initdb"), "-D", data, "-U", "postgres", "-A", "trust",
			"-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions").CombinedOutput()
		if err != nil {
			template.err = fmt.Errorf("initdb: %w\n%s", err, out)
			return
		}
		template.dir = data
	})
	return template.dir, template.err
}

// Server is one PostgreSQL server on a loopback port.
type Server struct {
	// Addr is host:port, stable across Stop and Start.
	Addr string
	// URL connects as the superuser postgres to the database postgres.
	URL string

	tb   testing.TB
	bin  string
	cred *syscall.Credential
	proc *procs.Process
}

// Start runs a PostgreSQL server, stopped when the test ends.
func Start(tb testing.TB) *Server {
	tb.Helper()
	bin := Dir(tb)
	cred := runAs(tb)
	tmpl, err := initTemplate(bin, cred)
	if err != nil {
		tb.Fatalf("preparing PostgreSQL: %v", err)
	}
	dir := tempDir(tb, cred)
	data := filepath.Join(dir, "data")
	if out, err := command(cred, "cp", "-a", tmpl, data).CombinedOutput(); err != nil {
		tb.Fatalf("copying the template cluster: %v\n%s", err, out)
	}
	var lastErr error
	for range 5 {
		s := newServer(tb, bin, cred, dir, data, net.JoinHostPort("127.0.0.1", strconv.Itoa(FreePort(tb))))
		if lastErr = s.proc.Start(); lastErr == nil {
			tb.Cleanup(s.Stop)
			return s
		}
	}
	tb.Fatalf("starting PostgreSQL: %v", lastErr)
	return nil
}

// newServer is a server of data (in dir, with its log) on addr, not yet
// started.
func newServer(tb testing.TB, bin string, cred *syscall.Credential, dir, data, addr string) *Server {
	_, port, _ := net.SplitHostPort(addr)
	s := &Server{Addr: addr, tb: tb, bin: bin, cred: cred}
	s.URL = "postgres://postgres@" + s.Addr + "/postgres?sslmode=disable"
	s.proc = procs.New(procs.Spec{
		Name: "postgres", Path: filepath.Join(bin, "postgres"), Env: env, Credential: cred,
		Args: []string{"-D", data, "-p", port,
			"-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
			// fsync off risks data only if the machine crashes; a killed server
			// still recovers every committed transaction from its WAL.
			"-c", "fsync=off", "-c", "full_page_writes=off",
			"-c", "max_connections=200", "-c", "shared_buffers=32MB"},
		Log:          filepath.Join(dir, "postgres.log"),
		Ready:        func() error { return Ping(s.URL) },
		ReadyTimeout: startTimeout,
		// SIGQUIT is PostgreSQL's immediate shutdown: no checkpoint,
		// crash recovery at the next start.
		StopSignal: syscall.SIGQUIT, StopGrace: 10 * time.Second, DeathSignal: syscall.SIGQUIT,
	})
	return s
}

// FreePort returns a loopback port that was free a moment ago.
func FreePort(tb testing.TB) int {
	tb.Helper()
	return freeport.LoopbackPort(tb)
}

// Start brings a stopped server up again on the same port, with its data.
func (s *Server) Start() {
	s.tb.Helper()
	if err := s.proc.Start(); err != nil {
		s.tb.Fatalf("restarting PostgreSQL at %s: %v", s.Addr, err)
	}
}

// Stop shuts the server down immediately (SIGQUIT: no checkpoint, crash
// recovery at the next start), as a crash would: clients see their
// connections drop. Stopping a stopped server does nothing.
func (s *Server) Stop() { s.proc.Stop() }

// Ping connects to url once.
func Ping(url string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

// Exec runs sql on url on a fresh connection.
func Exec(tb testing.TB, url, sql string, args ...any) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("connecting to %s: %v", url, err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
}

// Bouncer is a PgBouncer in transaction mode in front of a Server.
type Bouncer struct {
	// URL connects through PgBouncer to the database postgres.
	URL string
}

// StartBouncer runs PgBouncer in transaction pooling mode in front of pg,
// stopped when the test ends.
func StartBouncer(tb testing.TB, pg *Server) *Bouncer {
	tb.Helper()
	testdeps.Real(tb, "runs PgBouncer")
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/pgbouncer"); serr != nil {
			testdeps.Missing(tb, "pgbouncer not installed (apt-get install pgbouncer)")
			return nil
		}
		bin = "/usr/sbin/pgbouncer"
	}
	cred := runAs(tb)
	dir := tempDir(tb, cred)
	host, pgPort, _ := net.SplitHostPort(pg.Addr)
	port := FreePort(tb)
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%s
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
max_client_conn = 500
default_pool_size = 4
ignore_startup_parameters = extra_float_digits
logfile = %s
`, host, pgPort, port, filepath.Join(dir, "users.txt"), filepath.Join(dir, "pgbouncer.log"))
	for name, body := range map[string]string{"pgbouncer.ini": ini, "users.txt": `"postgres" ""` + "\n"} {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			tb.Fatal(err)
		}
	}
	b := &Bouncer{URL: fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)}
	proc := procs.New(procs.Spec{
		Name: "pgbouncer", Path: bin, Args: []string{filepath.Join(dir, "pgbouncer.ini")}, Env: env, Credential: cred,
		Log:          filepath.Join(dir, "pgbouncer.log"),
		Ready:        func() error { return Ping(b.URL) },
		ReadyTimeout: startTimeout,
		StopSignal:   syscall.SIGINT, StopGrace: 5 * time.Second, DeathSignal: syscall.SIGQUIT,
	})
	if err := proc.Start(); err != nil {
		tb.Fatalf("starting pgbouncer: %v", err)
	}
	tb.Cleanup(proc.Stop)
	return b
}

// StartStandby runs a streaming-replication standby of primary, named name
// (its application_name, as synchronous_standby_names lists it), from a
// base backup of primary, on a free loopback port; it is stopped when the
// test ends. Promote makes it a primary.
func StartStandby(tb testing.TB, primary *Server, name string) *Server {
	tb.Helper()
	return StartStandbyAt(tb, primary, name, "")
}

// StartStandbyAt is StartStandby on addr (host:port; "": a free port), such
// as the address of a primary that failed, so that clients listing both
// addresses reach the pair again.
func StartStandbyAt(tb testing.TB, primary *Server, name, addr string) *Server {
	tb.Helper()
	dir := tempDir(tb, primary.cred)
	data := filepath.Join(dir, "data")
	host, port, _ := net.SplitHostPort(primary.Addr)
	conninfo := fmt.Sprintf("host=%s port=%s user=postgres application_name=%s", host, port, name)
	if out, err := command(primary.cred, filepath.Join(primary.bin, "pg_basebackup"), "-D", data, "-d", conninfo,
		"-X", "stream", "-c", "fast", "--no-sync", "-R").CombinedOutput(); err != nil {
		tb.Fatalf("pg_basebackup of %s: %v\n%s", primary.Addr, err, out)
	}
	// -R writes primary_conninfo; the application name must be in it for
	// the primary to count the standby as synchronous.
	conf, err := os.OpenFile(filepath.Join(data, "postgresql.auto.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		tb.Fatal(err)
	}
	_, err = fmt.Fprintf(conf, "primary_conninfo = '%s'\n", conninfo)
	if cerr := conf.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		tb.Fatal(err)
	}
	var lastErr error
	for range 5 {
		a := addr
		if a == "" {
			a = net.JoinHostPort("127.0.0.1", strconv.Itoa(FreePort(tb)))
		}
		s := newServer(tb, primary.bin, primary.cred, dir, data, a)
		if lastErr = s.proc.Start(); lastErr == nil {
			tb.Cleanup(s.Stop)
			return s
		}
	}
	tb.Fatalf("starting the standby: %v", lastErr)
	return nil
}

// Promote makes a standby a primary and waits until it takes writes.
func (s *Server) Promote() {
	s.tb.Helper()
	Exec(s.tb, s.URL, `SELECT pg_promote(true, 30)`)
}
