package main

import (
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/freeport"
)

const initialize = `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}`

// TestKeepsTheSDKsRebindingProtection: the real-node e2e's server behaves
// as an unmodified Go SDK server, refusing a Service's Host over loopback
// (what a sidecar forwarding to 127.0.0.1 would send), unless told not to.
func TestKeepsTheSDKsRebindingProtection(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "httpserver")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	for _, tc := range []struct {
		args []string
		host string
		want int
	}{
		{nil, "mcp.shop.svc:80", http.StatusForbidden},
		{nil, "", http.StatusOK}, // the address itself: loopback
		{[]string{"-localhost-protection=false"}, "mcp.shop.svc:80", http.StatusOK},
	} {
		addr := freeport.Loopback(t)
		cmd := exec.Command(bin, append([]string{"-listen", addr}, tc.args...)...)
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		got := 0
		for deadline := time.Now().Add(10 * time.Second); got == 0 && time.Now().Before(deadline); {
			req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+addr+"/mcp", strings.NewReader(initialize))
			if tc.host != "" {
				req.Host = tc.host
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Accept", "application/json, text/event-stream")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				time.Sleep(20 * time.Millisecond) // not listening yet
				continue
			}
			_ = resp.Body.Close()
			got = resp.StatusCode
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if got != tc.want {
			t.Errorf("httpserver %v, Host %q over loopback: HTTP %d, want %d", tc.args, tc.host, got, tc.want)
		}
	}
}
