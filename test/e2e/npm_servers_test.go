package e2e_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// These tests put idemcp in front of MCP servers we did not write: the
// reference servers from npm (pinned in test/interop/ts/package.json, so
// that make test-deps installs them), driven by the Go SDK client through
// `idemcp wrap` (stdio) and `idemcp sidecar` (Streamable HTTP). Each runs
// also directly, so that what the server itself does is known: that a
// repeated move_file fails, that a repeated toggle toggles back. Each asserts
// what a user would notice: a retry within the window is replayed, a
// deliberate repeat after it runs, tools annotated read-only or idempotent
// are always fresh, and reads see a change made behind the proxy's back.

// npmWindow is the retry window of these tests: short, so that a test can
// wait it out, and long enough that a retry sent at once on a loaded
// machine is inside it.
const npmWindow = 3 * time.Second

// npmServer is the entry point of a reference server's npm package.
func npmServer(t *testing.T, pkg string) string {
	t.Helper()
	p, err := filepath.Abs(filepath.Join(tsDir, "node_modules", "@modelcontextprotocol", pkg, "dist", "index.js"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("@modelcontextprotocol/%s is not installed (make test-deps runs npm ci in test/interop/ts): %v", pkg, err)
	}
	return p
}

// route is one way to reach a server: directly, or through idemcp.
type route struct {
	name    string
	proxied bool
	// connect opens a session to the stdio server argv; env is the
	// server's extra environment. It returns idemcp's log (for direct, the
	// server's stderr).
	connect func(t *testing.T, env []string, argv ...string) (*mcp.ClientSession, fmt.Stringer)
}

// stdioRoutes reach a stdio server directly, through idemcp wrap and
// through idemcp sidecar (over test/interop/ts/http-bridge.mjs, which
// serves the stdio server over Streamable HTTP), idemcp with flags.
func stdioRoutes(t *testing.T, flags ...string) []route {
	node, npm := lookupNode(t)
	ensureTSDeps(t, npm)
	bins := buildWrapBins(t)
	bridge, err := filepath.Abs(filepath.Join(tsDir, "http-bridge.mjs"))
	if err != nil {
		t.Fatal(err)
	}
	return []route{
		{"direct", false, func(t *testing.T, env []string, argv ...string) (*mcp.ClientSession, fmt.Stringer) {
			return stdioSession(t, exec.Command(node, argv...), env)
		}},
		{"wrap", true, func(t *testing.T, env []string, argv ...string) (*mcp.ClientSession, fmt.Stringer) {
			args := append(append([]string{"wrap", "--log-level", "debug", "--retry-window", npmWindow.String()}, flags...), "--", node)
			return stdioSession(t, exec.Command(bins.idemcp, append(args, argv...)...), env)
		}},
		{"sidecar", true, func(t *testing.T, env []string, argv ...string) (*mcp.ClientSession, fmt.Stringer) {
			upstream := startNodeHTTP(t, node, env, append([]string{bridge, node}, argv...)...)
			url, logs := startSidecarBin(t, upstream, flags...)
			return httpSession(t, url), logs
		}},
	}
}

// stdioSession is a Go SDK client session with cmd as the server process;
// the buffer collects its stderr.
func stdioSession(t *testing.T, cmd *exec.Cmd, env []string) (*mcp.ClientSession, fmt.Stringer) {
	t.Helper()
	cmd.Env = append(append(os.Environ(), "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0")), env...)
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	t.Cleanup(func() {
		if t.Failed() || os.Getenv("E2E_TRACE") != "" {
			t.Logf("%s stderr:\n%s", filepath.Base(cmd.Path), stderr.String())
		}
	})
	client := mcp.NewClient(&mcp.Implementation{Name: "e2e-npm-client", Version: "1.0.0"}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cs, err := client.Connect(ctx, &mcp.CommandTransport{Command: cmd}, nil)
	if err != nil {
		t.Fatalf("connecting to %v: %v\nstderr:\n%s", cmd.Args, err, stderr.String())
	}
	t.Cleanup(func() { _ = cs.Close() })
	return cs, stderr
}

// httpSession is a Go SDK client session over Streamable HTTP.
func httpSession(t *testing.T, url string) *mcp.ClientSession {
	t.Helper()
	client := mcp.NewClient(&mcp.Implementation{Name: "e2e-npm-client", Version: "1.0.0"}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: url}, nil)
	if err != nil {
		t.Fatalf("connecting to %s: %v", url, err)
	}
	t.Cleanup(func() { _ = cs.Close() })
	return cs
}

