package procs

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestProcessStopAndStartAgain(t *testing.T) {
	ready := filepath.Join(t.TempDir(), "ready")
	p := New(Spec{
		Name: "sleeper", Path: "/bin/sh", Args: []string{"-c", "touch " + ready + "; exec sleep 60"},
		Ready: func() error { _, err := os.Stat(ready); return err },
	})
	t.Cleanup(p.Kill)
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	first := p.PID()
	if first == 0 || p.Exited() == nil {
		t.Fatalf("running: PID %d, Exited %v", first, p.Exited())
	}
	p.Stop()
	if p.PID() != 0 || p.Exited() != nil {
		t.Fatalf("stopped: PID %d, Exited %v", p.PID(), p.Exited())
	}
	if err := p.Signal(syscall.SIGCONT); err == nil {
		t.Error("Signal to a stopped process succeeded")
	}
	if err := os.Remove(ready); err != nil {
		t.Fatal(err)
	}
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	if p.PID() == first || p.PID() == 0 {
		t.Errorf("started again: PID %d, first %d", p.PID(), first)
	}
}

func TestProcessThatExitsAtStartQuotesItsLog(t *testing.T) {
	p := New(Spec{
		Name: "quitter", Path: "/bin/sh", Args: []string{"-c", "echo no config here >&2; exit 3"},
		Log:   filepath.Join(t.TempDir(), "log"),
		Ready: func() error { return errors.New("not yet") },
	})
	err := p.Start()
	if err == nil || !strings.Contains(err.Error(), "quitter exited at start: no config here") {
		t.Fatalf("Start: %v, want the exit and the log's last line", err)
	}
	if p.PID() != 0 {
		t.Errorf("PID %d after a failed start", p.PID())
	}
}
