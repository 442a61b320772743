package e2e_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	goredis "github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/test/mcpserver"
)

// markedArgs carry argMarker in requestedAt, an argument the test server
// does not echo in its result: whatever holds the marker got it from the
// arguments.
func markedArgs(card string) mcpserver.ChargeArgs {
	return mcpserver.ChargeArgs{Card: card, Amount: 5, RequestedAt: argMarker + "-" + card}
}

// Over the legacy HTTP+SSE transport, with a Go SDK server and clients:
// nothing a caller sent in an argument, an explicit key or Authorization
// shows on /metrics or in the sidecar's debug log, and principals stay
// apart.
func TestLegacySSEKeepsNoSecretsInLogsOrMetrics(t *testing.T) {
	srv := mcpserver.New()
	up := httptest.NewServer(mcp.NewSSEHandler(func(*http.Request) *mcp.Server { return srv.MCP }, nil))
	t.Cleanup(up.Close)
	sc := startSidecarProc(t, up.URL, "--policy-file", writePolicy(t, "spec: {keyScope: Principal, defaultMode: Deduplicate}"))
	alice := new(legacyHarness).connect(t, sc.url, http.Header{"Authorization": {"Bearer " + authMarker + "-alice"}})
	bob := new(legacyHarness).connect(t, sc.url, http.Header{"Authorization": {"Bearer " + authMarker + "-bob"}})
	key := mcp.Meta{"idempotency-key": keyMarker + "-legacy"}

	a := mustCall(t, alice, "charge_card", markedArgs("4242"), key)
	if !replayed(mustCall(t, alice, "charge_card", markedArgs("4242"), key)) {
		t.Error("alice's retry was not replayed")
	}
	if b := mustCall(t, bob, "charge_card", markedArgs("4242"), key); replayed(b) || body(t, a) == body(t, b) {
		t.Errorf("bob, with alice's key and arguments, got her result: %s", body(t, b))
	}
	mustCall(t, alice, "charge_card", markedArgs("5555"), nil) // a derived key
	if n := srv.Counts.Get("charge_card"); n != 3 {
		t.Errorf("charge_card ran %d times, want 3", n)
	}
	assertNoSecretsShown(t, sc, 1)
}

// assertNoSecretsShown scrapes the sidecar's /metrics and reads its debug
// log for the markers, once the metrics show the replays it served.
func assertNoSecretsShown(t *testing.T, sc *sidecarProc, replays int) {
	t.Helper()
	resp, err := http.Get("http://" + sc.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if want := fmt.Sprintf(`idemcp_tool_calls_total{outcome="replayed"} %d`, replays); !strings.Contains(string(metrics), want) {
		t.Errorf("/metrics does not count the %d replays: the scrape is broken\n%s", replays, grepLines(string(metrics), "idemcp_tool_calls_total"))
	}
	assertNoMarkers(t, "/metrics", string(metrics))
	log := sc.stderr.String()
	if !strings.Contains(log, `"level":"DEBUG"`) {
		t.Errorf("the sidecar logged nothing at debug level: the log scan is broken")
	}
	assertNoMarkers(t, "the sidecar's log", log)
}

// `idemcp wrap` in front of a Go SDK stdio server, with a Redis store:
// nothing sent in an argument or an explicit key shows in the wrapper's
// debug log (its only output besides the relayed messages; it serves no
// metrics) or in Redis.
func TestWrapKeepsNoSecretsInLogsOrStore(t *testing.T) {
	bins := buildWrapBins(t)
	srv := redistest.Start(t)
	count := newCounter(t)
	flags := []string{"--store", "redis", "--redis-addr", srv.Addr, "--redis-key-prefix", "idemcp:e2e/secrets:"}
	w := connectWrap(t, bins, revisions[1], flags, count.env())
	key := mcp.Meta{"idempotency-key": keyMarker + "-wrap"}
	first := mustCall(t, w.cs, "charge_card", markedArgs("4242"), key)
	retry := mustCall(t, w.cs, "charge_card", markedArgs("4242"), key)
	if !replayed(retry) || body(t, first) != body(t, retry) {
		t.Errorf("the retry was not replayed: %s", body(t, retry))
	}
	mustCall(t, w.cs, "charge_card", markedArgs("5555"), nil) // a derived key
	if code := w.close(t); code != 0 {
		t.Errorf("idemcp wrap exited with %d", code)
	}
	if n := count.get(t, "charge_card"); n != 2 {
		t.Errorf("charge_card ran %d times, want 2", n)
	}
	log := w.stderr.String()
	if !strings.Contains(log, "level=DEBUG") {
		t.Errorf("idemcp wrap logged nothing at debug level: the log scan is broken")
	}
	assertNoMarkers(t, "idemcp wrap's log", log)

	rdb := goredis.NewClient(&goredis.Options{Addr: srv.Addr})
	defer func() { _ = rdb.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	keys, err := rdb.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	var dump strings.Builder
	for _, k := range keys {
		dump.WriteString(k + "\n")
		if rdb.Type(ctx, k).Val() == "hash" {
			for f, v := range rdb.HGetAll(ctx, k).Val() {
				dump.WriteString(f + "=" + v + "\n")
			}
		} else {
			dump.WriteString(rdb.Get(ctx, k).Val() + "\n")
		}
	}
	if len(keys) < 2 {
		t.Fatalf("Redis holds %d keys, want the 2 results: the scan is broken", len(keys))
	}
	assertNoMarkers(t, "Redis", dump.String())
}