// startUntil starts cmd and waits, at most 30s, until its output contains
// ready; the process is stopped when the test ends.
func startUntil(t *testing.T, cmd *exec.Cmd, ready string) *syncBuffer {
	t.Helper()
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %v: %v", cmd.Args, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		werr := <-exited
		if t.Failed() || os.Getenv("E2E_TRACE") != "" {
			t.Logf("%v (%v) output:\n%s", cmd.Args, werr, logs.String())
		}
	})
	deadline := time.NewTimer(30 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !strings.Contains(logs.String(), ready) {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("%v exited before it was ready: %v\n%s", cmd.Args, err, logs.String())
		case <-deadline.C:
			t.Fatalf("%v was not ready within 30s:\n%s", cmd.Args, logs.String())
		case <-tick.C:
		}
	}
	return logs
}

// startSidecarBin runs `idemcp sidecar --retry-window npmWindow` in front
// of upstream, without a manager, and returns its URL and output.
func startSidecarBin(t *testing.T, upstream string, flags ...string) (string, *syncBuffer) {
	t.Helper()
	bins := buildWrapBins(t)
	addr := freeAddr(t)
	args := append([]string{"sidecar", "--upstream", upstream, "--listen", addr, "--admin-listen", "", "--log-level", "debug", "--retry-window", npmWindow.String()}, flags...)
	cmd := exec.Command(bins.idemcp, args...)
	cmd.Env = append(os.Environ(), "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	logs := startUntil(t, cmd, "Sidecar listening")
	return "http://" + addr, logs
}

// startNodeHTTP runs a Node script that prints "listening PORT" (or the
// everything server's "listening on port") and returns its URL.
func startNodeHTTP(t *testing.T, node string, env []string, argv ...string) string {
	t.Helper()
	addr := freeAddr(t)
	port := addr[strings.LastIndex(addr, ":")+1:]
	cmd := exec.Command(node, argv...)
	cmd.Dir = tsDir
	cmd.Env = append(append(os.Environ(), "PORT="+port), env...)
	startUntil(t, cmd, "listening")
	return "http://127.0.0.1:" + port
}

func npmCall(t *testing.T, cs *mcp.ClientSession, tool string, args map[string]any, meta mcp.Meta) *mcp.CallToolResult {
	t.Helper()
	if args == nil {
		args = map[string]any{} // servers refuse arguments: null
	}
	return mustCall(t, cs, tool, args, meta)
}

// textOf is a result's text content.
func textOf(res *mcp.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

// window tracks the retry window of the call a test means to repeat: a
// retry must be sent inside it, a deliberate repeat after it.
type window struct{ settled time.Time }

func startWindow() *window { return &window{settled: time.Now()} }

// inside fails the test if the retry about to be sent would not be inside
// the window: then the machine was too slow for the test, not idemcp wrong.
func (w *window) inside(t *testing.T) {
	t.Helper()
	if time.Since(w.settled) > npmWindow/2 {
		t.Fatalf("the retry comes %v after the first call, too close to the %v window to tell a replay from a repeat", time.Since(w.settled), npmWindow)
	}
}

// waitOut waits until the window has passed, if there is one: the result
// is stored just after the client has it, so the wait has a margin.
func (w *window) waitOut(proxied bool) {
	if proxied {
		time.Sleep(time.Until(w.settled.Add(npmWindow + 750*time.Millisecond)))
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestNPMFilesystemServer: @modelcontextprotocol/server-filesystem, whose
// write_file says idempotentHint: true, read_text_file readOnlyHint: true,
// and move_file neither (a second move of the same file fails).
func TestNPMFilesystemServer(t *testing.T) {
	server := npmServer(t, "server-filesystem")
	for _, r := range stdioRoutes(t) {
		t.Run(r.name, func(t *testing.T) {
			dir, err := filepath.EvalSymlinks(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			cs, _ := r.connect(t, nil, server, dir)
			c, a, b := filepath.Join(dir, "c.txt"), filepath.Join(dir, "a.txt"), filepath.Join(dir, "b.txt")

			// write_file is idempotent by the server's word: it always runs,
			// so the file is v1 again after a change behind the proxy's back.
			if res := npmCall(t, cs, "write_file", map[string]any{"path": c, "content": "v1"}, nil); res.IsError || replayed(res) {
				t.Fatalf("write_file: %s (replayed %v)", textOf(res), replayed(res))
			}
			writeFile(t, c, "changed behind the proxy's back")
			if res := npmCall(t, cs, "read_text_file", map[string]any{"path": c}, nil); textOf(res) != "changed behind the proxy's back" || replayed(res) {
				t.Errorf("read_text_file after an outside change = %q (replayed %v), want the change", textOf(res), replayed(res))
			}
			if res := npmCall(t, cs, "write_file", map[string]any{"path": c, "content": "v1"}, nil); res.IsError || replayed(res) {
				t.Errorf("write_file again: %s (replayed %v), want it to run", textOf(res), replayed(res))
			}
			if got := readFile(t, c); got != "v1" {
				t.Errorf("after write_file v1 again the file holds %q, want v1: a deliberate repeat of an idempotent tool must run", got)
			}
			if res := npmCall(t, cs, "read_text_file", map[string]any{"path": c}, nil); textOf(res) != "v1" || replayed(res) {
				t.Errorf("read_text_file = %q (replayed %v), want v1 fresh", textOf(res), replayed(res))
			}

			// move_file is neither read-only nor idempotent: deduplicated.
			writeFile(t, a, "A1")
			first := npmCall(t, cs, "move_file", map[string]any{"source": a, "destination": b}, nil)
			w := startWindow()
			if first.IsError || replayed(first) {
				t.Fatalf("move_file: %s (replayed %v)", textOf(first), replayed(first))
			}
			keyed := map[string]any{"source": filepath.Join(dir, "k1.txt"), "destination": filepath.Join(dir, "k2.txt")}
			writeFile(t, keyed["source"].(string), "K")
			key := mcp.Meta{"idempotency-key": "move-k1"}
			if res := npmCall(t, cs, "move_file", keyed, key); res.IsError {
				t.Fatalf("keyed move_file: %s", textOf(res))
			}
			w.inside(t)
			retry := npmCall(t, cs, "move_file", map[string]any{"source": a, "destination": b}, nil)
			if r.proxied {
				if !replayed(retry) || retry.IsError || textOf(retry) != textOf(first) {
					t.Errorf("retry of move_file within the window: %q (replayed %v, isError %v), want the first result %q replayed", textOf(retry), replayed(retry), retry.IsError, textOf(first))
				}
			} else if !retry.IsError {
				t.Errorf("the server itself answered a second move_file of a moved file with %q, want an error", textOf(retry))
			}

			// After the window the same move is a deliberate repeat: it runs.
			w.waitOut(r.proxied)
			writeFile(t, a, "A2")
			if err := os.Remove(b); err != nil {
				t.Fatal(err)
			}
			again := npmCall(t, cs, "move_file", map[string]any{"source": a, "destination": b}, nil)
			if again.IsError || replayed(again) {
				t.Errorf("move_file after the window: %q (replayed %v), want it to run", textOf(again), replayed(again))
			}
			if got := readFile(t, b); got != "A2" {
				t.Errorf("after a deliberate repeat of move_file b.txt holds %q, want A2", got)
			}
			// An explicit key is the caller's promise: kept for ttl.
			res := npmCall(t, cs, "move_file", keyed, key)
			if r.proxied && (!replayed(res) || res.IsError) {
				t.Errorf("keyed move_file after the window: %q (replayed %v, isError %v), want the first result replayed (an explicit key is kept for ttl)", textOf(res), replayed(res), res.IsError)
			}
			if !r.proxied && !res.IsError {
				t.Errorf("the server itself answered a second keyed move_file with %q, want an error", textOf(res))
			}
		})
	}
}

// TestNPMMemoryServer: @modelcontextprotocol/server-memory, whose deletes
// say idempotentHint: true, read_graph readOnlyHint: true, and
// create_entities neither (a second create of an entity creates nothing).
// The graph lives in a file, which the test edits behind the proxy's back.
func TestNPMMemoryServer(t *testing.T) {
	server := npmServer(t, "server-memory")
	for _, r := range stdioRoutes(t) {
		t.Run(r.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "memory.jsonl")
			cs, _ := r.connect(t, []string{"MEMORY_FILE_PATH=" + file}, server)
			alice := map[string]any{"entities": []any{map[string]any{"name": "alice", "entityType": "person", "observations": []any{"likes tea"}}}}

			first := npmCall(t, cs, "create_entities", alice, nil)
			w := startWindow()
			if first.IsError || replayed(first) || !strings.Contains(textOf(first), "alice") {
				t.Fatalf("create_entities: %q (replayed %v)", textOf(first), replayed(first))
			}
			w.inside(t)
			retry := npmCall(t, cs, "create_entities", alice, nil)
			if r.proxied && (!replayed(retry) || textOf(retry) != textOf(first)) {
				t.Errorf("retry of create_entities: %q (replayed %v), want the first result %q replayed", textOf(retry), replayed(retry), textOf(first))
			}
			if !r.proxied && strings.Contains(textOf(retry), "alice") {
				t.Errorf("the server itself answered a second create_entities with %q, want no new entity", textOf(retry))
			}
			if res := npmCall(t, cs, "read_graph", nil, nil); !strings.Contains(textOf(res), "alice") || replayed(res) {
				t.Errorf("read_graph = %q (replayed %v), want alice, fresh", textOf(res), replayed(res))
			}
			for i := range 2 {
				if res := npmCall(t, cs, "delete_entities", map[string]any{"entityNames": []any{"alice"}}, nil); res.IsError || replayed(res) {
					t.Errorf("delete_entities #%d: %q (replayed %v), want it to run every time (idempotentHint)", i+1, textOf(res), replayed(res))
				}
			}
			// A change behind the proxy's back: another writer adds bob.
			f, err := os.OpenFile(file, os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0o644)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = f.WriteString("\n" + `{"type":"entity","name":"bob","entityType":"person","observations":[]}` + "\n")
			_ = f.Close()
			if res := npmCall(t, cs, "read_graph", nil, nil); !strings.Contains(textOf(res), "bob") || strings.Contains(textOf(res), "alice") || replayed(res) {
				t.Errorf("read_graph after the outside change = %q (replayed %v), want bob and no alice, fresh", textOf(res), replayed(res))
			}
			// After the window, creating alice again is a deliberate repeat.
			w.waitOut(r.proxied)
			if res := npmCall(t, cs, "create_entities", alice, nil); res.IsError || replayed(res) || !strings.Contains(textOf(res), "alice") {
				t.Errorf("create_entities after the window: %q (replayed %v), want alice created again", textOf(res), replayed(res))
			}
			if res := npmCall(t, cs, "read_graph", nil, nil); !strings.Contains(textOf(res), "alice") {
				t.Errorf("read_graph = %q, want alice again", textOf(res))
			}
		})
	}
}

// TestNPMServerWithoutAnnotations: @modelcontextprotocol/server-redis
// annotates none of its tools, so Auto deduplicates them all, reads
// included. The wrapper says so at start, with the rule that passes the
// reads through; with that rule, get sees a change made behind its back.
func TestNPMServerWithoutAnnotations(t *testing.T) {
	server := npmServer(t, "server-redis")
	rdb := redistest.Start(t)
	url := "redis://" + rdb.Addr
	set := func(v string) map[string]any { return map[string]any{"key": "k", "value": v} }
	get := map[string]any{"key": "k"}
	policy := writePolicy(t, "spec: {tools: [{name: get, mode: Passthrough}, {name: list, mode: Passthrough}]}")

	routes := stdioRoutes(t)
	for _, r := range stdioRoutes(t, "--policy-file", policy)[1:] {
		r.name += " with the logged rule"
		routes = append(routes, r)
	}
	for _, r := range routes {
		withRule := strings.HasSuffix(r.name, "rule")
		t.Run(r.name, func(t *testing.T) {
			if _, err := redistest.Do(rdb.Addr, "DEL", "k"); err != nil {
				t.Fatal(err)
			}
			cs, stderr := r.connect(t, nil, server, url)
			if res := npmCall(t, cs, "set", set("v1"), nil); res.IsError || replayed(res) {
				t.Fatalf("set: %q (replayed %v)", textOf(res), replayed(res))
			}
			w := startWindow()
			if res := npmCall(t, cs, "get", get, nil); textOf(res) != "v1" || replayed(res) {
				t.Fatalf("get = %q (replayed %v), want v1", textOf(res), replayed(res))
			}
			if _, err := redistest.Do(rdb.Addr, "SET", "k", "v2"); err != nil {
				t.Fatal(err)
			}
			w.inside(t)
			res := npmCall(t, cs, "get", get, nil)
			switch {
			case !r.proxied || withRule:
				if textOf(res) != "v2" || replayed(res) {
					t.Errorf("get after an outside change = %q (replayed %v), want v2 fresh", textOf(res), replayed(res))
				}
			default:
				// Auto with no annotations: the read is replayed stale until
				// the window ends, and the wrapper said so.
				if textOf(res) != "v1" || !replayed(res) {
					t.Errorf("get under Auto with no annotations = %q (replayed %v), want v1 replayed", textOf(res), replayed(res))
				}
				tools := map[string]string{"wrap": `tools="[delete get list set]"`, "sidecar": `"tools":["delete","get","list","set"]`}[r.name]
				for _, want := range []string{"no annotations", tools, `{name: \"get\", mode: Passthrough}`} {
					if !strings.Contains(stderr.String(), want) {
						t.Errorf("idemcp's log does not contain %s:\n%s", want, stderr.String())
					}
				}
			}
			// set is deduplicated on every route through idemcp: a retry
			// within the window is replayed, and does not overwrite v2.
			res = npmCall(t, cs, "set", set("v1"), nil)
			if r.proxied != replayed(res) {
				t.Errorf("retry of set: replayed %v, want %v", replayed(res), r.proxied)
			}
			v, _ := redistest.Do(rdb.Addr, "GET", "k")
			if want := map[bool]string{true: "v2", false: "v1"}[r.proxied]; v != want {
				t.Errorf("after the retry of set, k is %q, want %q", v, want)
			}
			// After the window, set v1 again is a deliberate repeat.
			w.waitOut(r.proxied)
			if res := npmCall(t, cs, "set", set("v1"), nil); res.IsError || replayed(res) {
				t.Errorf("set after the window: %q (replayed %v), want it to run", textOf(res), replayed(res))
			}
			if v, _ := redistest.Do(rdb.Addr, "GET", "k"); v != "v1" {
				t.Errorf("after a deliberate repeat of set, k is %q, want v1", v)
			}
			if res := npmCall(t, cs, "get", get, nil); textOf(res) != "v1" || replayed(res) {
				t.Errorf("get after the window = %q (replayed %v), want v1 fresh", textOf(res), replayed(res))
			}
		})
	}
}

// TestNPMEverythingServerHTTP: @modelcontextprotocol/server-everything in
// its Streamable HTTP mode behind `idemcp sidecar`. toggle-simulated-logging
// is neither read-only nor idempotent (each call flips a switch of the
// session); echo and get-sum are read-only.
func TestNPMEverythingServerHTTP(t *testing.T) {
	node, npm := lookupNode(t)
	ensureTSDeps(t, npm)
	upstream := startNodeHTTP(t, node, nil, npmServer(t, "server-everything"), "streamableHttp")
	sidecarURL, logs := startSidecarBin(t, upstream)
	for _, r := range []struct {
		name    string
		url     string
		proxied bool
	}{{"direct", upstream + "/mcp", false}, {"sidecar", sidecarURL + "/mcp", true}} {
		t.Run(r.name, func(t *testing.T) {
			cs := httpSession(t, r.url)
			first := npmCall(t, cs, "toggle-simulated-logging", nil, nil)
			w := startWindow()
			if !strings.HasPrefix(textOf(first), "Started") || replayed(first) {
				t.Fatalf("toggle-simulated-logging: %q (replayed %v)", textOf(first), replayed(first))
			}
			for i := range 2 {
				if res := npmCall(t, cs, "echo", map[string]any{"message": "hi"}, nil); textOf(res) != "Echo: hi" || replayed(res) {
					t.Errorf("echo #%d = %q (replayed %v), want a fresh Echo: hi", i+1, textOf(res), replayed(res))
				}
			}
			if res := npmCall(t, cs, "get-sum", map[string]any{"a": 1, "b": 2}, nil); !strings.Contains(textOf(res), "3") || replayed(res) {
				t.Errorf("get-sum = %q (replayed %v), want 3, fresh", textOf(res), replayed(res))
			}
			w.inside(t)
			retry := npmCall(t, cs, "toggle-simulated-logging", nil, nil)
			if r.proxied && (!replayed(retry) || textOf(retry) != textOf(first)) {
				t.Errorf("retry of toggle within the window: %q (replayed %v), want %q replayed", textOf(retry), replayed(retry), textOf(first))
			}
			if !r.proxied && !strings.HasPrefix(textOf(retry), "Stopped") {
				t.Errorf("the server itself answered a second toggle with %q, want Stopped", textOf(retry))
			}
			if !r.proxied {
				return
			}
			w.waitOut(r.proxied)
			if again := npmCall(t, cs, "toggle-simulated-logging", nil, nil); !strings.HasPrefix(textOf(again), "Stopped") || replayed(again) {
				t.Errorf("toggle after the window: %q (replayed %v), want it to run and stop", textOf(again), replayed(again))
			}
		})
	}
	if strings.Contains(logs.String(), "no annotations") {
		t.Errorf("the sidecar reports tools with no annotations, but every tool of server-everything has them:\n%s", logs.String())
	}
}
