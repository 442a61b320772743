package engine

import (
	"context"
	"encoding/json"
	"log/slog"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/tracing"
)

// ExecutionMeta is the result._meta member of a replayed response whose
// execution was traced: the W3C traceparent of the span of the call that
// ran, so that whoever reads a retry's result can find the call that
// actually took effect.
const ExecutionMeta = "idemcp.io/execution"

// Tracing says where the engine's spans go.
type Tracing struct {
	// Provider returns the TracerProvider; it is asked only once a call is
	// traced (tracing.Lazy makes its exporter then).
	Provider func() trace.TracerProvider
	// On traces every call; otherwise only those of a policy with
	// spec.tracing.enabled.
	On bool
}

// TracingFlag is the help of --tracing, for sidecar and wrap.
const TracingFlag = "export an OpenTelemetry span for every tools/call, configured by the OTEL_* environment variables (default: only under a policy with spec.tracing.enabled)"

// NewTracing returns the engine's tracing for --tracing: spans go to a
// provider made from the OTEL_* environment the first time a call is
// traced, and lazy.Shutdown flushes them.
func NewTracing(on bool, service string, log *slog.Logger) (Tracing, *tracing.Lazy) {
	lazy := tracing.NewLazy(service, func(err error) {
		log.Error("Tracing is turned on but its exporter cannot be made; no spans are exported", "err", err)
	})
	return Tracing{Provider: lazy.Provider, On: on}, lazy
}

// tracer is the tracer for a call under p, or nil when it is not traced.
func (e *Engine) tracer(p *policy.Policy) trace.Tracer {
	if e.tracing.Provider == nil || !e.tracing.On && (p.Spec.Tracing == nil || !p.Spec.Tracing.Enabled) {
		return nil
	}
	return e.tracing.Provider().Tracer(tracing.ScopeName)
}

// CallInfo is what a transport knows of a tools/call for its span. No
// part of it that is the user's data (arguments, keys) is ever recorded.
type CallInfo struct {
	Tool      string
	RequestID json.RawMessage
	// Session is the Mcp-Session-Id ("" if none).
	Session         string
	ProtocolVersion string
	// Transport is network.transport: tcp (HTTP) or pipe (stdio).
	Transport string
	// Header is the trace context of the request's HTTP headers; Meta is
	// the call's params._meta. _meta's wins as the parent, as the MCP
	// semantic conventions say; a different header context is linked.
	Header tracing.Carrier
	Meta   map[string]json.RawMessage
}

// CallSpan is the span of one tools/call. Its methods do nothing on a nil
// CallSpan, the span of a call that is not traced.
type CallSpan struct {
	span    trace.Span
	outcome string
}

type callSpanKey struct{}

// StartCall starts the span of a tools/call under the policy in force:
// the returned context carries it to Plan and Execute, and the transport
// ends it with End once the client is answered. A call that is not
// traced gets ctx as it is and a nil span.
func (e *Engine) StartCall(ctx context.Context, ci CallInfo) (context.Context, *CallSpan) {
	t := e.tracer(e.policy.Load())
	if t == nil {
		return ctx, nil
	}
	parent := tracing.FromMeta(ci.Meta)
	var links []trace.Link
	if header := ci.Header; !header.Empty() {
		if parent.Empty() {
			parent = header
		} else if sc := header.SpanContext(); sc.IsValid() && !sc.Equal(parent.SpanContext()) {
			links = append(links, trace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{attribute.String("idemcp.link", "http-traceparent")}})
		}
	}
	attrs := []attribute.KeyValue{
		tracing.MCPMethodName.String("tools/call"),
		tracing.GenAIToolName.String(ci.Tool),
		tracing.GenAIOperationName.String("execute_tool"),
	}
	if len(ci.RequestID) > 0 {
		attrs = append(attrs, tracing.JSONRPCRequestID.String(requestID(ci.RequestID)))
	}
	if ci.Session != "" {
		attrs = append(attrs, tracing.MCPSessionID.String(ci.Session))
	}
	if ci.ProtocolVersion != "" {
		attrs = append(attrs, tracing.MCPProtocolVersion.String(ci.ProtocolVersion))
	}
	if ci.Transport != "" {
		attrs = append(attrs, tracing.NetworkTransport.String(ci.Transport))
	}
	ctx, span := t.Start(parent.Context(ctx), "tools/call "+ci.Tool,
		trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(attrs...), trace.WithLinks(links...))
	cs := &CallSpan{span: span}
	return context.WithValue(ctx, callSpanKey{}, cs), cs
}

