package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/cli"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// These tests run the real command line: the test binary re-runs itself as
// idemcp (main, with the arguments given), so what they check is what a
// user typing the command sees.
const runMainEnv = "IDEMCP_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// idemcp runs the CLI with args and env added to a clean environment.
func idemcp(t *testing.T, env []string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], args...)
	cmd.Env = append([]string{runMainEnv + "=1", "PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}, env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return out.String(), errb.String(), ee.ExitCode()
	} else if err != nil {
		t.Fatalf("running idemcp %v: %v", args, err)
	}
	return out.String(), errb.String(), 0
}

func TestBadFlagIsOneLine(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"sidecar", "--lisen", ":1"}, "idemcp sidecar: unknown flag --lisen; did you mean --listen? run idemcp sidecar --help for the flags\n"},
		{[]string{"wrap", "--shutdown-timeout", "5", "--", "true"}, "idemcp wrap: --shutdown-timeout: \"5\" is not a duration, e.g. 30s; run idemcp wrap --help for the flags\n"},
		{[]string{"manager", "--sidecar-port=0"}, "idemcp manager: --sidecar-port: \"0\" is not a port from 1 to 65535; run idemcp manager --help for the flags\n"},
		{[]string{"sidecar", "--store"}, "idemcp sidecar: --store needs a value; run idemcp sidecar --help for the flags\n"},
		{[]string{"frobnicate"}, "idemcp: unknown command \"frobnicate\"; run idemcp --help for the commands\n"},
	} {
		stdout, stderr, code := idemcp(t, nil, tc.args...)
		if stderr != tc.want || stdout != "" || code == 0 {
			t.Errorf("idemcp %s: exit %d, stdout %q, stderr %q; want a failure with only %q", strings.Join(tc.args, " "), code, stdout, stderr, tc.want)
		}
	}
}

func TestBadEnvironmentNamesTheVariable(t *testing.T) {
	for _, tc := range []struct {
		env  string
		cmd  []string
		want string
	}{
		{"IDEMCP_SHUTDOWN_TIMEOUT=5", []string{"sidecar"}, `IDEMCP_SHUTDOWN_TIMEOUT: "5" is not a duration, e.g. 30s`},
		{"IDEMCP_REDIS_TLS=yes", []string{"sidecar"}, `IDEMCP_REDIS_TLS: "yes" is not a boolean; use true or false (or 1, 0, t, f)`},
		{"IDEMCP_STORE=bogus", []string{"wrap", "--", "true"}, `IDEMCP_STORE: "bogus" is not one of memory, redis, postgres`},
		{"IDEMCP_MAX_LINE_BYTES=4MiB", []string{"wrap", "--", "true"}, `IDEMCP_MAX_LINE_BYTES: "4MiB" is not a whole number`},
		{"IDEMCP_LOG_LEVEL=loud", []string{"sidecar"}, `IDEMCP_LOG_LEVEL: "loud" is not one of debug, info, warn, error`},
	} {
		_, stderr, code := idemcp(t, []string{tc.env}, tc.cmd...)
		if code == 0 || stderr != "idemcp "+tc.cmd[0]+": "+tc.want+"\n" {
			t.Errorf("%s idemcp %s: exit %d, stderr %q; want %q", tc.env, tc.cmd[0], code, stderr, tc.want)
		}
	}
	// The command line wins over the environment, and a good variable is used.
	_, stderr, _ := idemcp(t, []string{"IDEMCP_SHUTDOWN_TIMEOUT=5", "IDEMCP_UPSTREAM=ftp://x"}, "sidecar", "--shutdown-timeout=1s")
	if !strings.Contains(stderr, `IDEMCP_UPSTREAM (--upstream): "ftp://x" is not an http:// or https:// URL`) {
		t.Errorf("stderr %q; want IDEMCP_UPSTREAM read and the bad IDEMCP_SHUTDOWN_TIMEOUT overridden by the flag", stderr)
	}
}

func TestHelpIsOnlyForHelp(t *testing.T) {
	stdout, stderr, code := idemcp(t, nil, "sidecar", "--help")
	if code != 0 || stderr != "" || !strings.Contains(stdout, "--upstream string") || !strings.Contains(stdout, "env IDEMCP_UPSTREAM") {
		t.Errorf("idemcp sidecar --help: exit %d, stderr %q, stdout:\n%s", code, stderr, stdout)
	}
}

