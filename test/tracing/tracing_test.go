// Package tracing_test is the end-to-end test of idemcp's tracing: two
// sidecar processes on one real redis-server export their spans over
// OTLP to a real receiver (the OpenTelemetry Collector's otlpreceiver,
// hack/setup-otlp-receiver.sh), beside an MCP server that traces its own
// tool, and the test reads what the receiver stored.
package tracing_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/test/otlp"
	"github.com/idemcp/idemcp/test/poll"
	"github.com/idemcp/idemcp/test/procs"
)

func TestMain(m *testing.M) {
	code := m.Run()
	procs.Cleanup()
	os.Exit(code)
}

// What the user's data is: none of it may appear in a span.
const (
	secretKey    = "order-7f3a-SECRET-KEY"
	secretCard   = "4242-SECRET-CARD"
	secretResult = "receipt-SECRET-RESULT"
)

// tracedServer is an MCP server whose tool starts a span under the trace
// context the call carries in params._meta, as an instrumented server
// does; its first call is slow, so that the client drops its response.
func tracedServer(t *testing.T, endpoint string) (url string, executions *atomic.Int64, flush func()) {
	t.Helper()
	exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(endpoint+"/v1/traces"))
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", "test-mcp-server"))))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	executions = new(atomic.Int64)
	srv := mcp.NewServer(&mcp.Implementation{Name: "traced", Version: "1"}, nil)
	type args struct {
		Card   string `json:"card"`
		Amount int    `json:"amount"`
	}
	mcp.AddTool(srv, &mcp.Tool{Name: "charge_card"}, func(ctx context.Context, req *mcp.CallToolRequest, _ args) (*mcp.CallToolResult, any, error) {
		carrier := propagation.MapCarrier{}
		for k, v := range req.Params.GetMeta() {
			if s, ok := v.(string); ok {
				carrier[k] = s
			}
		}
		ctx = propagation.TraceContext{}.Extract(ctx, carrier)
		_, s := tp.Tracer("test-mcp-server").Start(ctx, "charge_card")
		defer s.End()
		if executions.Add(1) == 1 {
			time.Sleep(700 * time.Millisecond)
		}
		return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: secretResult}}}, nil, nil
	})
	h := mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return srv }, &mcp.StreamableHTTPOptions{Stateless: true, JSONResponse: true})
	ts := httptest.NewServer(h)
	t.Cleanup(ts.Close)
	return ts.URL, executions, func() { _ = tp.ForceFlush(context.Background()) }
}

