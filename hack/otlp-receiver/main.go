// Command otlp-receiver is the OpenTelemetry Collector's OTLP receiver
// (go.opentelemetry.io/collector/receiver/otlpreceiver) with a file sink:
// every span it receives, over OTLP/HTTP or OTLP/gRPC, is appended to
// --out as one JSON object a line, flattened for tests to read. The
// tracing tests run it as the real receiver a user's collector would be;
// hack/setup-otlp-receiver.sh builds it once and caches it.
package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"go.opentelemetry.io/collector/component/componenttest"
	"go.opentelemetry.io/collector/config/configgrpc"
	"go.opentelemetry.io/collector/config/configoptional"
	"go.opentelemetry.io/collector/consumer"
	"go.opentelemetry.io/collector/pdata/pcommon"
	"go.opentelemetry.io/collector/pdata/ptrace"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/receiver/receivertest"
)

// Span is one line of --out.
type Span struct {
	Service      string         `json:"service"`
	Scope        string         `json:"scope"`
	TraceID      string         `json:"traceId"`
	SpanID       string         `json:"spanId"`
	ParentSpanID string         `json:"parentSpanId,omitempty"`
	Name         string         `json:"name"`
	Kind         string         `json:"kind"`
	Status       string         `json:"status,omitempty"`
	Attributes   map[string]any `json:"attributes"`
	Links        []Link         `json:"links,omitempty"`
	Resource     map[string]any `json:"resource"`
}

// Link is a span link.
type Link struct {
	TraceID string `json:"traceId"`
	SpanID  string `json:"spanId"`
}

func main() {
	httpAddr := flag.String("http", "127.0.0.1:4318", "OTLP/HTTP listen address (empty: off)")
	grpcAddr := flag.String("grpc", "", "OTLP/gRPC listen address (empty: off)")
	out := flag.String("out", "spans.jsonl", "file the spans are appended to")
	version := flag.Bool("version", false, "print the collector release this was built from and exit")
	flag.Parse()
	if *version {
		fmt.Println(collectorVersion)
		return
	}
	if err := run(*httpAddr, *grpcAddr, *out); err != nil {
		fmt.Fprintln(os.Stderr, "otlp-receiver:", err)
		os.Exit(1)
	}
}

// collectorVersion is the otlpreceiver release in go.mod.
const collectorVersion = "v0.165.0"

func run(httpAddr, grpcAddr, out string) error {
	f, err := os.OpenFile(out, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	var mu sync.Mutex
	sink, err := consumer.NewTraces(func(_ context.Context, td ptrace.Traces) error {
		mu.Lock()
		defer mu.Unlock()
		enc := json.NewEncoder(f)
		for _, rs := range td.ResourceSpans().All() {
			res := rs.Resource().Attributes().AsRaw()
			service, _ := res["service.name"].(string)
			for _, ss := range rs.ScopeSpans().All() {
				for _, s := range ss.Spans().All() {
					line := Span{
						Service: service, Scope: ss.Scope().Name(), Resource: res,
						TraceID: hexID(s.TraceID()), SpanID: hexSpan(s.SpanID()),
						Name: s.Name(), Kind: s.Kind().String(), Attributes: s.Attributes().AsRaw(),
					}
					if !s.ParentSpanID().IsEmpty() {
						line.ParentSpanID = hexSpan(s.ParentSpanID())
					}
					if s.Status().Code() != ptrace.StatusCodeUnset {
						line.Status = s.Status().Code().String()
					}
					for _, l := range s.Links().All() {
						line.Links = append(line.Links, Link{TraceID: hexID(l.TraceID()), SpanID: hexSpan(l.SpanID())})
					}
					if err := enc.Encode(line); err != nil {
						return err
					}
				}
			}
		}
		return f.Sync()
	})
	if err != nil {
		return err
	}
	factory := otlpreceiver.NewFactory()
	cfg := factory.CreateDefaultConfig().(*otlpreceiver.Config)
	if httpAddr == "" {
		cfg.Protocols.HTTP = configoptional.None[otlpreceiver.HTTPConfig]()
	} else {
		cfg.Protocols.HTTP.GetOrInsertDefault().ServerConfig.NetAddr.Endpoint = httpAddr
	}
	if grpcAddr == "" {
		cfg.Protocols.GRPC = configoptional.None[configgrpc.ServerConfig]()
	} else {
		cfg.Protocols.GRPC.GetOrInsertDefault().NetAddr.Endpoint = grpcAddr
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	r, err := factory.CreateTraces(ctx, receivertest.NewNopSettings(factory.Type()), cfg, sink)
	if err != nil {
		return err
	}
	if err := r.Start(ctx, componenttest.NewNopHost()); err != nil {
		return err
	}
	fmt.Println("otlp-receiver: listening; http", httpAddr, "grpc", grpcAddr)
	<-ctx.Done()
	return r.Shutdown(context.Background())
}

func hexID(id pcommon.TraceID) string  { return hex.EncodeToString(id[:]) }
func hexSpan(id pcommon.SpanID) string { return hex.EncodeToString(id[:]) }