// requestID is a JSON-RPC id as the span names it: a string's content, a
// number's text.
func requestID(id json.RawMessage) string {
	var s string
	if id[0] == '"' && json.Unmarshal(id, &s) == nil {
		return s
	}
	return string(id)
}

// CallSpanFrom is the span StartCall put in ctx (nil if none).
func CallSpanFrom(ctx context.Context) *CallSpan { return callSpanOf(ctx) }

func callSpanOf(ctx context.Context) *CallSpan {
	if ctx == nil {
		return nil
	}
	cs, _ := ctx.Value(callSpanKey{}).(*CallSpan)
	return cs
}

// Passthrough records that the transport forwarded the call untouched.
func (s *CallSpan) Passthrough() {
	if s != nil {
		s.setOutcome(tracing.OutcomePassthrough)
		s.span.SetAttributes(tracing.Forwarded.Bool(true))
	}
}

// Forwarded records that the call reached the MCP server.
func (s *CallSpan) Forwarded() {
	if s != nil {
		s.span.SetAttributes(tracing.Forwarded.Bool(true))
	}
}

// Error records a JSON-RPC error code the client was answered.
func (s *CallSpan) Error(code int) {
	if s != nil {
		s.span.SetStatus(codes.Error, "")
		s.span.SetAttributes(tracing.RPCResponseStatus.String(strconv.Itoa(code)), tracing.ErrorType.String(strconv.Itoa(code)))
	}
}

// End ends the span.
func (s *CallSpan) End() {
	if s != nil {
		s.span.End()
	}
}

func (s *CallSpan) setOutcome(o string) {
	if s.outcome == "" || s.outcome == tracing.OutcomeExecuted {
		s.outcome = o
		s.span.SetAttributes(tracing.Outcome.String(o))
	}
}

// traceOutcome records how a call was answered on its span, if traced.
func traceOutcome(ctx context.Context, o string) {
	if s := callSpanOf(ctx); s != nil {
		s.setOutcome(o)
	}
}

// tracePlan records what the policy decided for a call.
func tracePlan(ctx context.Context, p *policy.Policy, r *policy.Rule, reason string) {
	s := callSpanOf(ctx)
	if s == nil {
		return
	}
	s.span.SetAttributes(
		tracing.PolicyName.String(p.Name), tracing.PolicyHash.String(p.Hash),
		tracing.Rule.String(r.Pattern), tracing.ModeReason.String(reason),
		tracing.Scope.String(string(r.KeyScope)),
	)
}

// traceKey records the kind of a planned call's key and its short hash.
func traceKey(ctx context.Context, p *Plan) {
	s := callSpanOf(ctx)
	if s == nil {
		return
	}
	kind := "derived"
	if p.Explicit {
		kind = "explicit"
	}
	s.span.SetAttributes(tracing.KeyKind.String(kind), tracing.KeyHashAttr.String(tracing.KeyHash(p.Key)))
}

// traceForwarded marks a call that reached the server.
func traceForwarded(ctx context.Context) {
	if s := callSpanOf(ctx); s != nil {
		s.span.SetAttributes(tracing.Forwarded.Bool(true))
	}
}

// traceReplay links a replay's span to the span of the call it replays.
func traceReplay(ctx context.Context, execution trace.SpanContext, tookOver bool) {
	s := callSpanOf(ctx)
	if s == nil {
		return
	}
	if execution.IsValid() {
		s.span.AddLink(trace.Link{SpanContext: execution, Attributes: []attribute.KeyValue{attribute.String("idemcp.link", "execution")}})
	}
	if tookOver {
		s.span.SetAttributes(tracing.TookOver.Bool(true))
	}
}

// withExecution returns a stored response whose result._meta also names
// the execution's span (ExecutionMeta), every other byte as stored.
func withExecution(stored []byte, execution trace.SpanContext) []byte {
	tp := tracing.Traceparent(execution)
	if tp == "" {
		return stored
	}
	top, ok := objectMembers(stored)
	if !ok {
		return stored
	}
	for i := len(top) - 1; i >= 0; i-- {
		if top[i].Name != "result" {
			continue
		}
		result := stored[top[i].Start:top[i].End]
		members, isObject := objectMembers(result)
		if !isObject || len(result) == 0 || result[0] != '{' {
			return stored
		}
		marked := setMeta(result, members, ExecutionMeta, `"`+tp+`"`)
		return splice(stored, top[i].Start, top[i].End, string(marked))
	}
	return stored
}
