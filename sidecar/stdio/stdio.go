// Package stdio is the `idemcp wrap` command: the dedup proxy in front of
// an MCP server that speaks the stdio transport. It starts the server as
// its child and relays newline-delimited JSON-RPC between its own stdin and
// stdout and the child's; deduplicated tools/call requests go through the
// same engine and policy as the sidecar's.
package stdio

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/idemcp/idemcp/internal/cli"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/storeopen"
	"github.com/idemcp/idemcp/internal/tracing"
	"github.com/idemcp/idemcp/sidecar/toollist"
)

// Defaults for Options.
const (
	DefaultMaxLineBytes     = 4 << 20
	DefaultMaxResponseBytes = 64 << 20
	DefaultShutdownTimeout  = 30 * time.Second
)

// childStopGrace is how long a child that was told to stop (its stdin
// closed, then SIGTERM) has before the next, harder step, as the MCP stdio
// transport asks of a client.
const childStopGrace = 5 * time.Second

// Options are the wrapper's flags; each also reads IDEMCP_<FLAG> from the
// environment, as the sidecar's do (see NewFlagSet).
type Options struct {
	PolicyFile string
	// Policy is an inline IdempotencyPolicy manifest (YAML or JSON).
	Policy string
	// RetryWindow, when not 0, overrides the policy's spec.retryWindow.
	RetryWindow time.Duration
	Store       storeopen.Options
	// MaxLineBytes bounds one message from the client.
	MaxLineBytes int
	// MaxResponseBytes bounds one message from the server.
	MaxResponseBytes int
	// ShutdownTimeout bounds how long deduplicated calls in flight may take
	// to finish once the client has hung up.
	ShutdownTimeout time.Duration
	LogLevel        string
	// Tracing exports a span for every tools/call (engine.TracingFlag).
	Tracing bool
}

// Flags registers the options on fs.
func (o *Options) Flags(fs *flag.FlagSet) {
	fs.StringVar(&o.PolicyFile, "policy-file", "", "an IdempotencyPolicy YAML file; only its spec is used (default: Memory store, Session scope, Auto, 24h TTL, 10m retry window)")
	fs.StringVar(&o.Policy, "policy", "", "an inline IdempotencyPolicy manifest (YAML or JSON); exclusive with --policy-file")
	fs.DurationVar(&o.RetryWindow, "retry-window", 0, policy.RetryWindowFlag)
	o.Store.Flags(fs)
	fs.IntVar(&o.MaxLineBytes, "max-line-bytes", DefaultMaxLineBytes, "largest message accepted from the client")
	fs.IntVar(&o.MaxResponseBytes, "max-response-bytes", DefaultMaxResponseBytes, "largest message relayed from the MCP server")
	fs.DurationVar(&o.ShutdownTimeout, "shutdown-timeout", DefaultShutdownTimeout, "how long deduplicated calls in flight may take to finish after the client hangs up")
	fs.Var(cli.Choice(&o.LogLevel, "info", "debug", "info", "warn", "error"), "log-level", "debug, info, warn or error")
	fs.BoolVar(&o.Tracing, "tracing", false, engine.TracingFlag)
}

const intro = `Usage: idemcp wrap [flags] -- CMD [ARGS...]

Runs the stdio MCP server CMD and relays its messages, making its tool
calls exactly-once. In an MCP host's configuration, replace
"node my-server.js" with "idemcp wrap -- node my-server.js".`

// NewFlagSet returns the flags of `idemcp wrap`, bound to o and to their
// IDEMCP_* environment variables.
func NewFlagSet(o *Options) *cli.Set {
	s := cli.New("idemcp wrap", intro)
	o.Flags(s.FlagSet)
	s.BindEnv("IDEMCP_")
	o.Store.BindEnv(s)
	return s
}

