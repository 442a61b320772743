package e2e_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/idempotency"
	"github.com/idemcp/idemcp/idempotency/mcpmiddleware"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/test/mcpserver"
)

// inProcess is the counting MCP server with the idemcp middleware inside
// it: no sidecar, no hop.
type inProcess struct {
	*harness
	mw  *mcpmiddleware.Middleware
	url string
}

// verifyToken is a TokenVerifier: "Bearer alice-1" and "Bearer alice-2"
// are two tokens of one user, alice.
func verifyToken(_ context.Context, token string, _ *http.Request) (*auth.TokenInfo, error) {
	user, _, _ := strings.Cut(token, "-")
	return &auth.TokenInfo{UserID: user, Expiration: time.Now().Add(time.Hour)}, nil
}

func newInProcess(t *testing.T, rev revision, opts mcpmiddleware.Options, withAuth bool) *inProcess {
	t.Helper()
	mw, err := mcpmiddleware.New(opts)
	if err != nil {
		t.Fatalf("mcpmiddleware.New: %v", err)
	}
	srv := mcpserver.New()
	srv.MCP.AddReceivingMiddleware(mw.Handler)
	handler := srv.Handler(rev.stateless)
	if withAuth {
		handler = auth.RequireBearerToken(verifyToken, nil)(handler)
	}
	ts := httptest.NewServer(handler)
	t.Cleanup(ts.Close)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = mw.Drain(ctx)
	})
	return &inProcess{harness: &harness{rev: rev, srv: srv}, mw: mw, url: ts.URL}
}

// TestMiddlewareDedup runs the sidecar's dedup scenarios against the
// middleware, with the Go SDK client on 2025-11-25 and 2026-07-28.
func TestMiddlewareDedup(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		p := newInProcess(t, rev, mcpmiddleware.Options{}, false)
		alice := http.Header{"Authorization": {"Bearer alice"}}
		cs := p.connect(t, p.url, clientOpts{headers: alice})

		// Duplicate rate: 10 identical calls run once; 9 are replays.
		first := mustCall(t, cs, "charge_card", card, nil)
		if replayed(first) {
			t.Fatal("the first call is marked replayed")
		}
		for i := range 9 {
			res := mustCall(t, cs, "charge_card", card, nil)
			if !replayed(res) || body(t, res) != body(t, first) {
				t.Fatalf("duplicate %d: replayed %v, body %s; want the first result %s, marked replayed", i, replayed(res), body(t, res), body(t, first))
			}
		}
		if n := p.srv.Counts.Get("charge_card"); n != 1 {
			t.Fatalf("10 identical calls ran charge_card %d times, want 1", n)
		}

		// Concurrent duplicates: 30 at once run once.
		args := map[string]any{"card": "4242", "amount": 30, "delayMs": 300}
		results := make([]string, 30)
		var wg sync.WaitGroup
		for i := range results {
			wg.Go(func() { results[i] = body(t, mustCall(t, cs, "charge_card", args, nil)) })
		}
		wg.Wait()
		allSame(t, results)
		if n := p.srv.Counts.Get("charge_card"); n != 2 {
			t.Fatalf("30 concurrent duplicates ran charge_card %d more times, want 1", n-1)
		}

		// Explicit keys: the same key with other arguments is a conflict.
		key := mcp.Meta{"idempotency-key": "order-9"}
		mustCall(t, cs, "charge_card", map[string]any{"card": "1", "amount": 9}, key)
		_, err := call(context.Background(), cs, "charge_card", map[string]any{"card": "1", "amount": 10}, key)
		if rpcCode(err) != mcpmsg.CodeKeyConflict || !strings.Contains(err.Error(), "idempotency key conflict") {
			t.Fatalf("reusing a key for other arguments: %v, want code %d", err, mcpmsg.CodeKeyConflict)
		}
		_, err = call(context.Background(), cs, "charge_card", card, mcp.Meta{"idempotency-key": "bad\x01key"})
		if rpcCode(err) != mcpmsg.CodeInvalidParams {
			t.Fatalf("an invalid key: %v, want code %d", err, mcpmsg.CodeInvalidParams)
		}
		if n := p.srv.Counts.Get("charge_card"); n != 3 {
			t.Fatalf("charge_card ran %d times, want 3 (the conflict and the bad key run nothing)", n)
		}

		// A tool error is not kept: the retry runs again.
		if res := mustCall(t, cs, "flaky_charge", card, nil); !res.IsError {
			t.Fatal("flaky_charge did not fail the first time")
		}
		if res := mustCall(t, cs, "flaky_charge", card, nil); res.IsError || replayed(res) {
			t.Fatalf("the retry of a failed call was not run again: %s", body(t, res))
		}

		// Auto: a tool the server marks readOnlyHint passes through.
		if _, err := cs.ListTools(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		for range 3 {
			if res := mustCall(t, cs, "get_balance", card, nil); replayed(res) {
				t.Fatal("a read-only tool was replayed")
			}
		}
		if n := p.srv.Counts.Get("get_balance"); n != 3 {
			t.Fatalf("get_balance ran %d times, want 3 (read-only tools are not deduplicated)", n)
		}

		// Another principal never gets alice's result.
		bob := p.connect(t, p.url, clientOpts{headers: http.Header{"Authorization": {"Bearer bob"}}})
		if res := mustCall(t, bob, "charge_card", card, nil); replayed(res) {
			t.Fatal("bob got alice's result")
		}
	})
}

