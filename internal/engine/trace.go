package engine

import (
	"context"
	"encoding/json"
	"log/slog"
	"strconv"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/internal/mcpmsg"
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
	return tracing.Tracer(e.tracing.Provider())
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
//
// What is learned of the call as it goes (the plan, the key, how it was
// answered) is kept here, as plain values, and given to the span once, at
// End, as attributes: each SetAttributes of the SDK takes the span's lock
// and grows its attribute slice, which cost a traced call more than its
// export did, and attributes kept from the start made a CallSpan five
// times its size (a KeyValue is 64 bytes).
type CallSpan struct {
	span trace.Span
	// sdk reports that span is the SDK's, whose SetAttributes copies what
	// it is given, so that End can lend it a pooled slice.
	sdk bool

	mu        sync.Mutex
	ended     bool
	forwarded bool
	tookOver  bool
	planned   bool
	outcome   string
	code      int // the JSON-RPC error code answered, 0 for none

	// Known at the start ("" for what the call did not have, but for
	// requestID: an id of "" is an id, so hasRequestID says).
	tool, requestID, session, protocol, transport string
	hasRequestID                                  bool
	// The plan's, once planned.
	policy, policyHash, rule, reason, scope string
	// The key's kind and short hash ("" until keyed).
	keyKind, keyHash string
	// storeSpans: the store's round trips get child spans (the
	// policy's spec.tracing.storeSpans, when the call started).
	storeSpans bool
}

// StoreSpans reports whether the call's store round trips get child
// spans (tracing.Call).
func (s *CallSpan) StoreSpans() bool { return s != nil && s.storeSpans }

// callAttrs is the most attributes a call's span gets: 7 known at its
// start, 5 of the plan, 2 of the key, outcome, forwarded, took-over and
// the 2 of an error.
const callAttrs = 7 + 5 + 2 + 3 + 2

// callAttrPool holds the slices End gives an SDK span's SetAttributes,
// which copies them: a traced call allocates none of its own.
var callAttrPool = sync.Pool{New: func() any { return new([callAttrs]attribute.KeyValue) }}

// StartCall starts the span of a tools/call under the policy in force:
// the returned context carries it to Plan and Execute, and the transport
// ends it with End once the client is answered. A call that is not
// traced, or whose span is not sampled, gets ctx as it is and a nil span.
func (e *Engine) StartCall(ctx context.Context, ci CallInfo) (context.Context, *CallSpan) {
	if !tracing.Built {
		return ctx, nil
	}
	p := e.policy.Load()
	t := e.tracer(p)
	if t == nil {
		return ctx, nil
	}
	parent := tracing.FromMeta(ci.Meta)
	opts := make([]trace.SpanStartOption, 1, 2)
	opts[0] = serverKind
	if header := ci.Header; !header.Empty() {
		if parent.Empty() {
			parent = header
		} else if sc := header.SpanContext(); sc.IsValid() && !sc.Equal(parent.SpanContext()) {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{attribute.String("idemcp.link", "http-traceparent")}}))
		}
	}
	spanCtx, span := t.Start(parent.Context(ctx), "tools/call "+ci.Tool, opts...)
	if !span.IsRecording() {
		// Not sampled: nothing is recorded of the call, and the store's
		// spans and the trace trailer are only for sampled calls, so the
		// call goes on untraced. Its context keeps the unsampled span, so
		// that no store span joins a sampled span the context carried
		// (an embedding application's). The caller's trace context is
		// forwarded as it came either way.
		return spanCtx, nil
	}
	cs := &CallSpan{span: span, sdk: tracing.CopiesAttributes(span), tool: ci.Tool, session: ci.Session, protocol: ci.ProtocolVersion, transport: ci.Transport,
		storeSpans: p.Spec.Tracing != nil && p.Spec.Tracing.StoreSpans}
	if len(ci.RequestID) > 0 {
		cs.requestID, cs.hasRequestID = requestID(ci.RequestID), true
	}
	// The attributes go to the span at End, in one SetAttributes: given
	// at its start too, the SDK would copy them twice. No sampler of ours
	// or of the OTEL_TRACES_SAMPLER choices reads them.
	return tracing.WithCall(spanCtx, cs), cs
}

var serverKind = trace.WithSpanKind(trace.SpanKindServer)

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
	if !tracing.Built || ctx == nil {
		return nil
	}
	cs, _ := tracing.CallOf(ctx).(*CallSpan)
	return cs
}

// Passthrough records that the transport forwarded the call untouched.
func (s *CallSpan) Passthrough() {
	if s != nil {
		s.mu.Lock()
		s.setOutcomeLocked(tracing.OutcomePassthrough)
		s.forwarded = true
		s.mu.Unlock()
	}
}

// Forwarded records that the call reached the MCP server.
func (s *CallSpan) Forwarded() {
	if s != nil {
		s.mu.Lock()
		s.forwarded = true
		s.mu.Unlock()
	}
}

