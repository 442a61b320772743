package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemcp/idemcp/test/testdeps"
)

// tsDir holds the TypeScript interop client (test/interop/ts); the test's
// working directory is test/e2e.
var tsDir = filepath.Join("..", "interop", "ts")

// tsOutput is what test/interop/ts/client.mjs prints.
type tsOutput struct {
	ProtocolVersion string          `json:"protocolVersion"`
	SessionID       string          `json:"sessionId"`
	Server          json.RawMessage `json:"server"`
	Tools           []string        `json:"tools"`
	Calls           []tsCall        `json:"calls"`
	HTTP            []struct {
		Method          string            `json:"method"`
		RPC             string            `json:"rpc"`
		Status          int               `json:"status"`
		RequestHeaders  map[string]string `json:"requestHeaders"`
		ResponseHeaders map[string]string `json:"responseHeaders"`
		ClientError     string            `json:"clientError"`
	} `json:"http"`
}

type tsCall struct {
	Key            *string         `json:"key"`
	Text           string          `json:"text"`
	Replayed       bool            `json:"replayed"`
	ReplayedHeader *string         `json:"replayedHeader"`
	Structured     json.RawMessage `json:"structured"`
	IsError        bool            `json:"isError"`
}

// TestTypeScriptClientInterop drives the sidecar with the official
// TypeScript SDK client (npm @modelcontextprotocol/sdk): initialize,
// tools/list, a call and its retry (replayed), and a keyed call and its
// retry. As a control, the same script run against the server directly
// executes every call.
func TestTypeScriptClientInterop(t *testing.T) {
	node, npm := lookupNode(t)
	ensureTSDeps(t, npm)

	h := newHarness(t, revisions[1], "", nil)

	out := runTSClient(t, node, h.proxy.URL)
	t.Logf("TypeScript SDK negotiated %s, session %q, server %s", out.ProtocolVersion, out.SessionID, out.Server)
	for _, e := range out.HTTP {
		if e.ClientError != "" {
			t.Logf("  client error: %s", e.ClientError)
			continue
		}
		t.Logf("  %s %-28s -> %d  accept=%q protocol=%q content-type=%q replayed=%q",
			e.Method, e.RPC, e.Status, e.RequestHeaders["accept"], e.RequestHeaders["mcp-protocol-version"],
			e.ResponseHeaders["content-type"], e.ResponseHeaders["idempotent-replayed"])
	}
	for i, c := range out.Calls {
		t.Logf("  call %d key=%v replayed=%v Idempotent-Replayed=%v text=%q structured=%s",
			i+1, deref(c.Key), c.Replayed, deref(c.ReplayedHeader), c.Text, c.Structured)
	}

	if out.ProtocolVersion != h.rev.name {
		t.Errorf("negotiated protocol %q, want %q", out.ProtocolVersion, h.rev.name)
	}
	if !slices.Contains(out.Tools, "charge_card") {
		t.Errorf("tools/list through the sidecar = %v, want it to include charge_card", out.Tools)
	}
	if len(out.Calls) != 4 {
		t.Fatalf("got %d call results, want 4: %+v", len(out.Calls), out.Calls)
	}
	for i, pair := range [][2]tsCall{{out.Calls[0], out.Calls[1]}, {out.Calls[2], out.Calls[3]}} {
		name := [...]string{"derived-key pair", `keyed pair ("ts-key-1")`}[i]
		first, retry := pair[0], pair[1]
		if first.IsError || retry.IsError {
			t.Errorf("%s: isError results: %+v, %+v", name, first, retry)
		}
		if first.Replayed {
			t.Errorf("%s: the first call is marked replayed: %+v", name, first)
		}
		if first.ReplayedHeader != nil && *first.ReplayedHeader != "" {
			t.Errorf("%s: the first call has Idempotent-Replayed: %q", name, *first.ReplayedHeader)
		}
		if !retry.Replayed {
			t.Errorf("%s: the retry is not marked replayed (result._meta[\"idemcp.io/replayed\"]): %+v", name, retry)
		}
		if retry.ReplayedHeader == nil || *retry.ReplayedHeader != "true" {
			t.Errorf("%s: the retry's HTTP response lacks Idempotent-Replayed: true (got %v)", name, deref(retry.ReplayedHeader))
		}
		if retry.Text != first.Text {
			t.Errorf("%s: retry text %q, want the first result's %q", name, retry.Text, first.Text)
		}
		if !jsonEqual(retry.Structured, first.Structured) {
			t.Errorf("%s: retry structuredContent %s, want the first result's %s", name, retry.Structured, first.Structured)
		}
		if first.Text == "" || string(first.Structured) == "null" || len(first.Structured) == 0 {
			t.Errorf("%s: empty first result: %+v", name, first)
		}
	}
	if out.Calls[0].Text == out.Calls[2].Text {
		t.Errorf("the keyed call replayed the unkeyed call's result %q; an explicit key is a distinct operation", out.Calls[2].Text)
	}
	if n := h.srv.Counts.Get("charge_card"); n != 2 {
		t.Fatalf("charge_card ran %d times through the sidecar, want 2 (one per distinct key)", n)
	}

	// Control: the same script straight at the server runs every call.
	direct := runTSClient(t, node, h.upstream.URL)
	for i, c := range direct.Calls {
		if c.Replayed {
			t.Errorf("direct call %d is marked replayed without the sidecar: %+v", i, c)
		}
	}
	if n := h.srv.Counts.Get("charge_card"); n != 6 {
		t.Fatalf("charge_card ran %d times in all, want 2 through the sidecar + 4 direct", n)
	}
}

