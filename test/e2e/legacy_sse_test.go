package e2e_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/test/poll"
)

// legacyHarness is the counting server behind the Go SDK's legacy
// HTTP+SSE (2024-11-05) handler, with a sidecar in front of it.
type legacyHarness struct {
	srv      *mcpserver.Server
	upstream *httptest.Server
	proxy    *httptest.Server

	streams   atomic.Int64 // GET streams open at the server
	callPosts chan struct{}
}

func newLegacyHarness(t *testing.T, policyYAML string) *legacyHarness {
	t.Helper()
	h := &legacyHarness{srv: mcpserver.New(), callPosts: make(chan struct{}, 100)}
	sse := mcp.NewSSEHandler(func(*http.Request) *mcp.Server { return h.srv.MCP }, nil)
	h.upstream = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case http.MethodGet:
			h.streams.Add(1)
			defer h.streams.Add(-1)
		case http.MethodPost:
			if isChargeCall(readBody(r)) {
				select {
				case h.callPosts <- struct{}{}:
				default:
				}
			}
		}
		sse.ServeHTTP(w, r)
	}))
	t.Cleanup(h.upstream.Close)

	_, h.proxy = startSidecar(t, h.upstream.URL, policyYAML)
	return h
}

// connect opens a Go SDK client session over the legacy SSE transport.
// The transport's GET stream lives as long as the context given to
// Connect, so it gets one that lasts the test, not a timeout.
func (h *legacyHarness) connect(t *testing.T, base string, headers http.Header) *mcp.ClientSession {
	t.Helper()
	return h.connectVia(t, base, headers, http.DefaultTransport)
}

func (h *legacyHarness) connectVia(t *testing.T, base string, headers http.Header, next http.RoundTripper) *mcp.ClientSession {
	t.Helper()
	client := mcp.NewClient(&mcp.Implementation{Name: "legacy-e2e-client", Version: "1.0.0"}, nil)
	type result struct {
		cs  *mcp.ClientSession
		err error
	}
	done := make(chan result, 1)
	go func() {
		cs, err := client.Connect(context.WithoutCancel(t.Context()), &mcp.SSEClientTransport{
			Endpoint:   base + "/sse",
			HTTPClient: &http.Client{Transport: &headerTransport{headers: headers, next: next}},
		}, nil)
		done <- result{cs, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			t.Fatalf("connecting over legacy SSE to %s: %v", base, r.err)
		}
		t.Cleanup(func() { _ = r.cs.Close() })
		return r.cs
	case <-time.After(10 * time.Second):
		t.Fatalf("connecting over legacy SSE to %s timed out", base)
		return nil
	}
}

func TestLegacySSERetriesRunOnce(t *testing.T) {
	h := newLegacyHarness(t, "")
	cs := h.connect(t, h.proxy.URL, nil)
	t.Logf("the Go SDK negotiated %s over legacy SSE", cs.InitializeResult().ProtocolVersion)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tools, err := cs.ListTools(ctx, nil)
	if err != nil {
		t.Fatalf("tools/list through the sidecar: %v", err)
	}
	if len(tools.Tools) == 0 {
		t.Fatal("tools/list through the sidecar listed no tools")
	}

	args := map[string]any{"card": "4242", "amount": 10}
	var bodies []string
	for i := range 5 {
		res := mustCall(t, cs, "charge_card", args, nil)
		if got, want := replayed(res), i > 0; got != want {
			t.Errorf("call %d: replayed = %v, want %v", i+1, got, want)
		}
		bodies = append(bodies, body(t, res))
	}
	if n := h.srv.Counts.Get("charge_card"); n != 1 {
		t.Fatalf("5 identical calls over legacy SSE ran charge_card %d times, want 1", n)
	}
	allSame(t, bodies)

	// Other arguments are another operation.
	if res := mustCall(t, cs, "charge_card", map[string]any{"card": "4242", "amount": 11}, nil); replayed(res) {
		t.Error("a call with other arguments was replayed")
	}
	if n := h.srv.Counts.Get("charge_card"); n != 2 {
		t.Fatalf("charge_card ran %d times, want 2", n)
	}

	// get_balance is readOnlyHint: the tools/list response on the stream
	// taught the sidecar so, and defaultMode Auto passes it through.
	for range 2 {
		if res := mustCall(t, cs, "get_balance", args, nil); replayed(res) {
			t.Error("get_balance (readOnlyHint) was replayed")
		}
	}
	if n := h.srv.Counts.Get("get_balance"); n != 2 {
		t.Errorf("get_balance ran %d times, want 2 (passthrough)", n)
	}

	// An engine error is written into the stream with the caller's id.
	key := mcp.Meta{"idempotency-key": "legacy-k1"}
	mustCall(t, cs, "charge_card", map[string]any{"card": "1111", "amount": 1}, key)
	_, err = call(ctx, cs, "charge_card", map[string]any{"card": "1111", "amount": 2}, key)
	if code := rpcCode(err); code != -32010 {
		t.Errorf("reusing a key with other arguments: err %v (code %d), want -32010", err, code)
	}
}

