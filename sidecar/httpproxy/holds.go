package httpproxy

import (
	"context"
	"net/http"
	"sync"
	"time"
)

// serveDelete holds a session's DELETE until its deduplicated calls have
// finished upstream: a client that drops and closes its session must not
// make the server discard a result its retry is about to ask for.
func (p *Proxy) serveDelete(w http.ResponseWriter, r *http.Request) {
	if wait := p.flights.wait(r.Header.Get(HeaderSessionID)); wait != nil {
		timer := time.NewTimer(p.opts.DeleteHold)
		select {
		case <-wait:
		case <-timer.C:
			p.log.Warn("Forwarding a session DELETE while deduplicated calls still run", "hold", p.opts.DeleteHold)
		}
		timer.Stop()
		// The client may have given up on its DELETE meanwhile; the
		// server should still hear it.
		r = r.WithContext(context.WithoutCancel(r.Context()))
	}
	p.rp.ServeHTTP(w, r)
}

// flights counts each session's deduplicated calls running upstream.
type flights struct {
	mu       sync.Mutex
	sessions map[string]*flight
}

type flight struct {
	n    int
	idle chan struct{} // closed when n drops to 0
}

func newFlights() *flights { return &flights{sessions: make(map[string]*flight)} }

func (f *flights) start(session string) (release func()) {
	if session == "" {
		return func() {}
	}
	f.mu.Lock()
	fl, ok := f.sessions[session]
	if !ok {
		fl = &flight{idle: make(chan struct{})}
		f.sessions[session] = fl
	}
	fl.n++
	f.mu.Unlock()
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		fl.n--
		if fl.n == 0 {
			close(fl.idle)
			delete(f.sessions, session)
		}
	}
}

// wait returns a channel closed when the session has no call in flight,
// or nil if it has none now.
func (f *flights) wait(session string) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if fl, ok := f.sessions[session]; ok && session != "" {
		return fl.idle
	}
	return nil
}