// TestStartupTellsTheStore: the sidecar's startup log names the store it
// really uses (flags over the policy) with its address and the admin
// address, and warns when Redis refuses the password.
func TestStartupTellsTheStore(t *testing.T) {
	srv := redistest.Start(t)
	// A password set once the server runs: the helper's readiness PING
	// has none.
	if _, err := redistest.Do(srv.Addr, "CONFIG", "SET", "requirepass", "s3cret"); err != nil {
		t.Fatal(err)
	}
	for pw, want := range map[string]string{
		"":       `"msg":"Store refuses the password","store":"Redis","storeAddress":"` + srv.Addr + `","cause":"NOAUTH Authentication required."`,
		"wrong":  `"msg":"Store refuses the password","store":"Redis","storeAddress":"` + srv.Addr + `","cause":"WRONGPASS`,
		"s3cret": `"msg":"Store reachable","store":"Redis","storeAddress":"` + srv.Addr + `"`,
	} {
		lines := startSidecar(t, []string{"IDEMCP_REDIS_PASSWORD=" + pw}, `"msg":"Store `,
			"--store", "redis", "--redis-addr", srv.Addr, "--upstream", "http://127.0.0.1:1")
		if !strings.Contains(lines, want) {
			t.Errorf("password %q: log\n%s\nwant a line with %s", pw, lines, want)
		}
		if !regexp.MustCompile(`"msg":"Sidecar listening".*"admin":"127\.0\.0\.1:\d+".*"store":"Redis","storeMode":"standalone","storeAddress":"` + regexp.QuoteMeta(srv.Addr) + `"`).MatchString(lines) {
			t.Errorf("password %q: the startup line does not name the admin address and the Redis store:\n%s", pw, lines)
		}
	}
	// Nothing listens on a port of a stopped server.
	srv.Stop()
	lines := startSidecar(t, nil, `"msg":"Store `, "--store", "redis", "--redis-addr", srv.Addr, "--upstream", "http://127.0.0.1:1")
	if !strings.Contains(lines, `"msg":"Store unreachable at startup","store":"Redis","storeAddress":"`+srv.Addr+`","cause":"dial tcp `+srv.Addr+`: connect: connection refused"`) {
		t.Errorf("Redis down: log\n%s\nwant a warning naming the address and the refused connection", lines)
	}
}

// startSidecar runs `idemcp sidecar` on free ports until a log line
// contains until, and returns the log up to it.
func startSidecar(t *testing.T, env []string, until string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], append([]string{"sidecar", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"}, args...)...)
	cmd.Env = append([]string{runMainEnv + "=1", "PATH=" + os.Getenv("PATH")}, env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	var log strings.Builder
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if strings.Contains(sc.Text(), until) {
			return log.String()
		}
	}
	t.Fatalf("the sidecar ended without logging %s:\n%s", until, log.String())
	return ""
}

// helpFlag is a flag as `idemcp CMD --help` lists it.
type helpFlag struct {
	usage, def string
	env        []string
}

var helpFlagLine = regexp.MustCompile(`^  --([a-z0-9-]+)`)
var helpNotes = regexp.MustCompile(`\[(.*)\]$`)

func helpFlags(t *testing.T, cmd string) map[string]helpFlag {
	t.Helper()
	stdout, stderr, code := idemcp(t, nil, cmd, "--help")
	if code != 0 {
		t.Fatalf("idemcp %s --help: exit %d, %s", cmd, code, stderr)
	}
	flags := map[string]helpFlag{}
	lines := strings.Split(stdout, "\n")
	for i, line := range lines {
		m := helpFlagLine.FindStringSubmatch(line)
		if m == nil || i+1 >= len(lines) {
			continue
		}
		f := helpFlag{usage: strings.TrimSpace(lines[i+1])}
		if n := helpNotes.FindStringSubmatch(f.usage); n != nil {
			for _, note := range strings.Split(n[1], "; ") {
				if d, ok := strings.CutPrefix(note, "default "); ok {
					f.def = strings.Trim(d, `"`)
				}
				if e, ok := strings.CutPrefix(note, "env "); ok {
					f.env = strings.Split(e, ", ")
				}
			}
		}
		flags[m[1]] = f
	}
	if len(flags) < 5 {
		t.Fatalf("idemcp %s --help lists %d flags:\n%s", cmd, len(flags), stdout)
	}
	return flags
}

// docTable is a flag reference table of README.md or docs/*.md.
type docTable struct {
	where string // file:line
	cmd   string
	intro string            // the text from the last heading to the table
	outro string            // the text between the table and the next heading
	rows  map[string]string // flag -> its row
	defs  map[string]string // flag -> the one `literal` of its default cell
}

var (
	docCmd    = regexp.MustCompile("`idemcp (sidecar|wrap|manager)[` ]")
	docFlag   = regexp.MustCompile("`--([a-z0-9-]+)`")
	docTicked = regexp.MustCompile("`([^`]*)`")
)

func docTables(t *testing.T) []docTable {
	t.Helper()
	files, _ := filepath.Glob("docs/*.md")
	files = append([]string{"README.md"}, files...)
	var tables []docTable
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(data), "\n")
		for i := 0; i < len(lines); i++ {
			cells := strings.Split(lines[i], "|")
			if len(cells) < 3 || strings.TrimSpace(cells[1]) != "flag" {
				continue
			}
			tb := docTable{where: fmt.Sprintf("%s:%d", file, i+1), rows: map[string]string{}, defs: map[string]string{}}
			for j := i - 1; j >= 0; j-- {
				tb.intro = lines[j] + "\n" + tb.intro
				if strings.HasPrefix(lines[j], "#") {
					break // the heading is part of it: "## `idemcp wrap`"
				}
			}
			if m := docCmd.FindAllStringSubmatch(tb.intro, -1); m != nil {
				tb.cmd = m[len(m)-1][1]
			} else {
				t.Errorf("%s: a flag table with no `idemcp sidecar|wrap|manager` in the text before it", tb.where)
			}
			for i += 2; i < len(lines) && strings.HasPrefix(lines[i], "|"); i++ {
				cells := strings.Split(lines[i], "|")
				names := docFlag.FindAllStringSubmatch(cells[1], -1)
				if len(names) == 0 {
					t.Errorf("%s:%d: a row of a flag table names no `--flag`", file, i+1)
				}
				defs := docTicked.FindAllStringSubmatch(cells[2], -1)
				for k, n := range names {
					tb.rows[n[1]] = lines[i]
					if len(defs) == len(names) {
						tb.defs[n[1]] = defs[k][1]
					}
				}
			}
			for j := i; j < len(lines) && !strings.HasPrefix(lines[j], "#"); j++ {
				tb.outro += lines[j] + "\n"
			}
			tables = append(tables, tb)
		}
	}
	return tables
}

