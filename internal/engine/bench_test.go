package engine

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store"
)

// A typical tools/call: a handful of arguments, a nested object, a _meta.
const typicalParams = `{"name":"charge_card","arguments":{"card":"4242424242424242","amount":129.99,"currency":"EUR","customer":{"id":"cus_8f2k","email":"ada@example.com"},"description":"Order 10023","requestedAt":"2026-11-30T10:00:00Z"},"_meta":{"progressToken":7}}`

const typicalResponse = `{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"charged 129.99 EUR to card ending 4242 (charge ch_3k2j)"}],"structuredContent":{"chargeId":"ch_3k2j","status":"succeeded"}}}`

func benchEngine(b *testing.B) *Engine {
	return benchEngineOn(b, store.NewMemory(1<<20))
}

func benchEngineOn(b *testing.B, st store.Store) *Engine {
	return New(Options{Policy: mustPolicy(b, `spec: {tools: [{name: charge_*, ignoreArguments: [/requestedAt]}]}`), Store: st})
}

// sealedMemory is the memory store with every result sealed (AES-256-GCM),
// as a shared store is in a pod: the difference to the unsealed benchmark
// is what sealing costs a call.
func sealedMemory(b *testing.B) store.Store {
	key := make([]byte, store.SealKeyBytes)
	_, _ = rand.Read(key)
	ring, err := store.NewKeyring(key)
	if err != nil {
		b.Fatal(err)
	}
	return store.Seal(store.NewMemory(1<<20), store.SealOptions{Keyring: ring, Context: "idemcp:shop/payments:"})
}

// BenchmarkKeyDerivation: parse a tools/call's params and derive its key.
func BenchmarkKeyDerivation(b *testing.B) {
	e := benchEngine(b)
	c := Caller{Principal: "Bearer eyJhbGciOiJIUzI1NiJ9.abc", Session: "ZHL44CT3BECYYNDE3B3PQH3UAV"}
	b.ReportAllocs()
	for b.Loop() {
		tc, err := ParseToolCall(json.RawMessage(typicalParams))
		if err != nil {
			b.Fatal(err)
		}
		if _, err := e.Plan(tc, c); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkExecuted: a deduplicated call that runs (a new key each time):
// plan, reserve, forward, store the result.
func BenchmarkExecuted(b *testing.B) { benchExecuted(b, benchEngine(b)) }

// BenchmarkExecutedSealed: BenchmarkExecuted with the result sealed.
func BenchmarkExecutedSealed(b *testing.B) { benchExecuted(b, benchEngineOn(b, sealedMemory(b))) }

// BenchmarkExecutedFullStore: BenchmarkExecuted on a memory store already
// at its default record bound (store.DefaultMaxEntries) with live
// records, as a sidecar's is after a day of explicit keys (ttl 24h) at
// about 1.2 calls/s: each new call evicts one.
func BenchmarkExecutedFullStore(b *testing.B) {
	e := benchEngineOn(b, store.NewMemory(store.DefaultMaxEntries))
	execute(b, e, "fill", store.DefaultMaxEntries)
	benchExecuted(b, e)
}

func benchExecuted(b *testing.B, e *Engine) {
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		execute(b, e, strconv.Itoa(i), 1)
	}
}

// execute runs n executed calls, in sessions named from session.
func execute(b *testing.B, e *Engine, session string, n int) {
	resp := []byte(typicalResponse)
	fwd := func(context.Context) (Upstream, error) { return Upstream{Response: resp, Status: 200}, nil }
	ctx := context.Background()
	for i := range n {
		tc, _ := ParseToolCall(json.RawMessage(typicalParams))
		p, err := e.Plan(tc, Caller{Session: session + "/" + strconv.Itoa(i)})
		if err != nil {
			b.Fatal(err)
		}
		if out, err := e.Execute(ctx, p, fwd); err != nil || out.Kind != Executed {
			b.Fatal(out, err)
		}
	}
}

// BenchmarkReplay: a retry answered from the store with the caller's id.
func BenchmarkReplay(b *testing.B) { benchReplay(b, benchEngine(b)) }

// BenchmarkReplaySealed: BenchmarkReplay with the stored result opened.
func BenchmarkReplaySealed(b *testing.B) { benchReplay(b, benchEngineOn(b, sealedMemory(b))) }

func benchReplay(b *testing.B, e *Engine) {
	ctx := context.Background()
	tc, _ := ParseToolCall(json.RawMessage(typicalParams))
	p, _ := e.Plan(tc, Caller{Session: "s"})
	_, _ = e.Execute(ctx, p, func(context.Context) (Upstream, error) {
		return Upstream{Response: []byte(typicalResponse), Status: 200}, nil
	})
	id := json.RawMessage(`42`)
	b.ReportAllocs()
	for b.Loop() {
		tc, _ := ParseToolCall(json.RawMessage(typicalParams))
		p, err := e.Plan(tc, Caller{Session: "s"})
		if err != nil {
			b.Fatal(err)
		}
		out, err := e.Execute(ctx, p, nil)
		if err != nil || out.Kind != Replayed {
			b.Fatal(out, err)
		}
		_ = mcpmsg.WithID(out.Response, id)
	}
}

// BenchmarkExecutedTraced: BenchmarkExecuted with the call's span
// sampled, exported over OTLP/HTTP (protobuf) to a loopback endpoint that
// drops them, as the sidecar exports them. Run with -cpu 1 so that the
// exporter's background work is in ns/op; the difference to
// BenchmarkExecutedUntraced is what tracing costs a call.
func BenchmarkExecutedTraced(b *testing.B) { benchTracedTo(b, benchPolicy) }

// BenchmarkExecutedTracedStoreSpans: BenchmarkExecutedTraced under
// spec.tracing.storeSpans, the call's two store round trips spans too.
func BenchmarkExecutedTracedStoreSpans(b *testing.B) {
	benchTracedTo(b, `spec: {tracing: {storeSpans: true}, tools: [{name: charge_*, ignoreArguments: [/requestedAt]}]}`)
}

// benchTracedTo runs benchTraced under policyYAML, exporting as the
// sidecar does.
func benchTracedTo(b *testing.B, policyYAML string) {
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	b.Cleanup(sink.Close)
	exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(sink.URL), otlptracehttp.WithInsecure())
	if err != nil {
		b.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp))
	b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	benchTraced(b, policyYAML, Tracing{Provider: func() trace.TracerProvider { return tp }, On: true})
}

