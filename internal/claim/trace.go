package claim

import (
	"bytes"
	"context"
	"errors"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/tracing"
)

// Reservation is what Reserve found, with what the protocol knows besides
// the store's answer.
type Reservation struct {
	store.Reservation
	// Waited reports that another owner's claim was waited for.
	Waited bool
	// Execution is the span of the call that stored Response (Completed),
	// if it was traced: a replay links to it. Invalid otherwise, and for
	// records stored before trace context was kept.
	Execution trace.SpanContext
}

// A completed record whose call was traced, and whose response is JSON
// (a sidecar's response, a DoJSON value), carries the call's span
// context in a trailer after the response:
//
//	response | payload (208 bytes) | traceTrailerMark (16 bytes)
//
// where the payload is the 26 bytes version (1) | trace id (16) | span id
// (8) | trace flags (1), one bit a byte, a tab for 1 and a space for 0.
// It is JSON whitespace: a reader that does not know it (a sidecar of an
// earlier release during a rollout or a rollback, a DoJSON of one) still
// reads the response it stored. It is written inside the sealed record,
// so it is sealed like the rest; records with no trailer read as before.
//
// A response that is not known to be JSON (a Do value: any bytes) gets
// no trace trailer, since a reader of an earlier release would hand the
// trailer back as part of the value. Any response that itself ends in
// something splitTrace would strip (a value that happens to end in such
// a run of whitespace) gets an empty trailer, version 0, which
// splitTrace strips and nothing else: a replay returns exactly the bytes
// stored.
const (
	traceTrailerEmpty   = 0
	traceTrailerVersion = 1
	traceTrailerBytes   = 1 + 16 + 8 + 1
	traceTrailerMarkLen = 16
	traceTrailerLen     = 8*traceTrailerBytes + traceTrailerMarkLen
)

// traceTrailerMark is "id" in the trailer's encoding.
var traceTrailerMark = string(appendWhitespaceBits(nil, []byte("id")))

// appendWhitespaceBits appends b to out one bit a byte, most significant
// first: a tab for 1, a space for 0.
func appendWhitespaceBits(out, b []byte) []byte {
	for _, c := range b {
		out = append(out, whitespaceByte[c][:]...)
	}
	return out
}

// whitespaceByte is each byte's 8 bits in the trailer's encoding.
var whitespaceByte = func() (t [256][8]byte) {
	for c := range t {
		for i := range 8 {
			t[c][i] = ' '
			if c>>(7-i)&1 == 1 {
				t[c][i] = '\t'
			}
		}
	}
	return t
}()

// withTrace returns what to store for response: with sc's trailer if
// response is JSON and sc is a sampled span's; with an empty trailer if
// response would otherwise read back shorter; else response as it is.
func withTrace(response []byte, sc trace.SpanContext, isJSON bool) []byte {
	var payload [traceTrailerBytes]byte
	switch _, _, ok := parseTrailer(response); {
	case isJSON && sc.IsValid() && sc.IsSampled():
		tid, sid := sc.TraceID(), sc.SpanID()
		payload[0] = traceTrailerVersion
		copy(payload[1:17], tid[:])
		copy(payload[17:25], sid[:])
		payload[25] = byte(sc.TraceFlags())
	case ok:
		payload[0] = traceTrailerEmpty
	default:
		return response
	}
	out := make([]byte, 0, len(response)+traceTrailerLen)
	out = append(out, response...)
	out = appendWhitespaceBits(out, payload[:])
	return append(out, traceTrailerMark...)
}

// StripTrace is a stored response without its tracing trailer, as a
// replay returns it: what an Inspector's Lookup gives (once opened, if
// sealed) holds the trailer of a traced call, and a result shown to a
// user (kubectl idemcp keys show --result) must not. A response with no
// trailer is returned as it is.
func StripTrace(stored []byte) []byte {
	response, _ := splitTrace(stored)
	return response
}

// splitTrace splits a stored response into the response and the span
// context of its trailer (invalid if it has none, or an empty one).
func splitTrace(stored []byte) ([]byte, trace.SpanContext) {
	response, sc, ok := parseTrailer(stored)
	if !ok {
		return stored, trace.SpanContext{}
	}
	return response, sc
}

// parseTrailer reports whether stored ends in a trailer, an empty one or
// one with a valid span context, and if so splits it off.
func parseTrailer(stored []byte) ([]byte, trace.SpanContext, bool) {
	if len(stored) < traceTrailerLen || !bytes.HasSuffix(stored, []byte(traceTrailerMark)) {
		return nil, trace.SpanContext{}, false
	}
	bits := stored[len(stored)-traceTrailerLen : len(stored)-traceTrailerMarkLen]
	var payload [traceTrailerBytes]byte
	for i, c := range bits {
		switch c {
		case '\t':
			payload[i/8] |= 1 << (7 - i%8)
		case ' ':
		default:
			return nil, trace.SpanContext{}, false
		}
	}
	response := stored[:len(stored)-traceTrailerLen]
	switch payload[0] {
	case traceTrailerEmpty:
		if payload != [traceTrailerBytes]byte{} {
			return nil, trace.SpanContext{}, false
		}
		return response, trace.SpanContext{}, true
	case traceTrailerVersion:
	default:
		return nil, trace.SpanContext{}, false
	}
	var cfg trace.SpanContextConfig
	copy(cfg.TraceID[:], payload[1:17])
	copy(cfg.SpanID[:], payload[17:25])
	cfg.TraceFlags = trace.TraceFlags(payload[25])
	cfg.Remote = true
	sc := trace.NewSpanContext(cfg)
	if !sc.IsValid() {
		return nil, trace.SpanContext{}, false
	}
	return response, sc, true
}

// storeOp runs one store round trip, as a child span of the call's span
// when that one is sampled and its call asks for store spans
// (tracing.StoreSpans), and with no cost otherwise. The call's span may
// have ended (its client left, and the call settles detached): its store
// spans are still its children.
func storeOp(ctx context.Context, op string, fn func(context.Context) error) error {
	if !tracing.Built {
		return fn(ctx)
	}
	parent := trace.SpanFromContext(ctx)
	if !parent.SpanContext().IsSampled() || !tracing.StoreSpans(ctx) {
		return fn(ctx)
	}
	s := storeSpanOf(op)
	ctx, span := tracing.Tracer(parent.TracerProvider()).Start(ctx, s.name, clientKind)
	// Given as a start option, the attribute would be copied twice.
	span.SetAttributes(s.attrs...)
	defer span.End()
	err := fn(ctx)
	if err != nil {
		span.SetStatus(codes.Error, "")
		span.SetAttributes(tracing.ErrorType.String(storeErrorType(err)))
	}
	return err
}

// storeSpan is what every span of one store operation starts with, made
// once: its name and start options are the same for every call.
type storeSpan struct {
	name  string
	attrs []attribute.KeyValue
}

var clientKind = trace.WithSpanKind(trace.SpanKindClient)

var storeSpans sync.Map // op → *storeSpan

func storeSpanOf(op string) *storeSpan {
	if s, ok := storeSpans.Load(op); ok {
		return s.(*storeSpan)
	}
	s, _ := storeSpans.LoadOrStore(op, &storeSpan{
		name:  "idemcp.store " + op,
		attrs: []attribute.KeyValue{tracing.StoreOperation.String(op)},
	})
	return s.(*storeSpan)
}

// storeErrorType names a store error for a span without its message,
// which may name a key.
func storeErrorType(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, store.ErrNotOwner):
		return "not_owner"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return "unavailable"
}