// Main runs `idemcp wrap ARGS` until the server exits, and exits with the
// server's exit code (128+N if a signal N killed it).
func Main(ctx context.Context, args []string) error {
	var o Options
	fs := NewFlagSet(&o)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() == 0 {
		return errors.New("no command to run: give the MCP server's command after --, such as: idemcp wrap -- node my-server.js")
	}
	w, err := New(o, fs.Args(), os.Stdin, os.Stdout, os.Stderr)
	if err != nil {
		return fs.Attribute(err)
	}
	code, err := w.Run(ctx)
	if err != nil {
		return fs.Attribute(err)
	}
	if code != 0 {
		// The server's exit code is ours: its host reads it.
		return ExitError{Code: code}
	}
	return nil
}

// ExitError carries the wrapped server's exit code to main.
type ExitError struct{ Code int }

func (e ExitError) Error() string { return fmt.Sprintf("the MCP server exited with code %d", e.Code) }

// ExitCode is the code the wrapper exits with.
func (e ExitError) ExitCode() int { return e.Code }

// Wrapper is a configured stdio proxy, ready to run its command once.
type Wrapper struct {
	opts      Options
	spans     *tracing.Lazy
	storeInfo storeopen.Info
	argv      []string
	log       *slog.Logger
	engine    *engine.Engine
	store     store.Store
	caller    engine.Caller

	in   io.Reader
	out  *lineWriter // to the client
	errw io.Writer

	cmd      *exec.Cmd
	childIn  *lineWriter
	childOut *os.File

	router *router
	calls  *calls
	lists  *idList
	tasks  tracker

	// The wrapper lists the server's tools itself, for Auto.
	ownList *toollist.Stdio
	lister  *toollist.Lister

	// base is the context of every deduplicated call; it ends when the
	// wrapper stops, so that waiting duplicates stop waiting.
	base       context.Context
	cancelBase context.CancelFunc
	stopMu     sync.Mutex
	stopWhy    string
	// signalled is set once the wrapper passed on or sent a signal;
	// signals has bit N set once it sent signal N.
	signalled atomic.Bool
	signals   atomic.Uint64
	// hungUp is set once the client closed the wrapper's stdin.
	hungUp atomic.Bool
}

// signal passes sig on to the MCP server, or sends it.
func (w *Wrapper) signal(sig os.Signal) {
	w.signalled.Store(true)
	if s, ok := sig.(syscall.Signal); ok && s > 0 && s < 64 {
		w.signals.Or(1 << uint(s))
	}
	_ = w.cmd.Process.Signal(sig)
}

// stoppedBy says whether exit code code is the server's death by a signal
// the wrapper passed on or sent to stop it, SIGKILL aside.
func (w *Wrapper) stoppedBy(code int) bool {
	s := code - 128
	return s > 0 && s < 64 && syscall.Signal(s) != syscall.SIGKILL && w.signals.Load()&(1<<uint(s)) != 0
}

// New checks the options, loads the policy and opens the store. stdin and
// stdout carry the client's messages; the child's stderr goes to stderr.
func New(o Options, argv []string, stdin io.Reader, stdout, stderr io.Writer) (*Wrapper, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.LogLevel)); err != nil {
		return nil, fmt.Errorf("--log-level: %q is not one of debug, info, warn, error", o.LogLevel)
	}
	if len(argv) == 0 {
		return nil, errors.New("no command to run")
	}
	if o.MaxLineBytes <= 0 {
		o.MaxLineBytes = DefaultMaxLineBytes
	}
	if o.MaxResponseBytes <= 0 {
		o.MaxResponseBytes = DefaultMaxResponseBytes
	}
	if o.ShutdownTimeout <= 0 {
		o.ShutdownTimeout = DefaultShutdownTimeout
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})).With("component", "idemcp-wrap")
	pol, err := policy.Load(o.PolicyFile, o.Policy)
	if err != nil {
		return nil, err
	}
	if pol, err = policy.WithRetryWindow(pol, o.RetryWindow); err != nil {
		return nil, err
	}
	if o.Store.Upstream == "" {
		// The command names the server: its key space is its own.
		o.Store.Upstream = "wrap\x00" + strings.Join(argv, "\x00")
	}
	st, info, err := storeopen.Open(o.Store, pol, log)
	if err != nil {
		return nil, err
	}
	var run [16]byte
	_, _ = rand.Read(run[:])
	tr, spans := engine.NewTracing(o.Tracing, "idemcp-wrap", log)
	eng := engine.New(engine.Options{Policy: pol, Store: st, Logger: log, Tracing: tr})
	w := &Wrapper{
		spans:     spans,
		opts:      o,
		storeInfo: info,
		argv:      argv,
		log:       log,
		engine:    eng,
		store:     st,
		// A stdio session is this process: its run id scopes keys derived
		// from arguments. Its one user is Local: explicit keys are shared
		// by every run of the wrapper on the same store, so a retry after
		// a restart finds its result.
		caller: engine.Caller{Session: "wrap-" + hex.EncodeToString(run[:]), Local: true},
		in:     stdin,
		out:    newLineWriter(stdout, nil),
		errw:   stderr,
		router: newRouter(),
		calls:  newCalls(),
		lists:  newIDList(),
	}
	w.ownList = toollist.NewStdio(func(line []byte) error { return w.childIn.writeLine(line) })
	w.lister = toollist.New(toollist.Options{Hints: eng.Hints(), List: w.ownList.List, Logger: log, Listed: eng.ReportAnnotations})
	return w, nil
}