// agentCall sends a tools/call the way an instrumented agent does: its
// HTTP span's context in the traceparent header, its tool span's in
// params._meta.
func agentCall(client *http.Client, url, headerParent, metaParent string) (map[string]any, error) {
	body := fmt.Sprintf(`{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge_card","arguments":{"card":%q,"amount":4242},"_meta":{"traceparent":%q}}}`,
		secretCard, metaParent)
	req, err := http.NewRequest(http.MethodPost, url+"/mcp", strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Mcp-Protocol-Version", "2025-06-18")
	req.Header.Set("Authorization", "Bearer agent-one")
	req.Header.Set("Idempotency-Key", secretKey)
	req.Header.Set("traceparent", headerParent)
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	var msg map[string]any
	if err := json.Unmarshal(raw, &msg); err != nil {
		return nil, fmt.Errorf("response %d %q: %w", resp.StatusCode, raw, err)
	}
	return msg, nil
}

func TestReplayLinksToExecution(t *testing.T) {
	endpoint, spans := otlp.Receiver(t)
	rdb := redistest.Start(t)
	upstream, executions, flushServer := tracedServer(t, endpoint)

	dir := t.TempDir()
	policy := func(name, tracing string) string {
		p := filepath.Join(dir, name)
		body := fmt.Sprintf(`apiVersion: idemcp.io/v1alpha1
kind: IdempotencyPolicy
metadata: {name: payments, namespace: shop}
spec:
  keyScope: Principal
  store: {type: Redis, redis: {external: {addresses: [%q]}}}
  tools: [{name: charge_card, mode: Deduplicate}]
%s`, rdb.Addr, tracing)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	env := []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + endpoint, "OTEL_BSP_SCHEDULE_DELAY=100", "OTEL_TRACES_SAMPLER=always_on"}
	bin := procs.Binary(t)
	common := []string{"--upstream", upstream, "--redis-key-prefix", "idemcp:trace:"}
	// One sidecar traces by its policy, with store spans, the other by
	// its install's flag, without.
	a := procs.StartSidecar(t, bin, env, append(common, "--policy-file", policy("a.yaml", "  tracing: {enabled: true, storeSpans: true}\n"))...)
	b := procs.StartSidecar(t, bin, env, append(common, "--policy-file", policy("b.yaml", ""), "--tracing")...)

	const (
		traceID    = "4bf92f3577b34da6a3ce929d0e0e4736"
		httpSpan   = "00f067aa0ba902b7"
		agentSpan  = "b7ad6b7169203331"
		retryTrace = "0af7651916cd43dd8448eb211c80319c"
		retrySpan  = "53995c3f42cd8ad8"
	)
	// The first attempt gives up before the slow call answers: its
	// response is dropped, and the call goes on.
	impatient := &http.Client{Timeout: 200 * time.Millisecond}
	if _, err := agentCall(impatient, "http://"+a.Addr, "00-"+traceID+"-"+httpSpan+"-01", "00-"+traceID+"-"+agentSpan+"-01"); err == nil {
		t.Fatal("the first attempt was answered; it should have timed out")
	}
	// The agent's retry, in a trace of its own, reaches the other sidecar.
	retry, err := agentCall(http.DefaultClient, "http://"+b.Addr, "00-"+retryTrace+"-"+retrySpan+"-01", "00-"+retryTrace+"-"+retrySpan+"-01")
	if err != nil {
		t.Fatal(err)
	}
	if n := executions.Load(); n != 1 {
		t.Fatalf("the tool ran %d times, want once", n)
	}
	result, _ := retry["result"].(map[string]any)
	meta, _ := result["_meta"].(map[string]any)
	if meta["idemcp.io/replayed"] != true {
		t.Fatalf("the retry was not replayed: %v", retry)
	}
	execution, _ := meta["idemcp.io/execution"].(string)
	flushServer()

	var executed, replay, server *otlp.Span
	var all []otlp.Span
	// The execution's store spans: the reserve, and the complete that
	// ends after the answer (and may reach the receiver in a later batch).
	storeSpans := 0
	_ = poll.Until(context.Background(), 15*time.Second, func() error {
		all = spans()
		executed, replay, server = nil, nil, nil
		for i := range all {
			s := &all[i]
			switch {
			case s.Service == "idemcp-sidecar" && s.Name == "tools/call charge_card" && s.Attributes["idemcp.outcome"] == "executed":
				executed = s
			case s.Service == "idemcp-sidecar" && s.Name == "tools/call charge_card":
				replay = s
			case s.Service == "test-mcp-server":
				server = s
			}
		}
		if executed == nil || replay == nil || server == nil {
			return errors.New("not all spans yet")
		}
		storeSpans = 0
		for _, s := range all {
			if strings.HasPrefix(s.Name, "idemcp.store ") && s.ParentSpanID == executed.SpanID {
				storeSpans++
			}
		}
		if storeSpans < 2 {
			return errors.New("not all store spans yet")
		}
		return nil
	})
	if executed == nil || replay == nil || server == nil {
		t.Fatalf("the receiver did not get the execution's, the replay's and the server's spans within 15s (got %d spans: %+v)", len(all), all)
	}

	// The execution's span is a child of the agent's tool span (_meta
	// wins over the header), and the server's span joins the same trace
	// under the caller's context, unchanged.
	if executed.TraceID != traceID || executed.ParentSpanID != agentSpan || executed.Kind != "Server" {
		t.Errorf("the execution's span is in trace %s under %s (%s); want trace %s under the agent's _meta span %s, kind Server", executed.TraceID, executed.ParentSpanID, executed.Kind, traceID, agentSpan)
	}
	if server.TraceID != executed.TraceID || server.ParentSpanID != agentSpan {
		t.Errorf("the server's span is in trace %s under %s; want the sidecar's trace %s under the caller's span %s", server.TraceID, server.ParentSpanID, executed.TraceID, agentSpan)
	}
	for k, want := range map[string]any{
		"mcp.method.name": "tools/call", "gen_ai.tool.name": "charge_card", "jsonrpc.request.id": "7",
		"idemcp.key.kind": "explicit", "idemcp.scope": "Principal", "idemcp.rule": "charge_card",
		"idemcp.policy.name": "payments", "idemcp.forwarded": true,
	} {
		if executed.Attributes[k] != want {
			t.Errorf("execution span: %s = %v, want %v", k, executed.Attributes[k], want)
		}
	}
	if h, _ := executed.Attributes["idemcp.key.hash"].(string); len(h) != 12 || replay.Attributes["idemcp.key.hash"] != h {
		t.Errorf("key hashes: execution %v, replay %v; want the same 12-digit hash", executed.Attributes["idemcp.key.hash"], replay.Attributes["idemcp.key.hash"])
	}
	// The replay, in the retry's trace on the other sidecar, links to the
	// execution, and its result names it.
	if o := replay.Attributes["idemcp.outcome"]; o != "replayed" && o != "waited" {
		t.Errorf("replay span outcome = %v, want replayed or waited", o)
	}
	if replay.TraceID != retryTrace {
		t.Errorf("the replay's span is in trace %s, want the retry's %s", replay.TraceID, retryTrace)
	}
	linked := false
	for _, l := range replay.Links {
		linked = linked || l.TraceID == executed.TraceID && l.SpanID == executed.SpanID
	}
	if !linked {
		t.Errorf("the replay's span links to %+v, not to the execution's span %s/%s", replay.Links, executed.TraceID, executed.SpanID)
	}
	if want := "00-" + executed.TraceID + "-" + executed.SpanID + "-01"; execution != want {
		t.Errorf("result._meta[idemcp.io/execution] = %q, want %q", execution, want)
	}
	// The store's round trips are children of the call's span, under
	// storeSpans, and only then.
	for _, s := range all {
		if strings.HasPrefix(s.Name, "idemcp.store ") && s.TraceID == replay.TraceID {
			t.Errorf("the replay, whose policy has no storeSpans, has a store span %s %v", s.Name, s.Attributes)
		}
	}
	if storeSpans < 2 { // reserve and complete
		for _, s := range all {
			t.Logf("%s %s %s parent %s %v", s.Service, s.Name, s.SpanID, s.ParentSpanID, s.Attributes)
		}
		t.Errorf("the execution has %d store spans, want reserve and complete at least", storeSpans)
	}
	// None of the user's data is in any span.
	for _, s := range all {
		raw, _ := json.Marshal(s)
		for _, secret := range []string{secretKey, secretCard, "4242,", secretResult} {
			if s.Service != "test-mcp-server" && bytes.Contains(raw, []byte(secret)) {
				t.Errorf("span %q holds %q: %s", s.Name, secret, raw)
			}
		}
	}
}
