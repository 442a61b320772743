//go:build race

package sidecar

// runningCallKiB is what the hostile tests allow a running call to cost in
// RSS: the race detector multiplies a process's memory several times (the
// sidecar they start is the race-built test binary).
const runningCallKiB = 1024