// Error records a JSON-RPC error code the client was answered.
func (s *CallSpan) Error(code int) {
	if s != nil {
		s.mu.Lock()
		s.code = code
		s.mu.Unlock()
	}
}

// End gives the span what was recorded and ends it. What is recorded
// after End is dropped, as the SDK drops it.
func (s *CallSpan) End() {
	if s == nil {
		return
	}
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	s.ended = true
	var buf *[callAttrs]attribute.KeyValue
	if s.sdk {
		buf = callAttrPool.Get().(*[callAttrs]attribute.KeyValue)
	} else {
		// Another provider's span may keep the slice it is given.
		buf = new([callAttrs]attribute.KeyValue)
	}
	attrs := append(buf[:0],
		tracing.MCPMethodName.String("tools/call"),
		tracing.GenAIToolName.String(s.tool),
		tracing.GenAIOperationName.String("execute_tool"))
	if s.hasRequestID {
		attrs = append(attrs, tracing.JSONRPCRequestID.String(s.requestID))
	}
	if s.session != "" {
		attrs = append(attrs, tracing.MCPSessionID.String(s.session))
	}
	if s.protocol != "" {
		attrs = append(attrs, tracing.MCPProtocolVersion.String(s.protocol))
	}
	if s.transport != "" {
		attrs = append(attrs, tracing.NetworkTransport.String(s.transport))
	}
	if s.planned {
		attrs = append(attrs, tracing.PolicyName.String(s.policy), tracing.PolicyHash.String(s.policyHash),
			tracing.Rule.String(s.rule), tracing.ModeReason.String(s.reason), tracing.Scope.String(s.scope))
	}
	if s.keyKind != "" {
		attrs = append(attrs, tracing.KeyKind.String(s.keyKind), tracing.KeyHashAttr.String(s.keyHash))
	}
	if s.outcome != "" {
		attrs = append(attrs, tracing.Outcome.String(s.outcome))
	}
	if s.forwarded {
		attrs = append(attrs, tracing.Forwarded.Bool(true))
	}
	if s.tookOver {
		attrs = append(attrs, tracing.TookOver.Bool(true))
	}
	if s.code != 0 {
		code := strconv.Itoa(s.code)
		attrs = append(attrs, tracing.RPCResponseStatus.String(code), tracing.ErrorType.String(code))
		s.span.SetStatus(codes.Error, "")
	}
	s.mu.Unlock()
	s.span.SetAttributes(attrs...)
	s.span.End()
	if s.sdk {
		clear(attrs) // the pool holds no strings of a call
		callAttrPool.Put(buf)
	}
}

// setOutcomeLocked records how the call was answered: the first outcome
// stands, except executed, which a later one (the call ran but its
// answer was refused) replaces.
func (s *CallSpan) setOutcomeLocked(o string) {
	if s.outcome == "" || s.outcome == tracing.OutcomeExecuted {
		s.outcome = o
	}
}

// traceOutcome records how a call was answered on its span, if traced.
func traceOutcome(ctx context.Context, o string) {
	if s := callSpanOf(ctx); s != nil {
		s.mu.Lock()
		s.setOutcomeLocked(o)
		s.mu.Unlock()
	}
}

// tracePlan records what the policy decided for a call.
func tracePlan(ctx context.Context, p *policy.Policy, r *policy.Rule, reason string) {
	s := callSpanOf(ctx)
	if s == nil {
		return
	}
	s.mu.Lock()
	if !s.ended {
		s.policy, s.policyHash, s.rule, s.reason, s.scope = p.Name, p.Hash, r.Pattern, reason, string(r.KeyScope)
		s.planned = true
	}
	s.mu.Unlock()
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
	hash := tracing.KeyHash(p.Key)
	s.mu.Lock()
	if !s.ended {
		s.keyKind, s.keyHash = kind, hash
	}
	s.mu.Unlock()
}

// traceForwarded marks a call that reached the server.
func traceForwarded(ctx context.Context) { callSpanOf(ctx).Forwarded() }

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
		s.mu.Lock()
		s.tookOver = true
		s.mu.Unlock()
	}
}

// withExecution returns a stored response whose result._meta also names
// the execution's span (ExecutionMeta), every other byte as stored.
func withExecution(stored []byte, execution trace.SpanContext) []byte {
	tp := tracing.Traceparent(execution)
	if tp == "" {
		return stored
	}
	// The response's members and its result's, in one scan.
	top, members, isObject, ok := mcpmsg.MembersWithin(stored, "result")
	if !ok {
		return stored
	}
	for i := len(top) - 1; i >= 0; i-- {
		if top[i].Name != "result" {
			continue
		}
		if !isObject {
			return stored
		}
		result := stored[top[i].Start:top[i].End]
		marked := setMeta(result, members, ExecutionMeta, `"`+tp+`"`)
		return splice(stored, top[i].Start, top[i].End, string(marked))
	}
	return stored
}
