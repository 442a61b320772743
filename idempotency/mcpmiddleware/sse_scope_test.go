package mcpmiddleware_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/idempotency/mcpmiddleware"
)

// Two remote clients of a server served over the SDK's legacy SSE handler
// are not one local user: the second client's explicit key must not replay
// the first client's result (the SSE transport sets no RequestExtra).
func TestSSEExplicitKeyNotShared(t *testing.T) {
	server := mcp.NewServer(&mcp.Implementation{Name: "s", Version: "1"}, nil)
	var runs atomic.Int32
	mcp.AddTool(server, &mcp.Tool{Name: "charge_card"}, func(_ context.Context, _ *mcp.CallToolRequest, in chargeIn) (*mcp.CallToolResult, any, error) {
		n := runs.Add(1)
		return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: fmt.Sprintf("secret of caller run %d", n)}}}, nil, nil
	})
	mw, err := mcpmiddleware.New(mcpmiddleware.Options{})
	if err != nil {
		t.Fatal(err)
	}
	server.AddReceivingMiddleware(mw.Handler)
	ts := httptest.NewServer(mcp.NewSSEHandler(func(*http.Request) *mcp.Server { return server }, nil))
	defer ts.Close()
	ctx := context.Background()
	var texts []string
	for range 2 {
		cs, err := mcp.NewClient(&mcp.Implementation{Name: "c", Version: "1"}, nil).Connect(ctx, &mcp.SSEClientTransport{Endpoint: ts.URL}, nil)
		if err != nil {
			t.Fatal(err)
		}
		res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "charge_card", Arguments: map[string]any{"card": "4242", "amount": 1}, Meta: mcp.Meta{"idempotency-key": "order-1"}})
		if err != nil {
			t.Fatal(err)
		}
		texts = append(texts, res.Content[0].(*mcp.TextContent).Text)
		_ = cs.Close()
	}
	if runs.Load() != 2 {
		t.Fatalf("two SSE clients with the same explicit key: tool ran %d times, second got %q (the first client's result)", runs.Load(), texts[1])
	}
}