// lookupNode finds node and npm: missing tools fail the test in CI and
// skip it elsewhere.
func lookupNode(t *testing.T) (node, npm string) {
	t.Helper()
	var missing []string
	node, err := exec.LookPath("node")
	if err != nil {
		missing = append(missing, "node")
	}
	npm, err = exec.LookPath("npm")
	if err != nil {
		missing = append(missing, "npm")
	}
	if len(missing) > 0 {
		msg := strings.Join(missing, " and ") + " not found on PATH: the TypeScript interop test needs Node.js >= 20 with npm " +
			"(https://nodejs.org/en/download, or e.g. `apt-get install nodejs npm` / `brew install node`); " +
			"the test runs `npm ci` in test/interop/ts itself"
		testdeps.Missing(t, msg)
	}
	return node, npm
}

// ensureTSDeps installs test/interop/ts's locked dependencies unless they
// are there already.
func ensureTSDeps(t *testing.T, npm string) {
	t.Helper()
	sdkPkg := filepath.Join(tsDir, "node_modules", "@modelcontextprotocol", "sdk", "package.json")
	if _, err := os.Stat(sdkPkg); err != nil {
		t.Logf("installing the TypeScript SDK: npm ci in %s", tsDir)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, npm, "ci", "--no-audit", "--no-fund")
		cmd.Dir = tsDir
		cmd.WaitDelay = 10 * time.Second
		outb, err := cmd.CombinedOutput()
		if err != nil {
			if ctx.Err() != nil {
				err = errors.Join(err, ctx.Err())
			}
			t.Fatalf("npm ci in %s: %v\n%s", tsDir, err, outb)
		}
	}
	b, err := os.ReadFile(sdkPkg)
	if err != nil {
		t.Fatalf("the TypeScript SDK is not installed: %v", err)
	}
	var pkg struct {
		Version string `json:"version"`
	}
	_ = json.Unmarshal(b, &pkg)
	t.Logf("@modelcontextprotocol/sdk %s", pkg.Version)
}

// runTSClient runs client.mjs against url and parses its one JSON line.
func runTSClient(t *testing.T, node, url string) tsOutput {
	t.Helper()
	var out tsOutput
	runNodeScript(t, node, "client.mjs", url, &out)
	return out
}

// runNodeScript runs one of the scripts in test/interop/ts with url and
// decodes the one JSON line it prints into out.
func runNodeScript(t *testing.T, node, script, url string, out any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, script, url)
	cmd.Dir = tsDir
	cmd.WaitDelay = 5 * time.Second
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			err = errors.Join(err, ctx.Err())
		}
		t.Fatalf("node %s %s: %v\nstderr:\n%s\nstdout:\n%s", script, url, err, stderr.String(), stdout.String())
	}
	if stderr.Len() > 0 {
		t.Logf("%s stderr:\n%s", script, stderr.String())
	}
	if os.Getenv("E2E_TRACE") != "" {
		t.Logf("%s stdout:\n%s", script, stdout.String())
	}
	if err := json.Unmarshal(bytes.TrimSpace(stdout.Bytes()), out); err != nil {
		t.Fatalf("%s printed no JSON line (%v):\n%s", script, err, stdout.String())
	}
}

func jsonEqual(a, b json.RawMessage) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xb, _ := json.Marshal(x)
	yb, _ := json.Marshal(y)
	return bytes.Equal(xb, yb)
}

func deref(s *string) any {
	if s == nil {
		return nil
	}
	return *s
}
