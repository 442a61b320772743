// Package poll is the one way the tests (and the test programs: demo,
// bench) wait for a condition they cannot be signalled about: a status
// written by a controller, a process's metric, a server's state.
// Wherever the code under test can say when something happened (a
// channel, a hook, testing/synctest), wait for that instead.
package poll

import (
	"context"
	"errors"
	"testing"
	"time"
)

// Timeout is how long Eventually waits.
const Timeout = 20 * time.Second

// The interval starts short, so that a condition that holds soon is seen
// soon, and grows to maxInterval, so that a slow one costs little.
const (
	minInterval = 2 * time.Millisecond
	maxInterval = 100 * time.Millisecond
)

// errFalse is a False condition's error.
var errFalse = errors.New("condition not met")

// Until calls cond until it returns nil, within passes or ctx ends, and
// returns nil or cond's last error (ctx's error if it ended first).
func Until(ctx context.Context, within time.Duration, cond func() error) error {
	deadline := time.Now().Add(within)
	interval := minInterval
	for {
		err := cond()
		if err == nil {
			return nil
		}
		if !time.Now().Before(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(min(interval, time.Until(deadline))):
		}
		interval = min(2*interval, maxInterval)
	}
}

// Eventually fails t unless cond returns nil within Timeout; what says
// what was awaited.
func Eventually(t testing.TB, what string, cond func() error) {
	t.Helper()
	Within(t, Timeout, what, cond)
}

// Within is Eventually with another timeout.
func Within(t testing.TB, within time.Duration, what string, cond func() error) {
	t.Helper()
	if err := Until(context.Background(), within, cond); err != nil {
		t.Fatalf("timed out waiting for %s (%v): %v", what, within, err)
	}
}

// Throughout fails t if cond returns an error at any of its checks during
// d: a state that nothing signals the end of the changes to (reconciles a
// write caused) must hold while they may still run.
func Throughout(t testing.TB, d time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	interval := minInterval
	for {
		if err := cond(); err != nil {
			t.Fatalf("%s stopped holding: %v", what, err)
		}
		if !time.Now().Before(deadline) {
			return
		}
		<-time.After(min(interval, time.Until(deadline)))
		interval = min(2*interval, maxInterval)
	}
}

// True makes a condition of a bool.
func True(cond func() bool) func() error {
	return func() error {
		if cond() {
			return nil
		}
		return errFalse
	}
}
