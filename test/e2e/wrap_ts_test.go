package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// wrapTSOutput is what test/interop/ts/wrap-client.mjs prints.
type wrapTSOutput struct {
	Server json.RawMessage `json:"server"`
	Tools  []struct {
		Name         string `json:"name"`
		ReadOnlyHint bool   `json:"readOnlyHint"`
	} `json:"tools"`
	Calls []struct {
		Name     string `json:"name"`
		Text     string `json:"text"`
		Replayed bool   `json:"replayed"`
		IsError  bool   `json:"isError"`
	} `json:"calls"`
}

// TestWrapTypeScriptEverything puts `idemcp wrap` in front of the
// TypeScript reference server (npm @modelcontextprotocol/server-everything,
// stdio mode), driven by the TypeScript SDK's StdioClientTransport, with
// the default policy (defaultMode Auto). toggle-subscriber-updates has a
// side effect a user can see (the first call starts updates, the second
// stops them) and is not read-only: its retry is replayed and says
// "Started" again. get-sum is annotated readOnlyHint and runs every time.
// As a control, the same calls straight to the server toggle twice.
func TestWrapTypeScriptEverything(t *testing.T) {
	node, npm := lookupNode(t)
	ensureTSDeps(t, npm)
	everything := ensureEverythingServer(t, npm)
	bins := buildWrapBins(t)

	plan := `[{"name":"toggle-subscriber-updates"},{"name":"toggle-subscriber-updates"},
		{"name":"get-sum","arguments":{"a":2,"b":3}},{"name":"get-sum","arguments":{"a":2,"b":3}}]`

	direct := runWrapClient(t, node, plan, node, everything, "stdio")
	if len(direct.Calls) != 4 || !strings.HasPrefix(direct.Calls[0].Text, "Started") || !strings.HasPrefix(direct.Calls[1].Text, "Stopped") {
		t.Fatalf("control (no wrapper): want the toggle to start then stop, got %+v", direct.Calls)
	}

	out := runWrapClient(t, node, plan, bins.idemcp, "wrap", "--", node, everything, "stdio")
	t.Logf("server %s", out.Server)
	for i, c := range out.Calls {
		t.Logf("  call %d %s replayed=%v text=%.60q", i+1, c.Name, c.Replayed, c.Text)
	}
	hints := map[string]bool{}
	for _, tool := range out.Tools {
		hints[tool.Name] = tool.ReadOnlyHint
	}
	if ro, ok := hints["toggle-subscriber-updates"]; !ok || ro {
		t.Fatalf("tools/list through the wrapper: toggle-subscriber-updates listed=%v readOnlyHint=%v, want listed and not read-only", ok, ro)
	}
	if ro := hints["get-sum"]; !ro {
		t.Fatalf("tools/list through the wrapper: get-sum readOnlyHint=%v, want true", ro)
	}
	if len(out.Calls) != 4 {
		t.Fatalf("got %d call results, want 4: %+v", len(out.Calls), out.Calls)
	}
	first, retry := out.Calls[0], out.Calls[1]
	if first.Replayed || !strings.HasPrefix(first.Text, "Started") {
		t.Errorf("first toggle: replayed=%v text=%q, want a fresh run that starts updates", first.Replayed, first.Text)
	}
	if !retry.Replayed || retry.Text != first.Text {
		t.Errorf("retried toggle: replayed=%v text=%q, want the first result replayed (a second run would say Stopped)", retry.Replayed, retry.Text)
	}
	for _, c := range out.Calls[2:] {
		if c.Replayed || c.IsError || c.Text != "The sum of 2 and 3 is 5." {
			t.Errorf("get-sum (readOnlyHint) through the wrapper: %+v, want a fresh run each time", c)
		}
	}
}

// ensureEverythingServer returns the path of server-everything's entry
// point, installing test/interop/ts's locked dependencies if an older
// install lacks it.
func ensureEverythingServer(t *testing.T, npm string) string {
	t.Helper()
	dir := filepath.Join(tsDir, "node_modules", "@modelcontextprotocol", "server-everything")
	if _, err := os.Stat(filepath.Join(dir, "package.json")); err != nil {
		t.Logf("installing @modelcontextprotocol/server-everything: npm ci in %s", tsDir)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, npm, "ci", "--no-audit", "--no-fund")
		cmd.Dir = tsDir
		cmd.WaitDelay = 10 * time.Second
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("npm ci in %s: %v\n%s", tsDir, errors.Join(err, ctx.Err()), out)
		}
	}
	var pkg struct {
		Version string `json:"version"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "package.json"))
	if err != nil {
		t.Fatalf("@modelcontextprotocol/server-everything is not installed: %v", err)
	}
	_ = json.Unmarshal(b, &pkg)
	t.Logf("@modelcontextprotocol/server-everything %s", pkg.Version)
	entry, err := filepath.Abs(filepath.Join(dir, "dist", "index.js"))
	if err != nil {
		t.Fatal(err)
	}
	return entry
}

// runWrapClient runs wrap-client.mjs with the server command argv and
// the calls in plan, and parses its one JSON line.
func runWrapClient(t *testing.T, node, plan string, argv ...string) wrapTSOutput {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, append([]string{"wrap-client.mjs"}, argv...)...)
	cmd.Dir = tsDir
	cmd.Env = append(os.Environ(), "CALLS="+plan)
	cmd.WaitDelay = 5 * time.Second
	var stdout bytes.Buffer
	stderr := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = &stdout, stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("node wrap-client.mjs %s: %v\nstderr:\n%s\nstdout:\n%s", strings.Join(argv, " "), errors.Join(err, ctx.Err()), stderr.String(), stdout.String())
	}
	if t.Failed() || os.Getenv("E2E_TRACE") != "" {
		t.Logf("wrap-client.mjs stderr (the server's and the wrapper's):\n%s", stderr.String())
	}
	checkNoRace(t, stderr)
	var out wrapTSOutput
	if err := json.Unmarshal(bytes.TrimSpace(stdout.Bytes()), &out); err != nil {
		t.Fatalf("wrap-client.mjs printed no JSON line (%v):\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	return out
}
