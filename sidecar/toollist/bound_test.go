package toollist

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/test/poll"
)

// TestContextListingsAreBounded: calls to a tool the sidecar's own listing
// does not name, under 64 distinct credentials at once, make at most 16
// listings in the callers' contexts upstream. The calls past the bound
// are deduplicated (their tool is unknown) and counted; the calls within
// it learn the tool their context lists; a call in a context already
// listed reuses its listing.
func TestContextListingsAreBounded(t *testing.T) {
	noop := func(context.Context, *mcp.CallToolRequest, struct{}) (*mcp.CallToolResult, struct{}, error) {
		return &mcp.CallToolResult{}, struct{}{}, nil
	}
	// A real SDK server that lists ctx_read (read-only) only to callers
	// with credentials; tools/list with credentials waits for release.
	anonymous := mcp.NewServer(&mcp.Implementation{Name: "anon", Version: "1"}, nil)
	mcp.AddTool(anonymous, &mcp.Tool{Name: "public"}, noop)
	authorized := mcp.NewServer(&mcp.Implementation{Name: "auth", Version: "1"}, nil)
	mcp.AddTool(authorized, &mcp.Tool{Name: "ctx_read", Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true}}, noop)
	sdk := mcp.NewStreamableHTTPHandler(func(r *http.Request) *mcp.Server {
		if r.Header.Get("Authorization") != "" {
			return authorized
		}
		return anonymous
	}, nil)
	release := make(chan struct{})
	var releaseOnce sync.Once
	open := func() { releaseOnce.Do(func() { close(release) }) }
	var mu sync.Mutex
	inFlight, most, listed := 0, 0, 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "" && r.Header.Get("Mcp-Method") == "tools/list" {
			mu.Lock()
			inFlight++
			listed++
			most = max(most, inFlight)
			mu.Unlock()
			defer func() {
				mu.Lock()
				inFlight--
				mu.Unlock()
			}()
			<-release
		}
		sdk.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(open) // before srv.Close, which waits for the handlers
	u, _ := url.Parse(srv.URL + "/mcp")
	h := NewHTTP(http.DefaultClient, u, "")

	e := engine.New(engine.Options{Store: store.NewMemory(1000)})
	var over atomic.Int64
	// The wait is long: a call within the bound waits for its listing,
	// however slow the machine, and none is a bet on timing.
	New(Options{Hints: e.Hints(), List: h.List, ListIn: h.ListIn, Wait: time.Minute, OverBound: func() { over.Add(1) }})

	const callers = 64
	plan := func(i int) (dedup bool) {
		cred := fmt.Sprintf("Bearer agent-%d", i)
		p, err := e.Plan(&engine.ToolCall{Name: "ctx_read"}, engine.Caller{Principal: cred,
			Listing: &engine.ListingContext{Header: "Authorization", Value: cred}})
		if err != nil {
			t.Errorf("caller %d: %v", i, err)
		}
		return p != nil
	}
	deduplicated := make([]bool, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() { deduplicated[i] = plan(i) })
	}
	poll.Eventually(t, "16 listings in flight and 48 calls past the bound", func() error {
		mu.Lock()
		n := inFlight
		mu.Unlock()
		if n != DefaultMaxContextListings || over.Load() != callers-DefaultMaxContextListings {
			return fmt.Errorf("%d listings in flight, %d calls past the bound", n, over.Load())
		}
		return nil
	})
	open()
	wg.Wait()
	mu.Lock()
	if most > DefaultMaxContextListings {
		t.Errorf("%d tools/list in callers' contexts in flight at once, want at most %d", most, DefaultMaxContextListings)
	}
	mu.Unlock()
	var learned []int
	n := 0
	for i, d := range deduplicated {
		if d {
			n++
		} else {
			learned = append(learned, i)
		}
	}
	if n != callers-DefaultMaxContextListings || len(learned) != DefaultMaxContextListings {
		t.Fatalf("%d calls deduplicated and %d passed through as read-only, want %d and %d", n, len(learned), callers-DefaultMaxContextListings, DefaultMaxContextListings)
	}
	// A context already listed is not listed again.
	for range 8 {
		wg.Go(func() {
			if plan(learned[0]) {
				t.Error("a call in a context already listed is deduplicated")
			}
		})
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if listed != DefaultMaxContextListings {
		t.Errorf("%d tools/list in callers' contexts, want %d", listed, DefaultMaxContextListings)
	}
}
