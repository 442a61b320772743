package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/internal/storeopen"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/test/poll"
)

// rawUpstream is a hand-written MCP endpoint that answers every tools/call
// with result as is, as JSON or as one SSE event: SDK servers never send a
// result that is not an object, some servers do. It counts the tools/call
// requests and the notifications/cancelled it gets.
type rawUpstream struct {
	*httptest.Server
	calls, cancels atomic.Int64
}

func newRawUpstream(t *testing.T, result string, sse bool, delay time.Duration) *rawUpstream {
	t.Helper()
	u := &rawUpstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var msg struct {
			ID     json.RawMessage `json:"id"`
			Method string          `json:"method"`
		}
		_ = json.Unmarshal(readBody(r), &msg)
		switch msg.Method {
		case "notifications/cancelled":
			u.cancels.Add(1)
			w.WriteHeader(http.StatusAccepted)
			return
		case "tools/call":
			u.calls.Add(1)
		}
		time.Sleep(delay)
		resp := fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,"result":%s}`, msg.ID, result)
		if sse {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = fmt.Fprintf(w, "event: message\ndata: %s\n\n", resp)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(resp))
	}))
	t.Cleanup(u.Close)
	return u
}

// A result that is null, an array, a string, a number or a boolean, or an
// object whose _meta is null or not an object, is relayed, stored and
// replayed; the sidecar survives every one of them (it used to panic).
func TestAnyResultThroughTheSidecar(t *testing.T) {
	results := []struct{ result, replay string }{
		{`null`, `null`},
		{`[]`, `[]`},
		{`"x"`, `"x"`},
		{`5`, `5`},
		{`true`, `true`},
		{`{"_meta":null,"content":[]}`, `{"_meta":{"idemcp.io/replayed":true},"content":[]}`},
		{`{"_meta":7}`, `{"_meta":7}`},
	}
	auth := http.Header{"Authorization": {"Bearer agent"}}
	for _, sse := range []bool{false, true} {
		for _, tt := range results {
			t.Run(fmt.Sprintf("sse=%v/%s", sse, tt.result), func(t *testing.T) {
				t.Parallel()
				up := newRawUpstream(t, tt.result, sse, 0)
				_, proxy := startSidecar(t, up.URL, "")
				for i := range 3 {
					body := fmt.Sprintf(`{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"charge_card","arguments":{"amount":5}}}`, i+1)
					resp, r := post(t, proxy.URL, body, auth)
					if resp.StatusCode != http.StatusOK || r.Error != nil {
						t.Fatalf("call %d: HTTP %d, error %+v", i+1, resp.StatusCode, r.Error)
					}
					want, replayed := tt.result, i > 0
					if replayed {
						want = tt.replay
					}
					if string(r.Result) != want || string(r.ID) != fmt.Sprint(i+1) {
						t.Errorf("call %d: id %s result %s, want id %d result %s", i+1, r.ID, r.Result, i+1, want)
					}
					if got := resp.Header.Get("Idempotent-Replayed") == "true"; got != replayed {
						t.Errorf("call %d: Idempotent-Replayed header = %v, want %v", i+1, got, replayed)
					}
				}
				if n := up.calls.Load(); n != 1 {
					t.Errorf("the tool ran %d times, want 1", n)
				}
			})
		}
	}
}

// On a stateless server, two anonymous agents (no session, no
// Authorization) calling the same tool with the same arguments are two
// charges, not one: their derived keys would have no scope. With
// Authorization, the same agent's retry runs once.
func TestAnonymousCallersAreNeverShared(t *testing.T) {
	h := newHarness(t, revisions[0], "", nil) // 2026-07-28: stateless
	args := map[string]any{"card": "4242", "amount": 5}
	a := h.connect(t, h.proxy.URL, clientOpts{anonymous: true})
	b := h.connect(t, h.proxy.URL, clientOpts{anonymous: true})
	mustCall(t, a, "charge_card", args, nil)
	res := mustCall(t, b, "charge_card", args, nil)
	if replayed(res) {
		t.Error("an anonymous agent got another's result replayed")
	}
	if n := h.srv.Counts.Get("charge_card"); n != 2 {
		t.Fatalf("two anonymous agents' charges ran %d times, want 2", n)
	}
	// An explicit key from a caller with neither principal nor session
	// has no scope either: another anonymous agent could pick the same key
	// and read the result. It is forwarded without dedup and counted.
	key := map[string]any{"idempotency-key": "order-77"}
	mustCall(t, a, "refund", args, key)
	if replayed(mustCall(t, b, "refund", args, key)) {
		t.Error("an anonymous agent got another's result through the same explicit key")
	}
	if n := h.srv.Counts.Get("refund"); n != 2 {
		t.Errorf("two anonymous agents' refunds with one explicit key ran %d times, want 2", n)
	}
	if n := h.sidecar.Engine().Unscoped(); n != 4 {
		t.Errorf("Unscoped() = %d, want the 2 anonymous charges and the 2 refunds", n)
	}

	alice := http.Header{"Authorization": {"Bearer alice"}}
	c1 := h.connect(t, h.proxy.URL, clientOpts{headers: alice})
	c2 := h.connect(t, h.proxy.URL, clientOpts{headers: alice})
	other := map[string]any{"card": "4242", "amount": 6}
	mustCall(t, c1, "charge_card", other, nil)
	if !replayed(mustCall(t, c2, "charge_card", other, nil)) {
		t.Error("the same principal's retry was not replayed")
	}
	if n := h.srv.Counts.Get("charge_card"); n != 3 {
		t.Errorf("charge_card ran %d times in all, want 2 anonymous + 1 for alice", n)
	}
}

// On a server with sessions, an anonymous caller's explicit key is its
// session's: two anonymous sessions using the same key each run their own
// call and never see the other's result, while a retry in the same
// session is replayed.
func TestAnonymousSessionsDoNotShareExplicitKeys(t *testing.T) {
	h := newHarness(t, revisions[1], "", nil) // 2025-11-25: sessions
	a := h.connect(t, h.proxy.URL, clientOpts{anonymous: true})
	b := h.connect(t, h.proxy.URL, clientOpts{anonymous: true})
	key := map[string]any{"idempotency-key": "order-77"}
	first := mustCall(t, a, "charge_card", map[string]any{"card": "4242", "amount": 5}, key)
	res := mustCall(t, b, "charge_card", map[string]any{"card": "4242", "amount": 5}, key)
	if replayed(res) {
		t.Errorf("session B got session A's result through the same explicit key: %v", res.Content)
	}
	if n := h.srv.Counts.Get("charge_card"); n != 2 {
		t.Errorf("two anonymous sessions' charges with one explicit key ran %d times, want 2", n)
	}
	if !replayed(mustCall(t, a, "charge_card", map[string]any{"card": "4242", "amount": 5}, key)) {
		t.Error("session A's retry with its explicit key was not replayed")
	}
	// B reusing the key with other arguments is its own business: no
	// conflict with A's call, which B cannot see.
	if _, err := call(context.Background(), b, "charge_card", map[string]any{"card": "4242", "amount": 9}, key); rpcCode(err) != mcpmsg.CodeKeyConflict {
		t.Errorf("B reusing its own key with other arguments: %v; want its own key conflict (%d)", err, mcpmsg.CodeKeyConflict)
	}
	if first == nil || len(first.Content) == 0 {
		t.Error("session A's first call returned no content")
	}
}

// A cancel from an anonymous caller reaches the server even while another
// anonymous caller has a deduplicated call with the same JSON-RPC id: a
// caller with no scope has nothing to match.
func TestAnonymousCancelIsNotSwallowedForAnother(t *testing.T) {
	up := newRawUpstream(t, `{"content":[]}`, false, 600*time.Millisecond)
	_, proxy := startSidecar(t, up.URL, "")
	var wg sync.WaitGroup
	wg.Go(func() {
		// A: deduplicated through its explicit key, request id 7.
		post(t, proxy.URL, `{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge_card","arguments":{},"_meta":{"idempotency-key":"a-1"}}}`, nil)
	})
	poll.Within(t, 10*time.Second, "A's call to reach the server", poll.True(func() bool { return up.calls.Load() == 1 }))
	// B cancels its own request 7.
	resp, _ := post(t, proxy.URL, `{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":7}}`, nil)
	if resp.StatusCode != http.StatusAccepted {
		t.Errorf("cancel answered HTTP %d", resp.StatusCode)
	}
	wg.Wait()
	if n := up.cancels.Load(); n != 1 {
		t.Errorf("the server got %d cancels, want B's 1", n)
	}
	// A caller with a principal still has its own cancel kept from the
	// server while its deduplicated call runs.
	alice := http.Header{"Authorization": {"Bearer alice"}}
	wg.Go(func() {
		post(t, proxy.URL, `{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"charge_card","arguments":{"x":1}}}`, alice)
	})
	poll.Within(t, 10*time.Second, "alice's call to reach the server", poll.True(func() bool { return up.calls.Load() == 2 }))
	post(t, proxy.URL, `{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":8}}`, alice)
	wg.Wait()
	if n := up.cancels.Load(); n != 1 {
		t.Errorf("alice's cancel of her deduplicated call reached the server (%d cancels)", n)
	}
}

