package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// pollingOutput is what test/interop/ts/polling-client.mjs prints.
type pollingOutput struct {
	ProtocolVersion string        `json:"protocolVersion"`
	Sequential      []pollingCall `json:"sequential"`
	Concurrent      []pollingCall `json:"concurrent"`
}

type pollingCall struct {
	Text     string `json:"text"`
	Replayed bool   `json:"replayed"`
	IsError  bool   `json:"isError"`
	Error    string `json:"error"`
}

// TestStreamPollingRunsOnce puts the sidecar in front of a TypeScript SDK
// server that uses stream polling (2025-11-25, SEP-1699): its tool closes
// the POST's SSE stream after the priming event and answers on the GET
// that resumes it. The outcome of such a call is pending, not failed: the
// sidecar taps the client's resumed stream for the response, or resumes
// the stream itself when the client does not, and stores it.
func TestStreamPollingRunsOnce(t *testing.T) {
	node, npm := lookupNode(t)
	ensureTSDeps(t, npm)
	upstream := startPollingServer(t, node)
	executions := func() int {
		resp, err := http.Get(upstream + "/executions")
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = resp.Body.Close() }()
		var m map[string]int
		if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
			t.Fatal(err)
		}
		return m["charge_card"]
	}
	_, proxy := startSidecar(t, upstream, "")

	t.Run("client resumes", func(t *testing.T) {
		before := executions()
		var out pollingOutput
		runNodeScript(t, node, "polling-client.mjs", proxy.URL+"/mcp", &out)
		if out.ProtocolVersion != "2025-11-25" {
			t.Errorf("negotiated %q, want 2025-11-25 (stream polling needs it)", out.ProtocolVersion)
		}
		checkPollingCalls(t, "sequential", out.Sequential, 6, "charged 5 to 4242")
		checkPollingCalls(t, "concurrent", out.Concurrent, 20, "charged 7 to 4242")
		if n := executions() - before; n != 2 {
			t.Fatalf("charge_card ran %d times through the sidecar for 6 sequential and 20 concurrent identical calls, want 2", n)
		}
	})

	t.Run("client does not resume", func(t *testing.T) {
		before := executions()
		c := newRawSession(t, proxy.URL+"/mcp")
		call := `{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"charge_card","arguments":{"card":"4242","amount":9}}}`
		// The first call's stream ends after the priming event; this client
		// never resumes it.
		first := c.post(t, fmt.Sprintf(call, 2))
		if !strings.Contains(first, "id:") || strings.Contains(first, `"result"`) {
			t.Fatalf("the first call's stream = %q; want a priming event with an id and no response (the server polls)", first)
		}
		retry := c.post(t, fmt.Sprintf(call, 3))
		if !strings.Contains(retry, `"id":3`) || !strings.Contains(retry, "charged 9 to 4242") || !strings.Contains(retry, `"idemcp.io/replayed":true`) {
			t.Fatalf("the retry got %q; want the first call's result replayed with its own id", retry)
		}
		if n := executions() - before; n != 1 {
			t.Fatalf("charge_card ran %d times for a call and its retry, want 1", n)
		}
	})

	t.Run("direct control", func(t *testing.T) {
		before := executions()
		var out pollingOutput
		runNodeScript(t, node, "polling-client.mjs", upstream+"/mcp", &out)
		for _, c := range append(out.Sequential, out.Concurrent...) {
			if c.IsError || c.Replayed {
				t.Errorf("direct call: %+v", c)
			}
		}
		if n := executions() - before; n != 26 {
			t.Fatalf("charge_card ran %d times straight at the server, want 26 (every call), or the test proves nothing", n)
		}
	})
}

// checkPollingCalls checks that n identical calls all got the one result,
// and all but one as replays.
func checkPollingCalls(t *testing.T, label string, calls []pollingCall, n int, prefix string) {
	t.Helper()
	if len(calls) != n {
		t.Fatalf("%s: %d results, want %d", label, len(calls), n)
	}
	fresh := 0
	for i, c := range calls {
		if c.IsError || !strings.HasPrefix(c.Text, prefix) || c.Text != calls[0].Text {
			t.Errorf("%s call %d: %+v; want %q like the first", label, i+1, c, calls[0].Text)
		}
		if !c.Replayed {
			fresh++
		}
	}
	if fresh != 1 {
		t.Errorf("%s: %d results not marked replayed, want 1 (the call that ran)", label, fresh)
	}
}

// startPollingServer runs test/interop/ts/polling-server.mjs and returns
// its base URL.
func startPollingServer(t *testing.T, node string) string {
	t.Helper()
	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, node, "polling-server.mjs")
	cmd.Dir = tsDir
	cmd.Env = append(os.Environ(), "PORT="+port, "RETRY_MS=300")
	cmd.WaitDelay = 5 * time.Second
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatalf("starting %s: %v", filepath.Join(tsDir, "polling-server.mjs"), err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cancel()
		werr := <-exited
		if t.Failed() || os.Getenv("E2E_TRACE") != "" {
			t.Logf("polling-server (%v) output:\n%s", werr, logs.String())
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(logs.String(), "listening") {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("polling-server exited before listening: %v\n%s", err, logs.String())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("polling-server did not listen within 30s:\n%s", logs.String())
		}
	}
	return "http://127.0.0.1:" + port
}

// rawSession is a 2025-11-25 client written by hand: it never resumes a
// stream.
type rawSession struct {
	url, session string
}

func newRawSession(t *testing.T, url string) *rawSession {
	t.Helper()
	c := &rawSession{url: url}
	c.post(t, `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"raw","version":"1"}}}`)
	if c.session == "" {
		t.Fatal("initialize through the sidecar gave no Mcp-Session-Id")
	}
	c.post(t, `{"jsonrpc":"2.0","method":"notifications/initialized"}`)
	return c
}

// post sends one message and returns the whole response body.
func (c *rawSession) post(t *testing.T, body string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Mcp-Protocol-Version", "2025-11-25")
	if c.session != "" {
		req.Header.Set("Mcp-Session-Id", c.session)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the response to %s: %v", body, err)
	}
	if s := resp.Header.Get("Mcp-Session-Id"); s != "" {
		c.session = s
	}
	return string(data)
}