// Engine returns the wrapper's engine.
func (w *Wrapper) Engine() *engine.Engine { return w.engine }

// Run starts the command, relays until it exits, and returns its exit code.
// Signals SIGINT, SIGTERM and SIGHUP are passed on to the command; ctx is
// not used to stop it, since the signals that end ctx reach the command.
func (w *Wrapper) Run(ctx context.Context) (int, error) {
	defer func() { _ = w.store.Close() }()
	w.base, w.cancelBase = context.WithCancel(context.WithoutCancel(ctx))
	defer w.cancelBase()

	// Broken pipes become write errors instead of killing the wrapper
	// before the child and the calls in flight are seen to.
	pipes := make(chan os.Signal, 1)
	signal.Notify(pipes, syscall.SIGPIPE)
	defer signal.Stop(pipes)

	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	if err := w.start(); err != nil {
		return 0, err
	}

	exited := make(chan struct{})
	go func() {
		_ = w.cmd.Wait()
		close(exited)
	}()
	childDone := make(chan struct{})
	go func() {
		defer close(childDone)
		w.readChild(exited)
	}()
	clientDone := make(chan struct{})
	go func() {
		defer close(clientDone)
		w.readClient()
	}()

	for waiting := true; waiting; {
		select {
		case sig := <-sigs:
			w.log.Debug("Passing a signal on to the MCP server", "signal", sig.String())
			w.signal(sig)
		case <-exited:
			waiting = false
		case <-clientDone:
			clientDone = nil
			w.hungUp.Store(true)
			go w.hangUp(exited)
		}
	}

	// The child is gone. Relay what it wrote before it went, then answer
	// what it never will.
	select {
	case <-childDone:
	case <-time.After(childStopGrace):
		// A grandchild holds its stdout open: stop reading.
		_ = w.childOut.Close()
		<-childDone
	}
	code := exitCode(w.cmd.ProcessState)
	w.stop(fmt.Sprintf("the MCP server exited with code %d", code))
	w.childIn.close()
	if !w.tasks.closeAndWait(childStopGrace) {
		w.log.Warn("Some calls were not answered before the wrapper exited")
	}
	drainCtx, cancel := context.WithTimeout(context.Background(), childStopGrace)
	defer cancel()
	if err := w.engine.Drain(drainCtx); err != nil {
		w.log.Error("Calls still settling at exit; their keys are freed when their leases expire", "err", err)
	}
	if err := w.spans.Shutdown(context.Background()); err != nil {
		w.log.Warn("Spans not exported at exit", "err", err)
	}
	switch {
	case code == 0:
		w.log.Debug("The MCP server exited", "code", code)
	case w.hungUp.Load() && w.stoppedBy(code):
		// The client closed the session, and the server stopped on the
		// signal that followed (a client sends SIGTERM when a server does
		// not exit on its stdin closing): a normal end, and exit code 0.
		w.log.Debug("The MCP server stopped on a signal after the client closed the session", "code", code)
		code = 0
	case w.signalled.Load():
		w.log.Info("The MCP server exited after a signal", "code", code)
	default:
		w.log.Error("The MCP server exited", "code", code, "command", w.argv[0])
	}
	return code, nil
}

