package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/storeopen"
	"github.com/idemcp/idemcp/sidecar"
)

// Benchmarks of the sidecar's executed path in this process (the MCP
// server beside it), for profiles: go test ./test/bench -run '^$' -bench
// Executed -cpuprofile cpu.out (or -memprofile, -blockprofile), then
// pprof -focus 'sidecar|httpproxy|engine|store'.
func BenchmarkExecuted(b *testing.B) {
	e, err := newHTTPEnv()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(e.close)
	side := e.targets[2]
	for _, sc := range []*scenario{httpScenarios[2], largeExec, largeReplay} {
		for _, clients := range []int{1, 64} {
			if sc != httpScenarios[2] && clients > 1 {
				continue
			}
			b.Run(sc.name+"/clients="+strconv.Itoa(clients), func(b *testing.B) {
				runCalls(b, side, sc, clients)
			})
		}
	}
}

// BenchmarkExecutedTraced is BenchmarkExecuted's executed call with
// tracing on at 100% sampling, its spans exported over OTLP/HTTP to a
// sink that drops them: with -cpuprofile, the cost of a traced call.
func BenchmarkExecutedTraced(b *testing.B) {
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	b.Cleanup(sink.Close)
	b.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.URL)
	b.Setenv("OTEL_TRACES_SAMPLER", "always_on")
	e, err := newHTTPEnv()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(e.close)
	for _, traced := range []bool{false, true} {
		sc, err := sidecar.New(sidecar.Options{
			Upstream:   e.directURL,
			PolicyFile: e.policyFile(),
			LogLevel:   "error",
			Store:      storeopen.Options{Kind: "memory", MemoryMaxEntries: store.DefaultMaxEntries},
			Tracing:    traced,
		})
		if err != nil {
			b.Fatal(err)
		}
		u, err := e.serve(sc.Handler())
		if err != nil {
			b.Fatal(err)
		}
		side := &target{name: tSidecar, url: u + "/", client: newClient()}
		for _, clients := range []int{1, 64} {
			b.Run("traced="+strconv.FormatBool(traced)+"/clients="+strconv.Itoa(clients), func(b *testing.B) {
				runCalls(b, side, httpScenarios[2], clients)
			})
		}
	}
}

func runCalls(b *testing.B, side *target, sc *scenario, clients int) {
	_, _, _ = side.call(sc)
	b.SetParallelism(max(1, clients/maxProcs()))
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, _, err := side.call(sc); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
