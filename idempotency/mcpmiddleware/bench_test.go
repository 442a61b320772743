package mcpmiddleware_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/idempotency/mcpmiddleware"
)

// BenchmarkMiddleware measures a tools/call from a Go SDK client to a Go
// SDK server on an in-memory connection: Direct without idemcp, then with
// the middleware (memory store) for a call that runs and for a replay.
// The middleware adds no hop; this is its whole cost.
func BenchmarkMiddleware(b *testing.B) {
	connect := func(b *testing.B, withMiddleware bool) *mcp.ClientSession {
		server := mcp.NewServer(&mcp.Implementation{Name: "bench", Version: "1.0.0"}, nil)
		mcp.AddTool(server, &mcp.Tool{Name: "charge_card"}, func(_ context.Context, _ *mcp.CallToolRequest, in chargeIn) (*mcp.CallToolResult, any, error) {
			return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: fmt.Sprintf("charged %.2f to %s", in.Amount, in.Card)}}}, nil, nil
		})
		if withMiddleware {
			mw, err := mcpmiddleware.New(mcpmiddleware.Options{})
			if err != nil {
				b.Fatal(err)
			}
			server.AddReceivingMiddleware(mw.Handler)
		}
		ctx := context.Background()
		st, ct := mcp.NewInMemoryTransports()
		if _, err := server.Connect(ctx, st, nil); err != nil {
			b.Fatal(err)
		}
		cs, err := mcp.NewClient(&mcp.Implementation{Name: "bench", Version: "1.0.0"}, nil).Connect(ctx, ct, nil)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = cs.Close() })
		return cs
	}
	call := func(b *testing.B, cs *mcp.ClientSession, amount int) {
		_, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: "charge_card", Arguments: map[string]any{"card": "4242", "amount": amount}})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.Run("Direct", func(b *testing.B) {
		cs := connect(b, false)
		for i := range b.N {
			call(b, cs, i)
		}
	})
	b.Run("Executed", func(b *testing.B) {
		cs := connect(b, true)
		for i := range b.N {
			call(b, cs, i)
		}
	})
	b.Run("Replay", func(b *testing.B) {
		cs := connect(b, true)
		call(b, cs, -1)
		for range b.N {
			call(b, cs, -1)
		}
	})
}