// TestMiddlewarePrincipalFromTokenInfo: under Principal scope, the
// principal is the SDK's TokenInfo.UserID: two tokens of one user share
// results, another user does not.
func TestMiddlewarePrincipalFromTokenInfo(t *testing.T) {
	forEachRevision(t, func(t *testing.T, rev revision) {
		p := newInProcess(t, rev, mcpmiddleware.Options{PolicyYAML: []byte("spec: {keyScope: Principal}")}, true)
		a1 := p.connect(t, p.url, clientOpts{headers: http.Header{"Authorization": {"Bearer alice-1"}}})
		a2 := p.connect(t, p.url, clientOpts{headers: http.Header{"Authorization": {"Bearer alice-2"}}})
		b := p.connect(t, p.url, clientOpts{headers: http.Header{"Authorization": {"Bearer bob-1"}}})
		first := mustCall(t, a1, "charge_card", card, nil)
		if res := mustCall(t, a2, "charge_card", card, nil); !replayed(res) || body(t, res) != body(t, first) {
			t.Fatal("alice's second token, in another session, did not get her first result")
		}
		if res := mustCall(t, b, "charge_card", card, nil); replayed(res) {
			t.Fatal("bob got alice's result")
		}
		if n := p.srv.Counts.Get("charge_card"); n != 2 {
			t.Fatalf("charge_card ran %d times, want 2 (alice once, bob once)", n)
		}
	})
}

// TestMiddlewareServerRestart: with a Redis or Postgres store, a result
// outlives the server process; the retry after a restart is replayed.
func TestMiddlewareServerRestart(t *testing.T) {
	stores := map[string]func(t *testing.T) func() idempotency.Store{
		"Redis": func(t *testing.T) func() idempotency.Store {
			srv := redistest.Start(t)
			return func() idempotency.Store {
				st, err := idempotency.NewRedisStore(idempotency.RedisOptions{Addrs: []string{srv.Addr}, Prefix: "restart:"})
				if err != nil {
					t.Fatal(err)
				}
				return st
			}
		},
		"Postgres": func(t *testing.T) func() idempotency.Store {
			srv := pgtest.Start(t)
			return func() idempotency.Store {
				st, err := idempotency.NewPostgresStore(idempotency.PostgresOptions{URL: srv.URL, Prefix: "restart:"})
				if err != nil {
					t.Fatal(err)
				}
				return st
			}
		},
	}
	for name, setup := range stores {
		t.Run(name, func(t *testing.T) {
			open := setup(t)
			rev := revisions[1]
			key := mcp.Meta{"idempotency-key": "restart-1"}
			alice := http.Header{"Authorization": {"Bearer alice"}}

			st1 := open()
			before := newInProcess(t, rev, mcpmiddleware.Options{Store: st1}, false)
			cs := before.connect(t, before.url, clientOpts{headers: alice})
			first := mustCall(t, cs, "charge_card", card, key)
			_ = cs.Close()
			if err := before.mw.Drain(context.Background()); err != nil {
				t.Fatal(err)
			}
			_ = st1.Close()

			st2 := open()
			t.Cleanup(func() { _ = st2.Close() })
			after := newInProcess(t, rev, mcpmiddleware.Options{Store: st2}, false)
			cs = after.connect(t, after.url, clientOpts{headers: alice})
			res := mustCall(t, cs, "charge_card", card, key)
			if !replayed(res) || body(t, res) != body(t, first) {
				t.Fatalf("the retry after a restart (%s store) was not replayed: %s", name, body(t, res))
			}
			if n := before.srv.Counts.Get("charge_card") + after.srv.Counts.Get("charge_card"); n != 1 {
				t.Fatalf("charge_card ran %d times across the restart, want 1", n)
			}
		})
	}
}

