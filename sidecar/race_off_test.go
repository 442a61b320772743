//go:build !race

package sidecar

// runningCallKiB is what the hostile tests allow a running call to cost in
// RSS: about twice the 110 KiB measured.
const runningCallKiB = 256
