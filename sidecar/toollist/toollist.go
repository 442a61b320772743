// Package toollist lets the proxy learn the upstream's tool annotations on
// its own account: Auto mode passes read-only tools through, and must not
// depend on a client that happens to call tools/list (many never do, and a
// fresh replica has seen none). A Lister lists the tools at start, again
// when the server says the list changed, and when a call names a tool no
// listing has named. HTTP (a session of its own on the upstream) and Stdio
// (requests in the client's session, through the wrapper) are how one
// listing is done for each transport.
package toollist

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemcp/idemcp/internal/engine"
)

// ListFunc does one full listing (every page), feeding each page's result
// to hints.ObserveListResult.
type ListFunc func(ctx context.Context, hints *engine.ToolHints) error

// Options configure a Lister.
type Options struct {
	Hints *engine.ToolHints
	List  ListFunc
	// Wait bounds how long a call to an unknown tool waits for a listing
	// (default engine.DefaultUnknownToolWait).
	Wait time.Duration
	// MinInterval is the least time between two listings that unknown
	// tools ask for, so that calls to a tool the server does not have do
	// not list the tools each time (default 10s).
	MinInterval time.Duration
	// Timeout bounds one listing (default 10s).
	Timeout time.Duration
	// Registerer gets idemcp_unknown_tool_calls_total (nil: not registered).
	Registerer prometheus.Registerer
	Logger     *slog.Logger
	// Listed, when set, is called after each listing that succeeded: at
	// start and on each change of the list (engine.ReportAnnotations).
	Listed func()
	// ListIn, when set, does one listing in a caller's context (its
	// client's capabilities and credentials), for a tool the sidecar's
	// own listing does not name.
	ListIn func(ctx context.Context, hints *engine.ToolHints, lc engine.ListingContext) error
	// MaxContextListings bounds the listings in callers' contexts in
	// flight at once, all contexts together (default 16): each is a
	// session on the server, and a client that names unknown tools under
	// many credentials must not multiply them.
	MaxContextListings int
	// OverBound, when set, is called for each listing in a caller's
	// context not started because MaxContextListings were in flight.
	OverBound func()
}

// maxContexts bounds the callers' contexts whose listings are kept.
const maxContexts = 256

// contextTTL is how long a listing in a caller's context is reused.
const contextTTL = time.Minute

// DefaultMaxContextListings is Options.MaxContextListings's default.
const DefaultMaxContextListings = 16

// contextListing is one listing in a caller's context.
type contextListing struct {
	hints *engine.ToolHints
	done  chan struct{}
	at    time.Time
}

// Lister is safe for concurrent use.
type Lister struct {
	o       Options
	unknown prometheus.Counter

	mu      sync.Mutex
	running chan struct{} // closed when the listing in progress ends
	again   bool          // the list changed while a listing ran
	ended   time.Time     // when the last listing ended
	ok      bool          // whether any listing succeeded
	failing bool          // whether the last listing failed (warned once)
	base    context.Context

	contexts  map[string]*contextListing // by contextKey
	inContext int                        // listings in callers' contexts in flight
	bounded   bool                       // whether the bound was reported (warned once)
}

// contextKey names a caller's context by a hash: credentials are never
// kept as map keys.
func contextKey(lc engine.ListingContext) string {
	h := sha256.New()
	h.Write(lc.Capabilities)
	h.Write([]byte{0})
	h.Write([]byte(lc.Header))
	h.Write([]byte{0})
	h.Write([]byte(lc.Value))
	return string(h.Sum(nil))
}

// LearnIn implements engine.ContextLearner: it lists the tools in lc's
// context, or joins the listing of the same context made less than
// contextTTL ago, and waits for it at most Wait. With MaxContextListings
// in flight it starts none and returns nil at once: the call's tool is
// unknown, so Auto deduplicates it, as it does any tool no listing names.
func (l *Lister) LearnIn(lc engine.ListingContext) *engine.ToolHints {
	if l.o.ListIn == nil {
		return nil
	}
	key := contextKey(lc)
	now := time.Now()
	l.mu.Lock()
	c := l.contexts[key]
	if (c == nil || now.Sub(c.at) > contextTTL) && l.inContext >= l.o.MaxContextListings {
		warn := !l.bounded
		l.bounded = true
		l.mu.Unlock()
		if l.o.OverBound != nil {
			l.o.OverBound()
		}
		if warn {
			l.o.Logger.Warn("Listings of the MCP server's tools in callers' contexts are at their bound; a call to a tool no listing named is deduplicated without one", "bound", l.o.MaxContextListings)
		}
		return nil
	}
	if c == nil || now.Sub(c.at) > contextTTL {
		if l.contexts == nil || len(l.contexts) >= maxContexts {
			for k, old := range l.contexts {
				if now.Sub(old.at) > contextTTL || len(l.contexts) >= maxContexts {
					delete(l.contexts, k)
				}
			}
			if l.contexts == nil {
				l.contexts = map[string]*contextListing{}
			}
		}
		c = &contextListing{hints: engine.NewToolHints(), done: make(chan struct{}), at: now}
		l.contexts[key] = c
		l.inContext++
		base := l.base
		go func() {
			defer close(c.done)
			defer func() {
				l.mu.Lock()
				l.inContext--
				l.mu.Unlock()
			}()
			defer func() { _ = recover() }() // what a server sends never ends the process
			ctx, cancel := context.WithTimeout(base, l.o.Timeout)
			defer cancel()
			if err := l.o.ListIn(ctx, c.hints, lc); err != nil {
				l.o.Logger.Debug("Listing the MCP server's tools in a caller's context failed", "err", err)
			}
		}()
	}
	l.mu.Unlock()
	timer := time.NewTimer(l.o.Wait)
	defer timer.Stop()
	select {
	case <-c.done:
	case <-timer.C:
	}
	return c.hints
}

