package freeport

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
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

// TestAPortAnotherProcessHoldsIsNotHandedOut: a port another test binary
// took stays its own after that binary closed its listener (a manager
// stopped before it comes back on the same address), and comes free when
// that binary exits.
func TestAPortAnotherProcessHoldsIsNotHandedOut(t *testing.T) {
	if os.Getenv("FREEPORT_HOLDER") != "" {
		p := LoopbackPort(t)
		fmt.Println(p)
		_, _ = io.ReadAll(os.Stdin) // hold it until the parent lets go
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestAPortAnotherProcessHoldsIsNotHandedOut$") //nolint:gosec // this test binary
	cmd.Env = append(os.Environ(), "FREEPORT_HOLDER=1")
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var p int
	if _, err := fmt.Fscan(out, &p); err != nil {
		t.Fatalf("reading the holder's port: %v", err)
	}
	if reserve(p) {
		t.Fatalf("port %d, held by process %d, was reserved here too", p, cmd.Process.Pid)
	}
	// The port is free to bind, yet no Port call here hands it out.
	for range 2000 {
		if q := LoopbackPort(t); q == p {
			t.Fatalf("port %d handed out while another process holds it", p)
		}
	}
	_ = in.Close()
	_, _ = io.Copy(io.Discard, out)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("holder: %v", err)
	}
	if !reserve(p) {
		t.Fatalf("port %d stayed reserved after its holder exited", p)
	}
}
