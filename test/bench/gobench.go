package main

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/canonical"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/store"
)

const enginePkg = "github.com/idemcp/idemcp/internal/engine"

// What each engine benchmark (internal/engine's *_test.go) covers; TestEngineBenchNotes holds that every one has a line.
var engineBenchNotes = map[string]string{
	"BenchmarkKeyDerivation":            "parse a tools/call's params, canonicalize the arguments (RFC 8785), sha256 fingerprint and key",
	"BenchmarkExecuted":                 "a deduplicated call that runs: plan, claim in the memory store, forward (stubbed), store the result",
	"BenchmarkReplay":                   "a retry: plan, find the stored result, splice in the caller's id",
	"BenchmarkExecutedSealed":           "BenchmarkExecuted with the result sealed (AES-256-GCM, bound to its key) before it is stored",
	"BenchmarkExecutedFullStore":        "BenchmarkExecuted on a memory store at its default bound of 100,000 live records: each call evicts one",
	"BenchmarkReplaySealed":             "BenchmarkReplay with the stored result opened (AES-256-GCM) before it is replayed",
	"BenchmarkExecutedTraced":           "BenchmarkExecuted under a span sampled at 100%, exported over OTLP/HTTP to a loopback endpoint that drops it",
	"BenchmarkExecutedTracedStoreSpans": "BenchmarkExecutedTraced under spec.tracing.storeSpans: the store's two round trips get spans too",
	"BenchmarkExecutedUntraced":         "BenchmarkExecutedTraced's calls with tracing off: the baseline of the two above",
	"BenchmarkExecutedTracedNoExport":   "BenchmarkExecutedTraced with the spans dropped as they end: making them, without the export",
	"BenchmarkInFlightChurn":            "register and release calls in flight while many recently ended ones are remembered",
}

// The arguments of the engine benchmarks' "typical" tools/call
// (internal/engine/bench_test.go), for the cost breakdown below.
const typicalArgs = `{"card":"4242424242424242","amount":129.99,"currency":"EUR","customer":{"id":"cus_8f2k","email":"ada@example.com"},"description":"Order 10023","requestedAt":"2026-11-30T10:00:00Z"}`

const typicalParams = `{"name":"charge_card","arguments":` + typicalArgs + `,"_meta":{"progressToken":7}}`

func goBenchSection(w *bytes.Buffer) {
	fmt.Fprintf(w, "\n## 3. Engine Go benchmarks (absolute figures)\n\n")
	fmt.Fprintf(w, "`go test -run '^$' -bench . -benchmem %s`, run after the measurements above. These are\n", "./internal/engine/")
	fmt.Fprintf(w, "absolute costs on this machine, not ratios: use them to see where the engine's time goes, not to compare runs.\n\n")
	out, err := exec.Command("go", "test", "-run", "^$", "-bench", ".", "-benchmem", enginePkg).CombinedOutput()
	rows := parseBench(out)
	if err != nil || len(rows) == 0 {
		fmt.Fprintf(w, "skipped: `go test` failed (%v): %s\n", err, oneLine(string(out)))
	} else {
		fmt.Fprintf(w, "| benchmark | ns/op | B/op | allocs/op | what it does |\n| --- | ---: | ---: | ---: | --- |\n")
		for _, r := range rows {
			fmt.Fprintf(w, "| %s | %s | %s | %s | %s |\n", r.name, r.nsOp, r.bOp, r.allocsOp, engineBenchNotes[baseName(r.name)])
		}
	}

	fmt.Fprintf(w, "\nCost context, measured in this process with `testing.Benchmark` on the same typical arguments (%d bytes):\n\n", len(typicalArgs))
	fmt.Fprintf(w, "| step | ns/op | B/op | allocs/op |\n| --- | ---: | ---: | ---: |\n")
	canon, _ := canonical.Transform([]byte(typicalArgs))
	steps := []struct {
		name string
		f    func()
	}{
		{"`json.Unmarshal` of the params (`engine.ParseToolCall`)", func() { _, _ = engine.ParseToolCall(json.RawMessage(typicalParams)) }},
		{"RFC 8785 canonical form of the arguments (`canonical.Transform`)", func() { _, _ = canonical.Transform([]byte(typicalArgs)) }},
		{fmt.Sprintf("sha256 of the canonical arguments (%d bytes)", len(canon)), func() { _ = sha256.Sum256(canon) }},
		{"fingerprint: canonical form + sha256 (`engine.Fingerprint`)", func() { _, _ = engine.Fingerprint("charge_card", json.RawMessage(typicalArgs), nil) }},
		{fmt.Sprintf("seal a %d-byte result (`store.Keyring.Seal`, AES-256-GCM)", len(typicalResponse)), func() {
			_ = benchRing.Seal("idemcp:shop/payments:", benchKey, time.Now().Add(time.Hour), []byte(typicalResponse))
		}},
		{fmt.Sprintf("open it (`store.Keyring.Open`), %d bytes stored", len(benchSealed)), func() { _, _, _ = benchRing.Open("idemcp:shop/payments:", benchKey, benchSealed, time.Now()) }},
	}
	for _, s := range steps {
		r := testing.Benchmark(func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				s.f()
			}
		})
		fmt.Fprintf(w, "| %s | %d | %d | %d |\n", s.name, r.NsPerOp(), r.AllocedBytesPerOp(), r.AllocsPerOp())
	}
}

// The engine benchmarks' typical response, and a keyring to seal it.
const typicalResponse = `{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"charged 129.99 EUR to card ending 4242 (charge ch_3k2j)"}],"structuredContent":{"chargeId":"ch_3k2j","status":"succeeded"}}}`

const benchKey = "3f9a1c0d5e7b2a4f6c8e0a1b3d5f7a9c1e3b5d7f9a1c3e5b7d9f1a3c5e7b9d1f"

var (
	benchRing, _ = store.NewKeyring(make([]byte, store.SealKeyBytes))
	benchSealed  = benchRing.Seal("idemcp:shop/payments:", benchKey, time.Now().Add(time.Hour), []byte(typicalResponse))
)

type benchRow struct{ name, nsOp, bOp, allocsOp string }

// parseBench reads `go test -bench -benchmem` lines such as
// "BenchmarkReplay-2  1000000  1234 ns/op  512 B/op  9 allocs/op".
func parseBench(out []byte) []benchRow {
	var rows []benchRow
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		r := benchRow{name: f[0]}
		for i := 2; i+1 < len(f); i += 2 {
			switch f[i+1] {
			case "ns/op":
				r.nsOp = f[i]
			case "B/op":
				r.bOp = f[i]
			case "allocs/op":
				r.allocsOp = f[i]
			}
		}
		if r.nsOp != "" {
			rows = append(rows, r)
		}
	}
	return rows
}

// baseName drops the -GOMAXPROCS suffix of a benchmark name.
func baseName(name string) string {
	if i := strings.LastIndexByte(name, '-'); i > 0 {
		return name[:i]
	}
	return name
}
