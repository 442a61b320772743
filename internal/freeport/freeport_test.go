package freeport

import (
	"net"
	"strconv"
	"testing"
)

// TestPortsAreBindableOutsideTheEphemeralRangeAndUnique: every port handed
// out can be bound, none is handed out twice, and none lies where an
// outgoing connection could take it.
func TestPortsAreBindableOutsideTheEphemeralRangeAndUnique(t *testing.T) {
	seen := map[int]bool{}
	for range 300 {
		p := LoopbackPort(t)
		if seen[p] {
			t.Fatalf("port %d handed out twice", p)
		}
		seen[p] = true
		if eph := ephemeralLow(); eph-low >= 1000 && (p < low || p >= eph) {
			t.Fatalf("port %d outside [%d, %d)", p, low, eph)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("port %d handed out but not bindable: %v", p, err)
		}
		_ = l.Close()
	}
}