func TestLegacySSEConcurrentRetriesRunOnce(t *testing.T) {
	t.Run("one session", func(t *testing.T) {
		h := newLegacyHarness(t, "")
		cs := h.connect(t, h.proxy.URL, nil)
		args := map[string]any{"card": "4242", "amount": 20, "delayMs": 300}
		results := make([]string, 20)
		var replays atomic.Int64
		var wg sync.WaitGroup
		for i := range results {
			wg.Go(func() {
				res := mustCall(t, cs, "charge_card", args, nil)
				if replayed(res) {
					replays.Add(1)
				}
				results[i] = body(t, res)
			})
		}
		wg.Wait()
		if n := h.srv.Counts.Get("charge_card"); n != 1 {
			t.Fatalf("20 concurrent identical calls ran charge_card %d times, want 1", n)
		}
		if n := replays.Load(); n != 19 {
			t.Errorf("%d results marked replayed, want 19", n)
		}
		allSame(t, results)
	})
	t.Run("twenty sessions, one principal", func(t *testing.T) {
		h := newLegacyHarness(t, principalPolicy)
		alice := http.Header{"Authorization": {"Bearer alice"}}
		sessions := make([]*mcp.ClientSession, 20)
		for i := range sessions {
			sessions[i] = h.connect(t, h.proxy.URL, alice)
		}
		args := map[string]any{"card": "4242", "amount": 21, "delayMs": 300}
		results := make([]string, len(sessions))
		var wg sync.WaitGroup
		for i, cs := range sessions {
			wg.Go(func() { results[i] = body(t, mustCall(t, cs, "charge_card", args, nil)) })
		}
		wg.Wait()
		if n := h.srv.Counts.Get("charge_card"); n != 1 {
			t.Fatalf("20 concurrent identical calls from 20 sessions ran charge_card %d times, want 1", n)
		}
		allSame(t, results)
	})
}

// TestLegacySSEClientLeavesMidCall: the client closes its event stream
// while its call runs. Without the sidecar, the server ends the session and
// the response is lost; through the sidecar the upstream stream is held
// until the response arrives, the result is stored, and the client that
// reconnects (a new session) and retries gets it without a second run.
func TestLegacySSEClientLeavesMidCall(t *testing.T) {
	h := newLegacyHarness(t, principalPolicy)
	alice := http.Header{"Authorization": {"Bearer alice"}}
	tr := newKillableTransport()
	cs := h.connectVia(t, h.proxy.URL, alice, tr)
	args := map[string]any{"card": "4242", "amount": 30, "delayMs": 700}
	errc := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := call(ctx, cs, "charge_card", args, nil)
		errc <- err
	}()
	select {
	case <-h.callPosts:
	case <-time.After(5 * time.Second):
		t.Fatal("the call never reached the server")
	}
	// The client's connections drop mid-call, its SSE stream with them.
	// (ClientSession.Close would wait for the call to finish.)
	tr.kill()
	if err := <-errc; err == nil {
		t.Fatal("the call whose stream was closed succeeded")
	}
	if n := h.srv.Counts.Get("charge_card"); n != 0 {
		t.Fatalf("the call finished before its client left (charge_card ran %d times); the test proves nothing", n)
	}

	again := h.connect(t, h.proxy.URL, alice)
	res := mustCall(t, again, "charge_card", args, nil)
	if !replayed(res) {
		t.Error("the retry after reconnecting is not marked replayed")
	}
	var out mcpserver.ChargeResult
	remarshal(t, res.StructuredContent, &out)
	if out.ChargeID != 1 {
		t.Errorf("retry got charge #%d, want the first call's #1", out.ChargeID)
	}
	if n := h.srv.Counts.Get("charge_card"); n != 1 {
		t.Fatalf("charge_card ran %d times, want 1", n)
	}
	if n := h.srv.Counts.Get(mcpserver.Cancelled); n != 0 {
		t.Errorf("the closed stream cancelled the tool upstream %d times", n)
	}
	// The held upstream stream is let go once the response is in: only
	// the reconnected client's stream stays open.
	poll.Within(t, 5*time.Second, fmt.Sprintf("the left session's upstream stream to close (%d open)", h.streams.Load()), poll.True(func() bool { return h.streams.Load() == 1 }))
}
