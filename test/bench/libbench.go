package main

import (
	"bytes"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
)

// What the in-process and store benchmarks cover.
var libBenchNotes = map[string]string{
	"BenchmarkMiddleware/Direct":           "Go SDK client → Go SDK server on an in-memory connection, no idemcp (the baseline)",
	"BenchmarkMiddleware/Executed":         "the same with the idemcp middleware (memory store), a call that runs",
	"BenchmarkMiddleware/Replay":           "the same with the middleware, a replay (the tool is not called)",
	"BenchmarkStores/Memory/Executed":      "memory store: claim + store a result",
	"BenchmarkStores/Memory/Replay":        "memory store: claim that finds the result",
	"BenchmarkStores/Redis/Executed":       "Redis on loopback: claim + store (2 round trips)",
	"BenchmarkStores/Redis/Replay":         "Redis on loopback: claim that finds the result (1 round trip)",
	"BenchmarkStores/RedisSealed/Executed": "the same with the result sealed (AES-256-GCM) before it is stored: sealing's cost per call",
	"BenchmarkStores/RedisSealed/Replay":   "the same with the stored result opened before it is replayed",
	"BenchmarkStores/Postgres/Executed":    "PostgreSQL on loopback: claim + store (2 statements, 2 commits)",
	"BenchmarkStores/Postgres/Replay":      "PostgreSQL on loopback: claim that finds the result (1 statement, a read)",
}

// libBenchSection measures the Go SDK middleware (no hop) and each store's
// cost per call, with go test benchmarks that start their own redis-server
// and PostgreSQL.
func libBenchSection(w *bytes.Buffer) {
	fmt.Fprintf(w, "\n## 4. In-process middleware and stores (absolute figures)\n\n")
	pkgs := []string{"./idempotency/mcpmiddleware/", "./internal/store/postgres/"}
	fmt.Fprintf(w, "`go test -run '^$' -bench . -benchmem -benchtime 2000x %s`. The middleware adds no network hop: its\n", strings.Join(pkgs, " "))
	fmt.Fprintf(w, "cost is the difference to Direct. A store's figure is what it adds to every deduplicated call.\n\n")
	args := append([]string{"test", "-run", "^$", "-bench", ".", "-benchmem", "-benchtime", "2000x"}, pkgs...)
	out, err := exec.Command("go", args...).CombinedOutput()
	rows := parseBench(out)
	if err != nil || len(rows) == 0 {
		fmt.Fprintf(w, "skipped: `go test` failed (%v): %s\n", err, oneLine(string(out)))
		return
	}
	var direct float64
	for _, r := range rows {
		if baseName(r.name) == "BenchmarkMiddleware/Direct" {
			direct, _ = strconv.ParseFloat(r.nsOp, 64)
		}
	}
	fmt.Fprintf(w, "| benchmark | µs/op | vs Direct | B/op | allocs/op | what it does |\n| --- | ---: | ---: | ---: | ---: | --- |\n")
	for _, r := range rows {
		ns, _ := strconv.ParseFloat(r.nsOp, 64)
		ratio := ""
		if strings.HasPrefix(r.name, "BenchmarkMiddleware/") && direct > 0 {
			ratio = fmt.Sprintf("%.2f", ns/direct)
		}
		fmt.Fprintf(w, "| %s | %.1f | %s | %s | %s | %s |\n", baseName(r.name), ns/1000, ratio, r.bOp, r.allocsOp, libBenchNotes[baseName(r.name)])
	}
}
