package e2e_test

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// TestNPMToolListedOnlyForACapability: server-everything registers
// get-roots-list (readOnlyHint) only for clients that declare the roots
// capability, so the sidecar's own listing, which declares none, never
// names it. The sidecar lists the tools again in the calling client's
// context (its declared capabilities) and passes the read through: after
// the client's roots change, the next call shows them, as it does
// directly and through idemcp wrap (which lists in the client's own
// session), instead of a replay of the first answer.
func TestNPMToolListedOnlyForACapability(t *testing.T) {
	node, npm := lookupNode(t)
	ensureTSDeps(t, npm)
	upstream := startNodeHTTP(t, node, nil, npmServer(t, "server-everything"), "streamableHttp")
	sidecarURL, logs := startSidecarBin(t, upstream)
	bins := buildWrapBins(t)
	for _, r := range []struct {
		name      string
		transport func() mcp.Transport
	}{
		{"direct", func() mcp.Transport { return &mcp.StreamableClientTransport{Endpoint: upstream + "/mcp"} }},
		{"sidecar", func() mcp.Transport { return &mcp.StreamableClientTransport{Endpoint: sidecarURL + "/mcp"} }},
		{"wrap", func() mcp.Transport {
			cmd := exec.Command(bins.idemcp, "wrap", "--retry-window", npmWindow.String(), "--", node, npmServer(t, "server-everything"), "stdio")
			cmd.Stderr = &lockedBuffer{}
			return &mcp.CommandTransport{Command: cmd}
		}},
	} {
		t.Run(r.name, func(t *testing.T) {
			client := mcp.NewClient(&mcp.Implementation{Name: "e2e-roots-client", Version: "1.0.0"}, nil)
			//nolint:staticcheck // the server under test is the roots capability's: its tool is listed only to clients that declare roots (deprecated from 2026-07-28, served by 2025-11-25)
			client.AddRoots(&mcp.Root{URI: "file:///first", Name: "first"})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cs, err := client.Connect(ctx, r.transport(), nil)
			if err != nil {
				t.Fatalf("connecting %s: %v", r.name, err)
			}
			t.Cleanup(func() { _ = cs.Close() })
			first := npmCall(t, cs, "get-roots-list", nil, nil)
			if !strings.Contains(textOf(first), "file:///first") || replayed(first) {
				t.Fatalf("get-roots-list = %q (replayed %v), want the client's root file:///first", textOf(first), replayed(first))
			}
			//nolint:staticcheck // as above
			client.AddRoots(&mcp.Root{URI: "file:///second", Name: "second"})
			deadline := time.Now().Add(10 * time.Second)
			for {
				res := npmCall(t, cs, "get-roots-list", nil, nil)
				if replayed(res) {
					t.Fatalf("get-roots-list (readOnlyHint, listed only to clients with roots) was replayed: %q", textOf(res))
				}
				if strings.Contains(textOf(res), "file:///second") {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("get-roots-list never showed the new root: %q", textOf(res))
				}
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
	if strings.Contains(logs.String(), `"tool":"get-roots-list"`) && strings.Contains(logs.String(), "no tools/list has named") {
		t.Errorf("the sidecar took get-roots-list for an unknown tool:\n%s", logs.String())
	}
}
