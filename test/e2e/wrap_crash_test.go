package e2e_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// TestWrapChildCrashCachesNothing: the server runs a charge, then crashes
// with exit code 3 before it answers. The client gets an error, the
// wrapper exits with the server's code 3 and says so on stderr, and
// nothing is kept: on a shared Redis, the retry through a new wrapper with
// the same explicit key runs the charge again instead of replaying or
// refusing it.
func TestWrapChildCrashCachesNothing(t *testing.T) {
	t.Parallel()
	bins := buildWrapBins(t)
	srv := redistest.Start(t)
	count := newCounter(t)
	storeFlags := []string{"--store", "redis", "--redis-addr", srv.Addr,
		"--redis-key-prefix", fmt.Sprintf("idemcp:e2e/crash-%d:", time.Now().UnixNano())}
	key := mcp.Meta{"idempotency-key": "order-crash-1"}
	args := map[string]any{"card": "4242", "amount": 30}

	crashing := connectWrap(t, bins, revisions[1], storeFlags, count.env(), "CRASH_TOOL=charge_card", "CRASH_CODE=3")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := call(ctx, crashing.cs, "charge_card", args, key)
	if err == nil {
		t.Fatal("a call whose server crashed mid-call succeeded")
	}
	if code := rpcCode(err); code != mcpmsg.CodeUpstreamUnavailable {
		t.Errorf("the crashed call failed with %v (code %d), want JSON-RPC error %d", err, code, mcpmsg.CodeUpstreamUnavailable)
	}
	if code := crashing.close(t); code != 3 {
		t.Errorf("idemcp wrap exited with %d, want the server's 3", code)
	}
	if log := crashing.stderr.String(); !strings.Contains(log, `msg="The MCP server exited"`) || !strings.Contains(log, "code=3") {
		t.Errorf("the wrapper's stderr does not say the server exited with code 3:\n%s", crashing.stderr.String())
	}
	if n := count.get(t, "charge_card"); n != 1 {
		t.Fatalf("charge_card ran %d times before the crash, want 1", n)
	}

	retry := connectWrap(t, bins, revisions[1], storeFlags, count.env())
	res := mustCall(t, retry.cs, "charge_card", args, key)
	if replayed(res) || res.IsError {
		t.Fatalf("the retry after a crash was replayed or failed: %s", body(t, res))
	}
	if n := count.get(t, "charge_card"); n != 2 {
		t.Fatalf("charge_card ran %d times, want 2: the crashed run, then the retry (nothing was kept)", n)
	}
	if again := mustCall(t, retry.cs, "charge_card", args, key); !replayed(again) {
		t.Errorf("the call after the successful retry is not replayed")
	}
	if code := retry.close(t); code != 0 {
		t.Errorf("idemcp wrap exited with %d, want 0", code)
	}
}

// TestWrapChildCrashInMemory: with the default memory store, the client
// gets an error for the call in flight and the wrapper exits with the
// server's code.
func TestWrapChildCrashInMemory(t *testing.T) {
	t.Parallel()
	bins := buildWrapBins(t)
	count := newCounter(t)
	w := connectWrap(t, bins, revisions[0], nil, count.env(), "CRASH_TOOL=charge_card", "CRASH_CODE=7")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := call(ctx, w.cs, "charge_card", map[string]any{"card": "1", "amount": 1}, nil); rpcCode(err) != mcpmsg.CodeUpstreamUnavailable {
		t.Errorf("the crashed call: err = %v, want JSON-RPC error %d", err, mcpmsg.CodeUpstreamUnavailable)
	}
	if code := w.close(t); code != 7 {
		t.Errorf("idemcp wrap exited with %d, want the server's 7", code)
	}
}
