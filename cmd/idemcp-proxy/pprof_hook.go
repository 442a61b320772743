//go:build pprofhook

// A build for profiling only (go build -tags pprofhook): with
// IDEMCP_PPROF_ADDR set to a loopback address, the process serves
// net/http/pprof there, so that a sidecar under the bench's load can be
// profiled in its own process. Release builds have no such hook.
package main

import (
	"fmt"
	"net"
	"net/http"
	_ "net/http/pprof"
	"os"
)

func init() {
	addr := os.Getenv("IDEMCP_PPROF_ADDR")
	if addr == "" {
		return
	}
	host, _, err := net.SplitHostPort(addr)
	if ip := net.ParseIP(host); err != nil || ip == nil || !ip.IsLoopback() {
		fmt.Fprintf(os.Stderr, "IDEMCP_PPROF_ADDR=%s: use a loopback address such as 127.0.0.1:6060\n", addr)
		os.Exit(2)
	}
	go func() { _ = http.ListenAndServe(addr, nil) }() //nolint:gosec // a profiling build, loopback only
}