// TestMiddlewareTypeScriptClient drives the middleware with the official
// TypeScript SDK client: a call and its retry, a keyed call and its retry.
func TestMiddlewareTypeScriptClient(t *testing.T) {
	node, npm := lookupNode(t)
	ensureTSDeps(t, npm)
	p := newInProcess(t, revisions[1], mcpmiddleware.Options{}, false)
	out := runTSClient(t, node, p.url)
	if out.ProtocolVersion != p.rev.name {
		t.Errorf("negotiated %q, want %q", out.ProtocolVersion, p.rev.name)
	}
	if len(out.Calls) != 4 {
		t.Fatalf("got %d call results, want 4: %+v", len(out.Calls), out.Calls)
	}
	for i, pair := range [][2]tsCall{{out.Calls[0], out.Calls[1]}, {out.Calls[2], out.Calls[3]}} {
		if pair[0].Replayed || !pair[1].Replayed || pair[0].Text != pair[1].Text || pair[0].IsError {
			t.Errorf("pair %d: first %+v, retry %+v; want the retry replayed with the first result", i, pair[0], pair[1])
		}
	}
	if n := p.srv.Counts.Get("charge_card"); n != 2 {
		t.Fatalf("charge_card ran %d times, want 2 (one per distinct key)", n)
	}
}

// TestMiddlewareTypeScriptDuplicates: the TypeScript SDK client's 20
// concurrent duplicates run once, and its conflicting key is refused.
func TestMiddlewareTypeScriptDuplicates(t *testing.T) {
	node, npm := lookupNode(t)
	ensureTSDeps(t, npm)
	p := newInProcess(t, revisions[1], mcpmiddleware.Options{}, false)
	var out struct {
		ProtocolVersion string `json:"protocolVersion"`
		Concurrent      []struct {
			Text     string `json:"text"`
			Replayed bool   `json:"replayed"`
		} `json:"concurrent"`
		Keyed struct {
			Text string `json:"text"`
		} `json:"keyed"`
		Conflict *struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		} `json:"conflict"`
	}
	runNodeScript(t, node, "dup-client.mjs", p.url, &out)
	replays := 0
	for _, c := range out.Concurrent {
		if c.Text != out.Concurrent[0].Text {
			t.Fatalf("concurrent duplicates got different results: %q and %q", c.Text, out.Concurrent[0].Text)
		}
		if c.Replayed {
			replays++
		}
	}
	if len(out.Concurrent) != 20 || replays != 19 {
		t.Fatalf("%d concurrent results, %d replayed; want 20 with 19 replayed", len(out.Concurrent), replays)
	}
	if out.Conflict == nil || out.Conflict.Code != mcpmsg.CodeKeyConflict || !strings.Contains(out.Conflict.Message, "idempotency key conflict") {
		t.Fatalf("the conflicting key got %+v, want code %d", out.Conflict, mcpmsg.CodeKeyConflict)
	}
	if n := p.srv.Counts.Get("charge_card"); n != 2 {
		t.Fatalf("charge_card ran %d times, want 2 (the duplicates once, the keyed call once)", n)
	}
	t.Logf("TypeScript SDK (%s): 20 concurrent duplicates ran once; conflict answered %d", out.ProtocolVersion, out.Conflict.Code)
}
