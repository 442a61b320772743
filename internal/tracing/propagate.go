package tracing

import (
	"context"
	"encoding/json"
	"net/http"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// The W3C trace context members of params._meta (reserved by the MCP
// specification, SEP-414) and their HTTP headers.
const (
	MetaTraceparent = "traceparent"
	MetaTracestate  = "tracestate"
	MetaBaggage     = "baggage"
)

// Carrier is the W3C trace context a caller sent, as text.
type Carrier struct {
	Traceparent, Tracestate, Baggage string
}

// Empty reports a carrier with no traceparent.
func (c Carrier) Empty() bool { return c.Traceparent == "" }

var propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// Context returns ctx with c's remote span context (the parent of the
// spans started under it) and baggage; ctx as it is if c holds none or
// an invalid one.
func (c Carrier) Context(ctx context.Context) context.Context {
	if c.Empty() {
		return ctx
	}
	return propagator.Extract(ctx, propagation.MapCarrier{
		MetaTraceparent: c.Traceparent, MetaTracestate: c.Tracestate, MetaBaggage: c.Baggage,
	})
}

// SpanContext is c's remote span context (invalid if c has none).
func (c Carrier) SpanContext() trace.SpanContext {
	return trace.SpanContextFromContext(c.Context(context.Background()))
}

// FromHeader reads the traceparent, tracestate and baggage headers. It
// looks them up by their canonical names: Get would make each name
// canonical again for every request, traced or not.
func FromHeader(h http.Header) Carrier {
	first := func(name string) string {
		if v := h[name]; len(v) > 0 {
			return v[0]
		}
		return ""
	}
	return Carrier{Traceparent: first("Traceparent"), Tracestate: first("Tracestate"), Baggage: first("Baggage")}
}

// FromMeta reads params._meta's traceparent, tracestate and baggage;
// members that are not strings are ignored.
func FromMeta(meta map[string]json.RawMessage) Carrier {
	str := func(name string) string {
		raw, ok := meta[name]
		if !ok || len(raw) == 0 || raw[0] != '"' {
			return ""
		}
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return ""
		}
		return s
	}
	if _, ok := meta[MetaTraceparent]; !ok {
		return Carrier{}
	}
	return Carrier{Traceparent: str(MetaTraceparent), Tracestate: str(MetaTracestate), Baggage: str(MetaBaggage)}
}