// BenchmarkExecutedUntraced: BenchmarkExecutedTraced's calls, not traced.
func BenchmarkExecutedUntraced(b *testing.B) { benchTraced(b, benchPolicy, Tracing{}) }

// benchPolicy is the traced benchmarks' policy.
const benchPolicy = `spec: {tools: [{name: charge_*, ignoreArguments: [/requestedAt]}]}`

func benchTraced(b *testing.B, policyYAML string, tr Tracing) {
	e := New(Options{Policy: mustPolicy(b, policyYAML), Store: store.NewMemory(1 << 20), Tracing: tr})
	resp := []byte(typicalResponse)
	fwd := func(context.Context) (Upstream, error) { return Upstream{Response: resp, Status: 200}, nil }
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		tc, _ := ParseToolCall(json.RawMessage(typicalParams))
		ctx, span := e.StartCall(context.Background(), CallInfo{Tool: tc.Name, RequestID: json.RawMessage(`7`), Session: "ZHL44CT3BECYYNDE3B3PQH3UAV", ProtocolVersion: "2026-07-28", Transport: "tcp", Meta: tc.Meta})
		p, err := e.PlanCall(ctx, tc, Caller{Session: strconv.Itoa(i)})
		if err != nil {
			b.Fatal(err)
		}
		if out, err := e.Execute(ctx, p, fwd); err != nil || out.Kind != Executed {
			b.Fatal(out, err)
		}
		span.End()
	}
}

// BenchmarkExecutedTracedNoExport: BenchmarkExecutedTraced with the spans
// dropped when they end: what making the spans costs, without the
// exporter's share.
func BenchmarkExecutedTracedNoExport(b *testing.B) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(dropSpans{}))
	b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	benchTraced(b, benchPolicy, Tracing{Provider: func() trace.TracerProvider { return tp }, On: true})
}

// dropSpans is a span processor that keeps nothing.
type dropSpans struct{}

func (dropSpans) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (dropSpans) OnEnd(sdktrace.ReadOnlySpan)                     {}
func (dropSpans) Shutdown(context.Context) error                  { return nil }
func (dropSpans) ForceFlush(context.Context) error                { return nil }
