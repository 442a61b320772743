package httpproxy

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/test/mcpserver"
)

// gatedStore holds the first Reserve until the test lets it through.
type gatedStore struct {
	*store.Memory
	once      sync.Once
	reserving chan struct{} // closed when the first Reserve arrives
	proceed   chan struct{}
}

func (s *gatedStore) Reserve(ctx context.Context, c store.Claim) (store.Reservation, error) {
	first := false
	s.once.Do(func() { first = true; close(s.reserving) })
	if first {
		<-s.proceed
	}
	return s.Memory.Reserve(ctx, c)
}

// A client that gives up on a deduplicated call closes its session at once
// (the Go SDK's agents do): the DELETE can reach the sidecar while the call
// is still being claimed, before it is forwarded. It must wait for the call
// all the same. Otherwise it reaches the server while the call runs there,
// the server drops the call's response with the session, nothing is
// stored, and the retry charges the card a second time. The soak found
// this (test/soak/results.md).
func TestDeleteWaitsForACallStillBeingClaimed(t *testing.T) {
	srv := mcpserver.New()
	started := make(chan struct{}) // the call reached the server
	var startOnce sync.Once
	srv.MCP.AddReceivingMiddleware(func(next mcp.MethodHandler) mcp.MethodHandler {
		return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
			if method == "tools/call" {
				startOnce.Do(func() { close(started) })
			}
			return next(ctx, method, req)
		}
	})
	handler := srv.Handler(false)
	upstreamDeleted := make(chan struct{})
	var deletedOnce sync.Once
	// The network may deliver the DELETE after the call, though it was
	// sent first: the server takes a DELETE only once the call is there.
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodDelete {
			deletedOnce.Do(func() { close(upstreamDeleted) })
			select {
			case <-started:
			case <-time.After(10 * time.Second):
			}
		}
		handler.ServeHTTP(w, r)
	}))
	defer upstream.Close()

	gs := &gatedStore{Memory: store.NewMemory(100), reserving: make(chan struct{}), proceed: make(chan struct{})}
	var proceedOnce sync.Once
	proceed := func() { proceedOnce.Do(func() { close(gs.proceed) }) }
	defer proceed()
	pol, err := policy.Parse([]byte("spec: {keyScope: Principal}"))
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(upstream.URL)
	e := engine.New(engine.Options{Store: gs, Policy: pol})
	proxy := New(Options{Upstream: u, Engine: e})
	deleting := make(chan struct{}) // the DELETE reached the sidecar
	var deletingOnce sync.Once
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodDelete {
			deletingOnce.Do(func() { close(deleting) })
		}
		proxy.ServeHTTP(w, r)
	}))
	defer front.Close()

	connect := func() *mcp.ClientSession {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		cs, err := mcp.NewClient(&mcp.Implementation{Name: "agent", Version: "1"}, nil).Connect(ctx, &mcp.StreamableClientTransport{
			Endpoint:   front.URL,
			HTTPClient: &http.Client{Transport: &principalTransport{principal: "Bearer agent"}},
			MaxRetries: -1,
		}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return cs
	}
	params := &mcp.CallToolParams{Name: "charge_card", Arguments: mcpserver.ChargeArgs{Card: "4242", Amount: 5, DelayMS: 300},
		Meta: mcp.Meta{"idempotency-key": "order-1"}}

	first := connect()
	ctx, cancel := context.WithCancel(context.Background())
	gaveUp := make(chan error, 1)
	go func() {
		_, err := first.CallTool(ctx, params)
		gaveUp <- err
	}()
	<-gs.reserving
	cancel() // the agent's timeout
	if err := <-gaveUp; err == nil {
		t.Fatal("the first attempt was answered; want it to give up")
	}
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		_ = first.Close() // DELETE
	}()
	<-deleting
	// A DELETE forwarded at once reaches the server now; give it the
	// moment it takes, then let the call be claimed and forwarded.
	select {
	case <-upstreamDeleted:
	case <-time.After(500 * time.Millisecond):
	}
	proceed()

	retry := connect()
	defer func() { _ = retry.Close() }()
	rctx, rcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer rcancel()
	res, err := retry.CallTool(rctx, &mcp.CallToolParams{Name: params.Name, Arguments: params.Arguments, Meta: mcp.Meta{"idempotency-key": "order-1"}})
	if err != nil {
		t.Fatalf("retry: %v", err)
	}
	<-closed
	drain(t, e)
	if n := srv.Counts.Get("charge_card"); n != 1 {
		t.Errorf("the card was charged %d times, want 1", n)
	}
	if replayed, _ := res.Meta["idemcp.io/replayed"].(bool); !replayed {
		t.Error("the retry was not a replay of the first call")
	}
}

type principalTransport struct{ principal string }

func (p *principalTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", p.principal)
	return http.DefaultTransport.RoundTrip(r)
}
