package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcp/idemcp/sidecar"
)

// legacyTSOutput is what test/interop/ts/sse-client.mjs prints.
type legacyTSOutput struct {
	ProtocolVersion string          `json:"protocolVersion"`
	Server          json.RawMessage `json:"server"`
	Tools           []struct {
		Name     string `json:"name"`
		ReadOnly bool   `json:"readOnly"`
	} `json:"tools"`
	Calls []struct {
		Label    string `json:"label"`
		Tool     string `json:"tool"`
		Text     string `json:"text"`
		Replayed bool   `json:"replayed"`
		IsError  bool   `json:"isError"`
	} `json:"calls"`
	Wire []struct {
		Dir      string          `json:"dir"`
		ID       json.RawMessage `json:"id"`
		Method   *string         `json:"method"`
		Replayed bool            `json:"replayed"`
		Error    *int            `json:"error"`
	} `json:"wire"`
}

// TestLegacySSETypeScriptInterop puts the sidecar in front of the
// TypeScript reference server @modelcontextprotocol/server-everything in
// its legacy HTTP+SSE mode, driven by the TypeScript SDK's
// SSEClientTransport. toggle-simulated-logging flips state on every run,
// so its texts count runs: through the sidecar the retry is replayed
// ("Started" twice) and the next keyed call is the second run ("Stopped");
// straight at the server, the retry runs ("Stopped"). gzip-file-as-resource
// is annotated idempotentHint: true, so Auto passes it through: its retry
// runs too.
func TestLegacySSETypeScriptInterop(t *testing.T) {
	node, npm := lookupNode(t)
	ensureTSDeps(t, npm)
	legacyEnsureEverything(t, npm)

	upstream := legacyStartEverything(t, node)
	sc, err := sidecar.New(sidecar.Options{Upstream: upstream, LogLevel: "error"})
	if err != nil {
		t.Fatalf("sidecar.New: %v", err)
	}
	proxy := httptest.NewServer(sc.Handler())
	t.Cleanup(proxy.Close)

	out := legacyRunSSEClient(t, node, proxy.URL+"/sse")
	t.Logf("TypeScript SDK over legacy SSE through the sidecar: protocol %s, server %s", out.ProtocolVersion, out.Server)
	for _, c := range out.Calls {
		t.Logf("  %-16s replayed=%-5v %.70q", c.Label, c.Replayed, c.Text)
	}
	readOnly := map[string]bool{}
	for _, tool := range out.Tools {
		readOnly[tool.Name] = tool.ReadOnly
	}
	if ro, ok := readOnly["toggle-simulated-logging"]; !ok || ro {
		t.Fatalf("tools/list through the sidecar: toggle-simulated-logging listed=%v readOnly=%v, want a listed, non-read-only tool", ok, ro)
	}
	if !readOnly["echo"] {
		t.Fatal("tools/list through the sidecar does not list echo as readOnlyHint")
	}
	want := []struct {
		label    string
		prefix   string
		replayed bool
	}{
		{"toggle", "Started", false},
		{"toggle retry", "Started", true},
		{"toggle, new key", "Stopped", false},
		{"gzip a", "{", false},
		{"gzip a retry", "{", false},
		{"gzip b", "{", false},
		{"echo", "Echo: hello", false},
		{"echo again", "Echo: hello", false},
	}
	if len(out.Calls) != len(want) {
		t.Fatalf("got %d call results, want %d: %+v", len(out.Calls), len(want), out.Calls)
	}
	for i, w := range want {
		c := out.Calls[i]
		if c.Label != w.label || c.IsError || !strings.HasPrefix(c.Text, w.prefix) || c.Replayed != w.replayed {
			t.Errorf("call %q: replayed=%v isError=%v text %.60q; want replayed=%v and a text starting %q",
				c.Label, c.Replayed, c.IsError, c.Text, w.replayed, w.prefix)
		}
	}
	if out.Calls[1].Text != out.Calls[0].Text {
		t.Error("a replay's text differs from the first call's")
	}
	if strings.Contains(out.Calls[5].Text, "idemcp-a") {
		t.Errorf("gzip of another file got the first file's result: %q", out.Calls[5].Text)
	}
	legacyCheckIDs(t, out)

	// Control: the same script straight at the server runs every call.
	direct := legacyRunSSEClient(t, node, upstream+"/sse")
	for _, c := range direct.Calls {
		if c.Replayed {
			t.Errorf("direct call %q is marked replayed without the sidecar", c.Label)
		}
	}
	if len(direct.Calls) > 2 && !strings.HasPrefix(direct.Calls[1].Text, "Stopped") {
		t.Errorf("direct, the toggle's retry says %.40q; want it to run again (\"Stopped\"), or the test proves nothing", direct.Calls[1].Text)
	}
}