// TestFlagsMatchDocs: every flag in each command's --help is in a flag
// table of README.md or docs/*.md, with the same default where the table
// gives one literally; every flag in the tables exists; and every
// environment variable --help shows is documented: in the flag's row, in
// the text right after the table, or by the IDEMCP_<FLAG> rule stated
// above the table.
func TestFlagsMatchDocs(t *testing.T) {
	help := map[string]map[string]helpFlag{}
	for _, cmd := range []string{"sidecar", "wrap", "manager"} {
		help[cmd] = helpFlags(t, cmd)
	}
	documented := map[string]map[string]docTable{"sidecar": {}, "wrap": {}, "manager": {}}
	for _, tb := range docTables(t) {
		if tb.cmd == "" {
			continue
		}
		for name := range tb.rows {
			if _, ok := help[tb.cmd][name]; !ok {
				t.Errorf("%s documents --%s, which idemcp %s --help does not list", tb.where, name, tb.cmd)
			}
			documented[tb.cmd][name] = tb
		}
	}
	for _, cmd := range []string{"sidecar", "wrap", "manager"} {
		var names []string
		for name := range help[cmd] {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			hf := help[cmd][name]
			tb, ok := documented[cmd][name]
			if !ok && cmd == "wrap" {
				// wrap shares the sidecar's store and policy flags: the
				// sidecar's table documents those that are the same.
				if sf, same := help["sidecar"][name]; same && sf.usage == hf.usage {
					tb, ok = documented["sidecar"][name]
				}
			}
			if !ok {
				t.Errorf("idemcp %s --%s is in --help but in no flag table of README.md or docs/*.md", cmd, name)
				continue
			}
			if def, lit := tb.defs[name]; lit && hf.def != "" && def != hf.def {
				t.Errorf("%s: --%s defaults to `%s`; idemcp %s --help says %s", tb.where, name, def, cmd, hf.def)
			}
			for _, env := range hf.env {
				byRule := env == cli.EnvName("IDEMCP_", name) && (strings.Contains(tb.intro, "IDEMCP_<") || strings.Contains(tb.intro, "IDEMCP_*"))
				if !byRule && !strings.Contains(tb.rows[name], env) && !strings.Contains(tb.outro, "`"+env+"`") {
					t.Errorf("%s: --%s reads %s (idemcp %s --help), which the table does not say", tb.where, name, env, cmd)
				}
			}
		}
	}
}
