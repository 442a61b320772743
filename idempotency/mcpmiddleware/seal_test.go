package mcpmiddleware_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"log/slog"
	"testing"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/idempotency"
	"github.com/idemcp/idemcp/idempotency/mcpmiddleware"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// The seal keys a shared store is opened with reach the middleware's
// calls: a result planted in Redis by someone without the key is not
// replayed, and the tool runs.
func TestMiddlewareSealedStore(t *testing.T) {
	srv := redistest.Start(t)
	open := func(opts ...idempotency.StoreOption) idempotency.Store {
		st, err := idempotency.NewRedisStore(idempotency.RedisOptions{Addrs: []string{srv.Addr}, Prefix: "mw:"},
			append(opts, idempotency.StoreLogger(slog.New(slog.DiscardHandler)))...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.Close() })
		return st
	}
	key := make([]byte, idempotency.SealKeyBytes)
	_, _ = rand.Read(key)
	call := func(st idempotency.Store, text string) string {
		t.Helper()
		server := mcp.NewServer(&mcp.Implementation{Name: "payments", Version: "1"}, nil)
		mcp.AddTool(server, &mcp.Tool{Name: "charge_card"}, func(context.Context, *mcp.CallToolRequest, chargeIn) (*mcp.CallToolResult, any, error) {
			return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: text}}}, nil, nil
		})
		mw, err := mcpmiddleware.New(mcpmiddleware.Options{Store: st, LocalClient: true})
		if err != nil {
			t.Fatal(err)
		}
		server.AddReceivingMiddleware(mw.Handler)
		ctx := context.Background()
		sst, cst := mcp.NewInMemoryTransports()
		if _, err := server.Connect(ctx, sst, nil); err != nil {
			t.Fatal(err)
		}
		cs, err := mcp.NewClient(&mcp.Implementation{Name: "agent", Version: "1"}, nil).Connect(ctx, cst, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = cs.Close() }()
		res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "charge_card", Arguments: map[string]any{"card": "4242", "amount": 5}, Meta: mcp.Meta{"idempotency-key": "order-1"}})
		if err != nil {
			t.Fatal(err)
		}
		return res.Content[0].(*mcp.TextContent).Text
	}
	if got := call(open(), "planted"); got != "planted" {
		t.Fatalf("planting: %q", got)
	}
	if got := call(open(), "charged"); got != "planted" {
		t.Fatalf("through another unsealed store the call got %q; the threat is the planted result replayed", got)
	}
	sealed := open(idempotency.SealKeyring(base64.StdEncoding.EncodeToString(key)))
	if got := call(sealed, "charged"); got != "charged" {
		t.Fatalf("through a sealed store the call got %q; want the tool to run, not the planted result", got)
	}
	if got := call(sealed, "charged again"); got != "charged" {
		t.Fatalf("the retry got %q; want the sealed result replayed", got)
	}
}
