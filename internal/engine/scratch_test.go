package engine

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

type dropProc struct{}

func (dropProc) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (dropProc) OnEnd(sdktrace.ReadOnlySpan)                     {}
func (dropProc) Shutdown(context.Context) error                  { return nil }
func (dropProc) ForceFlush(context.Context) error                { return nil }

func BenchmarkExecutedTracedDrop(b *testing.B) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(dropProc{}))
	benchTraced(b, Tracing{Provider: func() trace.TracerProvider { return tp }, On: true})
}