func (w *Wrapper) start() error {
	inR, inW, err := os.Pipe()
	if err != nil {
		return err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		_ = inR.Close()
		_ = inW.Close()
		return err
	}
	// The child gets the pipes' ends as its own stdin and stdout, so Wait
	// can run while the relays still read.
	w.cmd = exec.Command(w.argv[0], w.argv[1:]...)
	w.cmd.Stdin, w.cmd.Stdout, w.cmd.Stderr = inR, outW, w.errw
	err = w.cmd.Start()
	_ = inR.Close()
	_ = outW.Close()
	if err != nil {
		_ = inW.Close()
		_ = outR.Close()
		return fmt.Errorf("starting the MCP server %q: %w", w.argv[0], err)
	}
	w.childIn = newLineWriter(inW, inW)
	w.childOut = outR
	// Only the program: servers often take tokens as arguments.
	w.log.Info("Wrapping an MCP server", append([]any{"command", w.argv[0], "pid", w.cmd.Process.Pid,
		"policy", w.engine.Policy().Hash}, w.storeInfo.LogAttrs()...)...)
	go storeopen.Check(w.base, w.store, w.storeInfo, w.engine.Policy(), w.log)
	return nil
}

// hangUp runs when the client closed our stdin. The deduplicated calls it
// sent run to the end, so that their results are kept for a retry; then
// the child's stdin is closed, as a client ends a stdio session, and a
// child that does not exit is signalled.
func (w *Wrapper) hangUp(exited <-chan struct{}) {
	w.log.Debug("The client closed stdin; finishing deduplicated calls before closing the MCP server's stdin")
	deadline := time.Now().Add(w.opts.ShutdownTimeout)
	finished := make(chan bool, 1)
	go func() { finished <- w.tasks.closeAndWait(w.opts.ShutdownTimeout) }()
	select {
	case ok := <-finished:
		if ok {
			ctx, cancel := context.WithDeadline(context.Background(), deadline)
			go func() {
				select {
				case <-exited:
					cancel()
				case <-ctx.Done():
				}
			}()
			if err := w.engine.Drain(ctx); err != nil && !isClosed(exited) {
				ok = false
			}
			cancel()
		}
		if !ok {
			w.log.Warn("Closing the MCP server's stdin while deduplicated calls still run", "timeout", w.opts.ShutdownTimeout)
		}
	case <-exited:
		return
	}
	w.stop("the client hung up")
	w.childIn.close()
	for _, sig := range []os.Signal{syscall.SIGTERM, os.Kill} {
		select {
		case <-exited:
			return
		case <-time.After(childStopGrace):
			if sig == os.Kill {
				w.log.Warn("The MCP server did not exit after SIGTERM; killing it", "signal", sig.String())
			} else {
				w.log.Debug("The MCP server did not exit after its stdin closed; signalling it", "signal", sig.String())
			}
			w.signal(sig)
		}
	}
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// stop ends the deduplicated calls' context: duplicates stop waiting, and
// calls running upstream are detached and finish on their own.
func (w *Wrapper) stop(why string) {
	w.stopMu.Lock()
	if w.stopWhy == "" {
		w.stopWhy = why
	}
	w.stopMu.Unlock()
	w.cancelBase()
}

func (w *Wrapper) stopReason() string {
	w.stopMu.Lock()
	defer w.stopMu.Unlock()
	return w.stopWhy
}

// exitCode is the child's exit code, 128+N when signal N killed it.
func exitCode(ps *os.ProcessState) int {
	if ps == nil {
		return 1
	}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ps.ExitCode()
}
