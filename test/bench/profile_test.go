package main

import (
	"strconv"
	"testing"
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
			})
		}
	}
}
