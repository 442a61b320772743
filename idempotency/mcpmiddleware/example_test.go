package mcpmiddleware_test

import (
	"context"
	"fmt"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/idempotency/mcpmiddleware"
)

type chargeIn struct {
	Card   string  `json:"card"`
	Amount float64 `json:"amount"`
}

// A Go MCP server whose charge tool runs once per idempotency key.
func Example() {
	server := mcp.NewServer(&mcp.Implementation{Name: "payments", Version: "1.0.0"}, nil)
	charges := 0
	mcp.AddTool(server, &mcp.Tool{Name: "charge_card"}, func(_ context.Context, _ *mcp.CallToolRequest, in chargeIn) (*mcp.CallToolResult, any, error) {
		charges++
		return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: fmt.Sprintf("charge #%d: %.2f to %s", charges, in.Amount, in.Card)}}}, nil, nil
	})
	mw, err := mcpmiddleware.New(mcpmiddleware.Options{PolicyYAML: []byte(`spec: {ttl: 72h, keyScope: Principal}`), LocalClient: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	server.AddReceivingMiddleware(mw.Handler)

	// A client on an in-memory connection, for the example's sake.
	ctx := context.Background()
	st, ct := mcp.NewInMemoryTransports()
	if _, err := server.Connect(ctx, st, nil); err != nil {
		fmt.Println(err)
		return
	}
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "agent", Version: "1.0.0"}, nil).Connect(ctx, ct, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = cs.Close() }()
	for range 2 {
		res, err := cs.CallTool(ctx, &mcp.CallToolParams{
			Name:      "charge_card",
			Arguments: map[string]any{"card": "4242", "amount": 12.5},
			Meta:      mcp.Meta{"idempotency-key": "order-77"},
		})
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(res.Content[0].(*mcp.TextContent).Text, "replayed:", res.Meta["idemcp.io/replayed"] == true)
	}
	// Output:
	// charge #1: 12.50 to 4242 replayed: false
	// charge #1: 12.50 to 4242 replayed: true
}
