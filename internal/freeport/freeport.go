// Package freeport hands out loopback ports for tests and local demos that
// must name an address before the program that listens on it starts.
//
// Asking the kernel for port 0 and closing the listener races: the port
// comes from the ephemeral range, the same range every outgoing connection
// (to the API server, to Redis) takes its local port from, so a connection
// made in between can hold it by the time the program binds. Ports handed
// out here lie below the ephemeral range, where no outgoing connection
// lands, and are never handed out twice on one machine while the process
// that took them lives: each port is also reserved by a lock on a file
// named after it, which the kernel drops when that process ends. Without
// it, a test that stops a server and starts another on the same address
// (a manager coming back) could lose the port to another test binary that
// `go test ./...` runs beside it.
package freeport

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// low is the lowest port handed out; below it lie well-known services.
const low = 20000

var (
	mu     sync.Mutex
	issued = map[int]bool{}
)

// Port returns a port on host that nobody listens on now, outside the
// kernel's ephemeral range.
func Port(host string) (int, error) {
	high := ephemeralLow()
	mu.Lock()
	defer mu.Unlock()
	if high-low < 1000 {
		// A kernel whose ephemeral range starts low: fall back to port 0.
		return kernelPort(host)
	}
	for range 200 {
		p := low + rand.IntN(high-low) //nolint:gosec // spreads picks, not a secret
		if issued[p] || !reserve(p) {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(p)))
		if err != nil {
			continue
		}
		_ = l.Close()
		issued[p] = true
		return p, nil
	}
	return 0, errors.New("no free port below the ephemeral range after 200 tries")
}

// Addr is Port as "host:port".
func Addr(host string) (string, error) {
	p, err := Port(host)
	if err != nil {
		return "", err
	}
	return net.JoinHostPort(host, strconv.Itoa(p)), nil
}

// Loopback returns a free 127.0.0.1 address, failing tb when there is none.
func Loopback(tb testing.TB) string {
	tb.Helper()
	a, err := Addr("127.0.0.1")
	if err != nil {
		tb.Fatalf("finding a free port: %v", err)
	}
	return a
}

// LoopbackPort is Loopback's port.
func LoopbackPort(tb testing.TB) int {
	tb.Helper()
	p, err := Port("127.0.0.1")
	if err != nil {
		tb.Fatalf("finding a free port: %v", err)
	}
	return p
}

func kernelPort(host string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, err
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ephemeralLow is the first port of the kernel's ephemeral range (Linux's
// default when it cannot be read).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	var lo, hi int
	if _, err := fmt.Sscan(strings.TrimSpace(string(b)), &lo, &hi); err != nil || lo <= 0 {
		return 32768
	}
	return lo
}