// Two different MCP servers, each behind a sidecar run by hand with the
// same Redis and no --redis-key-prefix, never replay each other's results:
// the default prefix names the upstream.
func TestTwoServersOneRedisDoNotShare(t *testing.T) {
	srv := redistest.Start(t)
	policy := "apiVersion: idemcp.io/v1alpha1\nkind: IdempotencyPolicy\nmetadata: {name: shared}\nspec:\n  keyScope: Global\n"
	var upstreams []*mcpserver.Server
	var proxies, upURLs []string
	for range 2 {
		s := mcpserver.New()
		up := httptest.NewServer(s.Handler(true))
		t.Cleanup(up.Close)
		upstreams, upURLs = append(upstreams, s), append(upURLs, up.URL)
		proxies = append(proxies, newSidecarFor(t, up.URL, policy, srv.Addr))
	}
	h := &harness{rev: revisions[0]}
	args := map[string]any{"card": "4242", "amount": time.Now().UnixNano() % 1_000_000}
	for i, p := range proxies {
		cs := h.connect(t, p, clientOpts{})
		for range 2 {
			mustCall(t, cs, "charge_card", args, nil)
		}
		if n := upstreams[i].Counts.Get("charge_card"); n != 1 {
			t.Errorf("server %d ran charge_card %d times, want 1 (its own call, then its own replay)", i, n)
		}
	}
	// A second sidecar in front of the first server (a replica) shares its
	// key space, and replays its result.
	replica := newSidecarFor(t, upURLs[0], policy, srv.Addr)
	if !replayed(mustCall(t, h.connect(t, replica, clientOpts{}), "charge_card", args, nil)) {
		t.Error("a second sidecar of the same server did not replay its result")
	}
	if n := upstreams[0].Counts.Get("charge_card"); n != 1 {
		t.Errorf("server 0 ran charge_card %d times, want 1", n)
	}
}

func newSidecarFor(t *testing.T, upstream, policy, redisAddr string) string {
	t.Helper()
	sc, err := sidecar.New(sidecar.Options{Upstream: upstream, PolicyFile: writePolicy(t, policy), LogLevel: "error",
		Store: storeopen.Options{Kind: "redis", RedisAddrs: redisAddr}})
	if err != nil {
		t.Fatal(err)
	}
	p := httptest.NewServer(sc.Handler())
	t.Cleanup(p.Close)
	return p.URL
}
