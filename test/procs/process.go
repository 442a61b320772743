package procs

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Spec says how to run one process and how to tell that it serves.
type Spec struct {
	// Name names the process in errors ("redis-server", "the sidecar").
	Name string
	Path string
	Args []string
	// Env is the whole environment; nil is the test binary's own.
	Env []string
	// Credential runs the process as another user (PostgreSQL refuses
	// root).
	Credential *syscall.Credential
	// Log is a file the process's stdout and stderr are appended to, and
	// whose last lines an error quotes; a server that writes its own log
	// there (redis-server --logfile) may share it. Empty: both discarded.
	Log string
	// Stderr, when set, takes the process's stderr instead of Log.
	Stderr io.Writer
	// Ready returns nil once the process serves; nil means started is
	// ready.
	Ready func() error
	// ReadyTimeout bounds the wait for Ready (default 10s); a process not
	// ready by then is killed.
	ReadyTimeout time.Duration
	// StopSignal is what Stop sends first (default SIGKILL, as a crash);
	// after StopGrace (default 10s) the process is killed.
	StopSignal syscall.Signal
	StopGrace  time.Duration
	// DeathSignal is what the process gets when the test binary dies
	// (Linux; default SIGKILL), so that an interrupted test run leaves
	// nothing behind.
	DeathSignal syscall.Signal
}

// Process is one supervised process that can be stopped and started again
// with the same Spec (same arguments, so the same ports).
type Process struct {
	spec Spec

	mu     sync.Mutex
	proc   *os.Process
	exited chan struct{} // nil while stopped; closed when the process ends
}

// New returns a Process that is not running yet.
func New(spec Spec) *Process {
	if spec.ReadyTimeout == 0 {
		spec.ReadyTimeout = 10 * time.Second
	}
	if spec.StopSignal == 0 {
		spec.StopSignal = syscall.SIGKILL
	}
	if spec.StopGrace == 0 {
		spec.StopGrace = 10 * time.Second
	}
	if spec.DeathSignal == 0 {
		spec.DeathSignal = syscall.SIGKILL
	}
	if spec.Name == "" {
		spec.Name = spec.Path
	}
	return &Process{spec: spec}
}

// Command is exec.Command for a process that dies with the test binary
// (Linux) and runs with cred, when not nil.
func Command(cred *syscall.Credential, name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	setDeathSignal(cmd.SysProcAttr, syscall.SIGKILL)
	return cmd
}

// Start runs the process and waits until Ready says it serves. Starting a
// running process does nothing.
func (p *Process) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exited != nil {
		return nil
	}
	cmd := Command(p.spec.Credential, p.spec.Path, p.spec.Args...)
	setDeathSignal(cmd.SysProcAttr, p.spec.DeathSignal)
	cmd.Env = p.spec.Env
	if p.spec.Log != "" {
		logf, err := os.OpenFile(p.spec.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return err
		}
		defer func() { _ = logf.Close() }()
		if c := p.spec.Credential; c != nil {
			// A server that opens Log itself (pgbouncer's logfile) runs as
			// that user.
			if err := logf.Chown(int(c.Uid), int(c.Gid)); err != nil {
				return err
			}
		}
		cmd.Stdout, cmd.Stderr = logf, logf
	}
	if p.spec.Stderr != nil {
		cmd.Stderr = p.spec.Stderr
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("%s: %w", p.spec.Name, err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	if p.spec.Ready != nil {
		deadline := time.Now().Add(p.spec.ReadyTimeout)
		for {
			err := p.spec.Ready()
			if err == nil {
				break
			}
			select {
			case <-exited:
				return fmt.Errorf("%s exited at start: %s", p.spec.Name, p.LogTail())
			case <-time.After(20 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				_ = cmd.Process.Kill()
				<-exited
				return fmt.Errorf("%s not ready within %v: %w: %s", p.spec.Name, p.spec.ReadyTimeout, err, p.LogTail())
			}
		}
	}
	p.proc, p.exited = cmd.Process, exited
	return nil
}

// Stop ends the process with StopSignal, and kills it if it is still there
// after StopGrace. Stopping a stopped process does nothing.
func (p *Process) Stop() { p.stop(p.spec.StopSignal) }

// Kill ends the process with SIGKILL, as an OOM kill or a lost node would.
func (p *Process) Kill() { p.stop(syscall.SIGKILL) }

func (p *Process) stop(sig syscall.Signal) {
	p.mu.Lock()
	proc, exited := p.proc, p.exited
	p.mu.Unlock()
	if exited == nil {
		return
	}
	_ = proc.Signal(sig)
	select {
	case <-exited:
	case <-time.After(p.spec.StopGrace):
		_ = proc.Kill()
		<-exited
	}
	p.mu.Lock()
	if p.exited == exited {
		p.proc, p.exited = nil, nil
	}
	p.mu.Unlock()
}

// Signal sends sig to the running process (SIGSTOP pauses it as a stalled
// VM would, SIGCONT resumes it).
func (p *Process) Signal(sig os.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.proc == nil {
		return errors.New("not running")
	}
	return p.proc.Signal(sig)
}

// PID is the process id while it runs, else 0.
func (p *Process) PID() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.proc == nil {
		return 0
	}
	return p.proc.Pid
}

// Exited is closed when the running process ends; nil while stopped.
func (p *Process) Exited() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exited
}

// LogTail is the last lines of Log.
func (p *Process) LogTail() string {
	if p.spec.Log == "" {
		return "(no log)"
	}
	f, err := os.Open(p.spec.Log)
	if err != nil {
		return "(no log)"
	}
	defer func() { _ = f.Close() }()
	b, _ := io.ReadAll(f)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.Join(lines[max(0, len(lines)-10):], "\n")
}
