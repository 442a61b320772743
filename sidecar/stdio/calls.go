package stdio

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
)

// dedupCall is one deduplicated tools/call from the client, from the line
// that carried it until its upstream forward (if any) has ended, and for
// cancelGrace after: the client's cancel for it is swallowed all that time.
type dedupCall struct {
	cancel context.CancelFunc
	// cancelled is set when the client cancelled the request: it gets no
	// answer, but a call already running upstream goes on.
	cancelled atomic.Bool
	entry     *engine.Call[*dedupCall]

	// fwdDone is closed when this call's forward to the server ended,
	// with fwdErr set before.
	fwdDone chan struct{}
	fwdErr  error
}

// calls are the deduplicated calls by request id (mcpmsg.IDKey), kept for
// engine.CancelGrace after they end.
type calls struct {
	set *engine.InFlight[*dedupCall]
}

func newCalls() *calls { return &calls{set: engine.NewInFlight[*dedupCall](engine.CancelGrace)} }

// start registers a new call with one reference, or returns nil if a call
// with this id is still in flight (a client reusing an id).
func (t *calls) start(key string, cancel context.CancelFunc) *dedupCall {
	c := &dedupCall{cancel: cancel, fwdDone: make(chan struct{})}
	if c.entry = t.set.Start(key, c); c.entry == nil {
		return nil
	}
	return c
}

func (t *calls) hold(c *dedupCall)    { t.set.Hold(c.entry) }
func (t *calls) release(c *dedupCall) { t.set.Release(c.entry) }

// cancelled marks the call with this id cancelled by the client and stops
// it waiting; it reports whether the cancel belongs to a deduplicated call
// and must not reach the server.
func (t *calls) cancelled(key string) bool {
	e, ok := t.set.Get(key)
	if !ok {
		return false
	}
	e.Value.cancelled.Store(true)
	e.Value.cancel()
	return true
}

// pending is a deduplicated call written to the server, waiting for the
// response with its id.
type pending struct {
	call *dedupCall
	done chan struct{}
	resp []byte
	err  error
	// tooLarge is the size of a response that was over the limit: the
	// call ran, its response was dropped.
	tooLarge int64
}

// router hands the server's responses to the deduplicated calls waiting
// for them, by request id.
type router struct {
	mu     sync.Mutex
	m      map[string]*pending
	closed error
}

func newRouter() *router { return &router{m: make(map[string]*pending)} }

func (r *router) expect(key string, c *dedupCall) (*pending, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed != nil {
		return nil, r.closed
	}
	p := &pending{call: c, done: make(chan struct{})}
	r.m[key] = p
	return p, nil
}

// take removes and returns the call waiting for a response with this id.
func (r *router) take(key string) *pending {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.m[key]
	delete(r.m, key)
	return p
}

func (r *router) drop(key string, p *pending) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m[key] == p {
		delete(r.m, key)
	}
}

// close fails every waiting call with err, and every later one.
func (r *router) close(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed != nil {
		return
	}
	r.closed = err
	for k, p := range r.m {
		p.err = err
		close(p.done)
		delete(r.m, k)
	}
}

// idList remembers the ids of the client's tools/list requests, so that
// their responses teach the engine each tool's readOnlyHint.
type idList struct {
	mu sync.Mutex
	m  map[string]struct{}
}

// maxListsInFlight bounds idList against a server that never answers.
const maxListsInFlight = 1024

func newIDList() *idList { return &idList{m: make(map[string]struct{})} }

func (l *idList) add(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.m) < maxListsInFlight {
		l.m[key] = struct{}{}
	}
}

func (l *idList) take(key string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.m[key]
	delete(l.m, key)
	return ok
}

// tracker counts the goroutines answering deduplicated calls; once closed
// it starts no more, so that waiting for the rest is safe.
type tracker struct {
	mu     sync.Mutex
	wg     sync.WaitGroup
	closed bool
}

func (t *tracker) add() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	t.wg.Add(1)
	return true
}

func (t *tracker) done() { t.wg.Done() }

// closeAndWait refuses new goroutines and waits for the running ones,
// at most timeout; it reports whether they all ended.
func (t *tracker) closeAndWait(timeout time.Duration) bool {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	done := make(chan struct{})
	go func() { t.wg.Wait(); close(done) }()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-done:
		return true
	case <-timer.C:
		return false
	}
}

// upstreamError is a forward that failed; its code and message answer the
// client.
type upstreamError struct {
	code int
	msg  string
	// relayed: the client already got the server's line; answer nothing.
	relayed bool
}

func (e *upstreamError) Error() string { return e.msg }
