package push

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/test/mcpserver"
)

// TestPassthroughToDeduplicateUnderLoad: a real `idemcp sidecar` in front
// of a real MCP server gets the change from Passthrough to Deduplicate
// while a client calls without pause. Every call is answered; each call
// pair (a call and its retry) runs twice before the switch and once after,
// from the first pair that starts after the sidecar applied it.
func TestPassthroughToDeduplicateUnderLoad(t *testing.T) {
	const ns, name = "push-switch", "payments"
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t))
	spec := v1alpha1.IdempotencyPolicySpec{Tools: []v1alpha1.ToolRule{{Name: "charge_card", Mode: v1alpha1.ModePassthrough}}}
	createPolicy(t, ns, name, spec)
	server := mcpserver.New()
	sc, listen := startPushedSidecar(t, mgr, ns, name, spec, server)
	waitStatus(t, ns, name, 20*time.Second, synced(1, hashOf(t, spec)))

	cl := mcp.NewClient(&mcp.Implementation{Name: "push-test", Version: "1"}, nil)
	cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ccancel()
	cs, err := cl.Connect(cctx, &mcp.StreamableClientTransport{Endpoint: "http://" + listen, MaxRetries: -1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.Close() })

	type pair struct {
		i          int
		startedNew bool // the sidecar enforced the new policy before the pair began
		updated    bool // the change was sent before the pair began
		ran        int
		at         time.Time
	}
	var pairs []pair
	var newHash string
	var updatedAt time.Time
	afterSwitch := 0
	for i := 0; afterSwitch < 15; i++ {
		if i == 10 {
			updatedAt = time.Now()
			newHash = updatePolicy(t, ns, name, func(s *v1alpha1.IdempotencyPolicySpec) { s.Tools[0].Mode = v1alpha1.ModeDeduplicate })
		}
		if i > 500 {
			t.Fatal("the change never reached the sidecar")
		}
		p := pair{i: i, at: time.Now(), updated: newHash != "", startedNew: newHash != "" && sc.Engine().Policy().Hash == newHash}
		before := server.Counts.Get("charge_card")
		args := map[string]any{"card": fmt.Sprintf("card-%d", i), "amount": i}
		for try := range 2 {
			res, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: "charge_card", Arguments: args})
			if err != nil || res.IsError {
				t.Fatalf("pair %d, call %d was not answered: %v %+v", i, try, err, res)
			}
		}
		p.ran = server.Counts.Get("charge_card") - before
		pairs = append(pairs, p)
		if p.startedNew {
			afterSwitch++
		}
	}
	first := -1
	var firstAt time.Time
	for _, p := range pairs {
		switch {
		case p.startedNew:
			if first < 0 {
				first, firstAt = p.i, p.at
			}
			if p.ran != 1 {
				t.Fatalf("pair %d began under Deduplicate and ran %d times, want 1", p.i, p.ran)
			}
		case p.updated:
			// Sent after the change and before the sidecar was seen to
			// enforce it: Passthrough, or straddling the switch (the first
			// call was not recorded, so the retry runs once more), or both
			// calls under the new policy if it arrived just after the
			// check. Never a third time, never not at all.
			if p.ran != 1 && p.ran != 2 {
				t.Fatalf("pair %d, sent as the change arrived, ran %d times, want 1 or 2", p.i, p.ran)
			}
		default:
			if p.ran != 2 {
				t.Fatalf("pair %d under Passthrough ran %d times, want 2", p.i, p.ran)
			}
		}
	}
	took := firstAt.Sub(updatedAt)
	t.Logf("%d pairs; the switch took effect from pair %d, %s after the update (sent before pair 10)", len(pairs), first, took)
	if took > time.Second {
		t.Fatalf("the change took effect %s after it was made, want under 1s", took)
	}
}
