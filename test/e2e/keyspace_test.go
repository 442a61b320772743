package e2e_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/internal/storeopen"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/test/mcpserver"
)

// TestKeySpacePerWorkloadOnOneRedis: sidecars of four workloads under one
// policy share one Redis and the policy's key prefix, as the webhook
// injects them, each with the key space the webhook gives it. The same
// principal calls charge_card with the same arguments on each: orders
// and billing each run it once and replay only their own result; the
// blue/green pair that shares idemcp.io/key-space: checkout runs it once
// between them.
func TestKeySpacePerWorkloadOnOneRedis(t *testing.T) {
	rdb := redistest.Start(t)
	type workload struct {
		keySpace string
		server   *mcpserver.Server
		cs       *mcp.ClientSession
	}
	workloads := map[string]*workload{
		"orders":         {keySpace: "Deployment/orders"},
		"billing":        {keySpace: "Deployment/billing"},
		"checkout-blue":  {keySpace: "key-space/checkout"},
		"checkout-green": {keySpace: "key-space/checkout"},
	}
	for name, w := range workloads {
		w.server = mcpserver.New()
		upstream := httptest.NewServer(w.server.Handler(false))
		t.Cleanup(upstream.Close)
		sc, err := sidecar.New(sidecar.Options{Upstream: upstream.URL, LogLevel: "error", KeySpace: w.keySpace,
			Policy: "spec: {keyScope: Principal, tools: [{name: charge_card, mode: Deduplicate}]}",
			Store:  storeopen.Options{Kind: "redis", RedisAddrs: rdb.Addr, RedisKeyPrefix: "idemcp:shop/payments:"}})
		if err != nil {
			t.Fatalf("%s: sidecar.New: %v", name, err)
		}
		proxy := httptest.NewServer(sc.Handler())
		t.Cleanup(proxy.Close)
		client := mcp.NewClient(&mcp.Implementation{Name: "e2e-" + name, Version: "1"}, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		w.cs, err = client.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: proxy.URL,
			HTTPClient: &http.Client{Transport: &headerTransport{headers: http.Header{"Authorization": {"Bearer alice"}}, next: http.DefaultTransport}}}, nil)
		cancel()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Cleanup(func() { _ = w.cs.Close() })
	}
	args := map[string]any{"card": "4242", "amount": 10}
	for _, name := range []string{"orders", "billing", "checkout-blue", "checkout-green"} {
		w := workloads[name]
		for i := range 2 {
			res := mustCall(t, w.cs, "charge_card", args, nil)
			wantReplayed := i > 0 || name == "checkout-green"
			if replayed(res) != wantReplayed {
				t.Errorf("%s, call %d: replayed %v, want %v", name, i+1, replayed(res), wantReplayed)
			}
		}
	}
	for name, want := range map[string]int{"orders": 1, "billing": 1, "checkout-blue": 1, "checkout-green": 0} {
		if n := workloads[name].server.Counts.Get("charge_card"); n != want {
			t.Errorf("%s's server charged %d times, want %d", name, n, want)
		}
	}
}