// New returns a Lister and makes hints use it.
func New(o Options) *Lister {
	if o.Wait <= 0 {
		o.Wait = engine.DefaultUnknownToolWait
	}
	if o.MinInterval <= 0 {
		o.MinInterval = 10 * time.Second
	}
	if o.Timeout <= 0 {
		o.Timeout = 10 * time.Second
	}
	if o.MaxContextListings <= 0 {
		o.MaxContextListings = DefaultMaxContextListings
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	l := &Lister{o: o, base: context.Background(), unknown: prometheus.NewCounter(prometheus.CounterOpts{
		Name: "idemcp_unknown_tool_calls_total",
		Help: "Calls under defaultMode Auto to a tool no tools/list had named within the wait; they are deduplicated.",
	})}
	if o.Registerer != nil {
		o.Registerer.MustRegister(l.unknown)
	}
	o.Hints.SetLearner(l, o.Wait, l.onUnknown)
	return l
}

// UnknownCalls is the number of calls to tools still unknown after the wait.
func (l *Lister) UnknownCalls() prometheus.Counter { return l.unknown }

func (l *Lister) onUnknown(tool string) {
	l.unknown.Inc()
	l.o.Logger.Debug("A call names a tool no tools/list has named; deduplicating it", "tool", tool)
}

// Start lists the tools now, and retries with backoff until a listing
// succeeds or ctx ends (the server may start after the proxy). Later
// listings run under ctx too.
func (l *Lister) Start(ctx context.Context) {
	l.mu.Lock()
	l.base = ctx
	l.mu.Unlock()
	go func() {
		backoff := 250 * time.Millisecond
		// About two minutes of tries; after that, calls to unknown tools
		// still ask for listings.
		for range startAttempts {
			<-l.refresh(true)
			l.mu.Lock()
			ok := l.ok
			l.mu.Unlock()
			if ok {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 30*time.Second)
		}
	}()
}

// startAttempts bounds Start's retries.
const startAttempts = 12

// Learn implements engine.Learner.
func (l *Lister) Learn(string) <-chan struct{} { return l.refresh(false) }

// Changed is called when the server sends notifications/tools/list_changed:
// the tools are listed again, after the listing in progress if any.
func (l *Lister) Changed() {
	l.mu.Lock()
	if l.running != nil {
		l.again = true
		l.mu.Unlock()
		return
	}
	l.mu.Unlock()
	l.refresh(true)
}

var closed = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// refresh starts a listing unless one runs (then it is joined) or, when
// not forced, one ended less than MinInterval ago.
func (l *Lister) refresh(force bool) <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.running != nil {
		return l.running
	}
	gap := l.o.MinInterval
	if !l.ok {
		gap = time.Second // the server may just be starting
	}
	if !force && !l.ended.IsZero() && time.Since(l.ended) < gap {
		return closed
	}
	done := make(chan struct{})
	l.running = done
	base := l.base
	go l.run(base, done)
	return done
}

// listOnce runs one listing; what a server sends must never end the
// process, so a panic is a failed listing.
func (l *Lister) listOnce(base context.Context) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("listing panicked: %v", r)
		}
	}()
	ctx, cancel := context.WithTimeout(base, l.o.Timeout)
	defer cancel()
	return l.o.List(ctx, l.o.Hints)
}

func (l *Lister) run(base context.Context, done chan struct{}) {
	for {
		err := l.listOnce(base)
		l.mu.Lock()
		l.ended = time.Now()
		if err == nil {
			l.ok = true
		}
		again := l.again && base.Err() == nil
		l.again = false
		warn := err != nil && !l.failing
		l.failing = err != nil
		if !again {
			l.running = nil
			close(done)
			l.mu.Unlock()
			switch {
			case warn:
				l.o.Logger.Warn("Listing the MCP server's tools failed; calls to tools not yet listed are deduplicated", "err", err)
			case err != nil:
				l.o.Logger.Debug("Listing the MCP server's tools failed again", "err", err)
			default:
				l.o.Logger.Debug("Listed the MCP server's tools")
				if l.o.Listed != nil {
					l.o.Listed()
				}
			}
			return
		}
		l.mu.Unlock()
	}
}
