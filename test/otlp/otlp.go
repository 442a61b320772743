// Package otlp runs a real OTLP receiver for the tests (the OpenTelemetry
// Collector's otlpreceiver, built and cached by
// hack/setup-otlp-receiver.sh) and reads the spans it stored.
package otlp

import (
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/idemcp/idemcp/test/poll"
	"github.com/idemcp/idemcp/test/procs"
)

// Span is one line of the receiver's file (hack/otlp-receiver).
type Span struct {
	Service      string         `json:"service"`
	TraceID      string         `json:"traceId"`
	SpanID       string         `json:"spanId"`
	ParentSpanID string         `json:"parentSpanId"`
	Name         string         `json:"name"`
	Kind         string         `json:"kind"`
	Attributes   map[string]any `json:"attributes"`
	Links        []struct {
		TraceID string `json:"traceId"`
		SpanID  string `json:"spanId"`
	} `json:"links"`
	Resource map[string]any `json:"resource"`
}

// Receiver runs the OTLP receiver until the test ends and returns its
// OTLP/HTTP endpoint (http://host:port) and a function that reads the
// spans it has stored so far.
func Receiver(tb testing.TB) (endpoint string, spans func() []Span) {
	tb.Helper()
	_, self, _, _ := runtime.Caller(0)
	script := filepath.Join(filepath.Dir(self), "..", "..", "hack", "setup-otlp-receiver.sh")
	out, err := exec.Command(script).Output()
	if err != nil {
		var stderr string
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			stderr = string(ee.Stderr)
		}
		tb.Fatalf("building the OTLP receiver (hack/setup-otlp-receiver.sh): %v\n%s", err, stderr)
	}
	bin := strings.TrimSpace(string(out))
	addr := procs.FreeAddr(tb)
	file := filepath.Join(tb.TempDir(), "spans.jsonl")
	cmd := exec.Command(bin, "--http", addr, "--out", file)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	poll.Within(tb, 10*time.Second, "the OTLP receiver to listen on "+addr, func() error {
		resp, err := http.Post("http://"+addr+"/v1/traces", "application/json", strings.NewReader(`{}`))
		if err != nil {
			return err
		}
		return resp.Body.Close()
	})
	return "http://" + addr, func() []Span {
		b, err := os.ReadFile(file)
		if err != nil {
			return nil
		}
		lines := strings.Split(string(b), "\n")
		// The last piece is empty, or a line the receiver is still writing.
		lines = lines[:len(lines)-1]
		var all []Span
		for _, line := range lines {
			var s Span
			if err := json.Unmarshal([]byte(line), &s); err != nil {
				// A span this cannot read would escape every check on
				// what spans hold.
				tb.Errorf("the OTLP receiver stored a span line that does not parse: %v: %.200q", err, line)
				continue
			}
			all = append(all, s)
		}
		return all
	}
}
