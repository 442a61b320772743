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
		if d, err := time.ParseDuration(strings.TrimSpace(string(b))); err == nil {
			offset.Store(int64(d))
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
