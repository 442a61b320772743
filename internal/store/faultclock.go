//go:build faultclock

package store

import (
	"os"
	"strings"
	"sync/atomic"
	"time"
)

// FaultClockEnv names a file holding a Go duration (such as -90s) that
// a faultclock build adds to its wall clock, read again every 10ms: the
// chaos run steps one sidecar's clock, forward and back, while it serves.
// Each offset taken is written back to the file's name plus ".applied".
// Release builds have no such hook.
const FaultClockEnv = "IDEMCP_FAULT_CLOCK_FILE"

func init() {
	file := os.Getenv(FaultClockEnv)
	if file == "" {
		return
	}
	var offset atomic.Int64
	read := func() {
		b, err := os.ReadFile(file)
		if err != nil {
			return
		}
		if d, err := time.ParseDuration(strings.TrimSpace(string(b))); err == nil && offset.Swap(int64(d)) != int64(d) {
			// What the clock now is, for the test to see that the step
			// reached the process.
			_ = os.WriteFile(file+".applied", []byte(d.String()), 0o600)
		}
	}
	read()
	go func() {
		for range time.Tick(10 * time.Millisecond) {
			read()
		}
	}()
	wallClock = func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }
}