// legacyCheckIDs checks that every request the client sent got exactly one
// response, with its id.
func legacyCheckIDs(t *testing.T, out legacyTSOutput) {
	t.Helper()
	responses := map[string]int{}
	var replays int
	for _, m := range out.Wire {
		if m.Dir == "in" && m.Method == nil && len(m.ID) > 0 && string(m.ID) != "null" {
			responses[string(m.ID)]++
			if m.Replayed {
				replays++
			}
		}
	}
	requests := 0
	for _, m := range out.Wire {
		if m.Dir != "out" || m.Method == nil || len(m.ID) == 0 || string(m.ID) == "null" {
			continue
		}
		requests++
		if n := responses[string(m.ID)]; n != 1 {
			t.Errorf("request %s (%s) got %d responses with its id, want 1", m.ID, *m.Method, n)
		}
	}
	if len(responses) != requests {
		t.Errorf("%d distinct response ids for %d requests: %v", len(responses), requests, responses)
	}
	if replays != 1 { // the toggle's retry; gzip's (idempotentHint) runs
		t.Errorf("%d replayed responses on the stream, want 1", replays)
	}
}

// legacyEnsureEverything installs test/interop/ts's locked dependencies
// again if server-everything is missing from an older install.
func legacyEnsureEverything(t *testing.T, npm string) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(legacyEverythingDir(), "package.json")); err == nil {
		return
	}
	t.Logf("installing @modelcontextprotocol/server-everything: npm ci in %s", tsDir)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, npm, "ci", "--no-audit", "--no-fund")
	cmd.Dir = tsDir
	cmd.WaitDelay = 10 * time.Second
	if outb, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("npm ci in %s: %v\n%s", tsDir, err, outb)
	}
	if _, err := os.Stat(filepath.Join(legacyEverythingDir(), "package.json")); err != nil {
		t.Fatalf("@modelcontextprotocol/server-everything is not installed after npm ci: %v", err)
	}
}

func legacyEverythingDir() string {
	return filepath.Join(tsDir, "node_modules", "@modelcontextprotocol", "server-everything")
}

// syncBuffer is a bytes.Buffer safe to write from a child's output copier
// while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// legacyStartEverything runs server-everything in sse mode (its CLI
// argument "sse"; the port comes from $PORT) and returns its base URL.
func legacyStartEverything(t *testing.T, node string) string {
	t.Helper()
	return startEverything(t, node, "sse")
}

// startEverything runs server-everything in mode (sse, streamableHttp) and
// returns its base URL.
func startEverything(t *testing.T, node, mode string) string {
	t.Helper()
	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, node, filepath.Join(legacyEverythingDir(), "dist", "index.js"), mode)
	cmd.Env = append(os.Environ(), "PORT="+port)
	cmd.WaitDelay = 5 * time.Second
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatalf("starting server-everything: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cancel()
		werr := <-exited
		if t.Failed() || os.Getenv("E2E_TRACE") != "" {
			t.Logf("server-everything (%v) output:\n%s", werr, logs.String())
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+port, time.Second)
		if err == nil {
			_ = c.Close()
			return "http://127.0.0.1:" + port
		}
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("server-everything exited before listening: %v\n%s", err, logs.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("server-everything did not listen on port %s within 30s:\n%s", port, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// legacyRunSSEClient runs sse-client.mjs against url and parses its one
// JSON line.
func legacyRunSSEClient(t *testing.T, node, url string) legacyTSOutput {
	t.Helper()
	var out legacyTSOutput
	runNodeScript(t, node, "sse-client.mjs", url, &out)
	return out
}
