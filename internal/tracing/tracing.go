// Package tracing sets up OpenTelemetry tracing for every idemcp process
// (sidecar, wrap, manager) from the standard OTEL_* environment variables,
// and holds what the front ends share: the W3C trace context a caller
// sends (an HTTP header or params._meta), the span names and attribute
// keys, and the short hash that stands for a key in a span.
//
// Tracing is off until something turns it on (a flag, or a policy's
// spec.tracing): until then no exporter exists and every span is the
// no-op one, so a process that never traces pays nothing for it.
package tracing

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/idemcp/idemcp/internal/version"
)

// ScopeName is the instrumentation scope of idemcp's spans.
const ScopeName = "github.com/idemcp/idemcp"

// NewProvider returns a TracerProvider configured by the OTEL_*
// environment variables, for the service named service unless
// OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) names
// another:
//
//   - OTEL_SDK_DISABLED=true, or OTEL_TRACES_EXPORTER=none: a no-op
//     provider;
//   - OTEL_TRACES_EXPORTER: otlp (the default; no other is built in);
//   - OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL:
//     http/protobuf (the default) or grpc;
//   - OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT,
//     _CERTIFICATE, _COMPRESSION, _INSECURE: read by the exporter;
//   - OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (default
//     parentbased_always_on), OTEL_BSP_*: read by the SDK.
//
// Spans are exported in batches, in the background; shutdown flushes them.
func NewProvider(ctx context.Context, service string) (trace.TracerProvider, func(context.Context) error, error) {
	nothing := func(context.Context) error { return nil }
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") {
		return noop.NewTracerProvider(), nothing, nil
	}
	switch exp := strings.ToLower(strings.TrimSpace(os.Getenv("OTEL_TRACES_EXPORTER"))); exp {
	case "", "otlp":
	case "none":
		return noop.NewTracerProvider(), nothing, nil
	default:
		return nil, nil, fmt.Errorf("OTEL_TRACES_EXPORTER=%s: idemcp exports traces with otlp only (or none)", exp)
	}
	protocol := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if protocol == "" {
		protocol = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	var (
		exporter sdktrace.SpanExporter
		err      error
	)
	switch protocol {
	case "", "http/protobuf":
		exporter, err = otlptracehttp.New(ctx)
	case "grpc":
		exporter, err = otlptracegrpc.New(ctx)
	default:
		return nil, nil, fmt.Errorf("OTEL_EXPORTER_OTLP_PROTOCOL=%s: use http/protobuf or grpc", protocol)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("creating the OTLP trace exporter: %w", err)
	}
	res, err := resource.Merge(
		resource.NewSchemaless(
			attribute.String("service.name", service),
			attribute.String("service.version", version.Get().Version),
		),
		resource.Environment(), // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win
	)
	if err != nil {
		return nil, nil, fmt.Errorf("reading OTEL_RESOURCE_ATTRIBUTES: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	return tp, tp.Shutdown, nil
}

// Lazy is a TracerProvider made the first time tracing is turned on, so
// that a policy pushed live can turn it on in a process started without
// it. It is safe for concurrent use.
type Lazy struct {
	service string
	onError func(error)

	mu       sync.Mutex
	provider trace.TracerProvider
	shutdown func(context.Context) error
	// made is provider once made: every traced call asks for it.
	made atomic.Pointer[trace.TracerProvider]
}

// NewLazy returns a Lazy provider for service; onError is told once if the
// provider cannot be made (the environment is wrong), and tracing then
// stays off.
func NewLazy(service string, onError func(error)) *Lazy {
	return &Lazy{service: service, onError: onError}
}

// Provider returns the provider, made now if it was not yet.
func (l *Lazy) Provider() trace.TracerProvider {
	if p := l.made.Load(); p != nil {
		return *p
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.provider == nil {
		tp, shutdown, err := NewProvider(context.Background(), l.service)
		if err != nil {
			if l.onError != nil {
				l.onError(err)
			}
			tp, shutdown = noop.NewTracerProvider(), func(context.Context) error { return nil }
		}
		l.provider, l.shutdown = tp, shutdown
		l.made.Store(&tp)
	}
	return l.provider
}

// Shutdown flushes the spans not yet exported, if a provider was made.
func (l *Lazy) Shutdown(ctx context.Context) error {
	l.mu.Lock()
	shutdown := l.shutdown
	l.mu.Unlock()
	if shutdown == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := shutdown(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("flushing spans: %w", err)
	}
	return nil
}

// KeyHash is what a span says about an idempotency key: the first 12 hex
// digits of a hash of the store's key (itself a hash), enough to tell two
// calls' keys apart and to correlate a retry with its execution, and
// nothing to learn the key from.
func KeyHash(storeKey string) string {
	// Hashed from a buffer on the stack: a store key is 64 hex digits
	// (one of any length still hashes the same, from the heap).
	var buf [128]byte
	in := append(append(buf[:0], keyHashPrefix...), storeKey...)
	h := sha256.Sum256(in)
	return hex.EncodeToString(h[:6])
}

const keyHashPrefix = "idemcp trace key\x00"

// Traceparent is the W3C traceparent of sc ("" if sc is not valid).
func Traceparent(sc trace.SpanContext) string {
	if !sc.IsValid() {
		return ""
	}
	return "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-" + sc.TraceFlags().String()
}

// Attribute keys: the MCP semantic conventions' where they have one, and
// idemcp's own under idemcp.*.
const (
	MCPMethodName      attribute.Key = "mcp.method.name"
	MCPSessionID       attribute.Key = "mcp.session.id"
	MCPProtocolVersion attribute.Key = "mcp.protocol.version"
	JSONRPCRequestID   attribute.Key = "jsonrpc.request.id"
	RPCResponseStatus  attribute.Key = "rpc.response.status_code"
	GenAIToolName      attribute.Key = "gen_ai.tool.name"
	GenAIOperationName attribute.Key = "gen_ai.operation.name"
	NetworkTransport   attribute.Key = "network.transport"
	ErrorType          attribute.Key = "error.type"

	// Outcome is how idemcp answered the call (Outcome* values).
	Outcome attribute.Key = "idemcp.outcome"
	// Forwarded reports whether this call reached the MCP server.
	Forwarded attribute.Key = "idemcp.forwarded"
	// KeyKind is explicit or derived.
	KeyKind attribute.Key = "idemcp.key.kind"
	// KeyHashAttr is KeyHash of the call's store key.
	KeyHashAttr attribute.Key = "idemcp.key.hash"
	// Scope is the key's scope kind: Session, Principal or Global.
	Scope attribute.Key = "idemcp.scope"
	// Rule is the policy rule (its tools glob) that chose the mode, ""
	// for defaultMode; ModeReason says why the mode was chosen.
	Rule       attribute.Key = "idemcp.rule"
	ModeReason attribute.Key = "idemcp.mode.reason"
	PolicyName attribute.Key = "idemcp.policy.name"
	PolicyHash attribute.Key = "idemcp.policy.hash"
	TookOver   attribute.Key = "idemcp.took_over"
	// StoreOperation is the store round trip of a child span.
	StoreOperation attribute.Key = "idemcp.store.operation"
)

// Outcome values: what a person asking "why did this call not run?"
// reads.
const (
	OutcomeExecuted         = "executed"
	OutcomeReplayed         = "replayed"
	OutcomeWaited           = "waited" // replayed after waiting for the call in flight
	OutcomeConflict         = "conflict"
	OutcomeInFlight         = "in-flight"
	OutcomeUnscoped         = "unscoped"
	OutcomePassthrough      = "passthrough"
	OutcomeOutcomeUnknown   = "outcome-unknown"
	OutcomeStoreUnavailable = "store-unavailable"
	// OutcomeRejected is any other refusal (a bad key, too many waiters,
	// a task read from another session).
	OutcomeRejected = "rejected"
)

// lastTracer is the tracer of the SDK provider Tracer was last asked
// for: asking a provider for its tracer takes a lock every time, and a
// process has one provider.
var lastTracer atomic.Pointer[sdkTracer]

type sdkTracer struct {
	provider *sdktrace.TracerProvider
	tracer   trace.Tracer
}

// Tracer is tp's tracer of idemcp's spans. An SDK provider's is kept, for
// as long as it is the one asked for; any other provider (an embedding
// application's global one, which delegates and may be replaced) is
// asked every time.
func Tracer(tp trace.TracerProvider) trace.Tracer {
	sdk, ok := tp.(*sdktrace.TracerProvider)
	if !ok {
		return tp.Tracer(ScopeName)
	}
	if last := lastTracer.Load(); last != nil && last.provider == sdk {
		return last.tracer
	}
	t := sdk.Tracer(ScopeName)
	lastTracer.Store(&sdkTracer{provider: sdk, tracer: t})
	return t
}

// CopiesAttributes reports whether span's SetAttributes is known to copy
// the attributes it is given, so that the caller may reuse their slice:
// the SDK's own spans do. Any other span may keep the slice, a wrapper
// of an SDK span (which satisfies sdktrace.ReadWriteSpan by embedding
// one) among them, so the span's dynamic type must be the SDK's.
func CopiesAttributes(span trace.Span) bool {
	return reflect.TypeOf(span) == sdkSpanType()
}

// sdkSpanType is the dynamic type of the SDK's recording spans, learned
// from a span of a provider of its own (which exports nothing).
var sdkSpanType = sync.OnceValue(func() reflect.Type {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()))
	_, span := tp.Tracer(ScopeName).Start(context.Background(), "type")
	span.End()
	_ = tp.Shutdown(context.Background())
	return reflect.TypeOf(span)
})

// A Call is what a traced call's context carries (WithCall) for the
// spans made under it: the engine's record of a tools/call span, or the
// library's of a Do.
type Call interface {
	// StoreSpans reports whether the call's store round trips get
	// child spans.
	StoreSpans() bool
}

type callKey struct{}

// WithCall returns ctx carrying c.
func WithCall(ctx context.Context, c Call) context.Context {
	return context.WithValue(ctx, callKey{}, c)
}

// CallOf is the Call ctx carries (nil if none).
func CallOf(ctx context.Context) Call {
	c, _ := ctx.Value(callKey{}).(Call)
	return c
}

// StoreSpans reports whether a store round trip under ctx, whose span is
// sampled, gets a child span: only if ctx carries a Call that says so.
// A sampled span of an embedding application's, under which idemcp
// traces nothing of its own, gets none; the Go library's Do always says
// so, even inside a call whose policy does not.
func StoreSpans(ctx context.Context) bool {
	c := CallOf(ctx)
	return c != nil && c.StoreSpans()
}
