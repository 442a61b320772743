package pgstore

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcp/idemcp/internal/store"
)

// Backoff of the LISTEN connection after it failed.
const (
	listenRetryMin = 100 * time.Millisecond
	listenRetryMax = 5 * time.Second
	// confirmWait bounds how long the first Wait waits for the LISTEN
	// connection. Going on without it risks only a lost wake-up, which the
	// poll catches.
	confirmWait = time.Second
)

// wakeHub multiplexes one LISTEN connection to a Store's waiters: Complete
// and Release NOTIFY the record key on one channel, so a server holds one
// extra connection however many calls wait. The connection is opened on
// first use and reopened with backoff when it breaks.
type wakeHub struct {
	cfg    *pgx.ConnConfig
	closed <-chan struct{}

	startOnce sync.Once
	ready     chan struct{} // closed once the first LISTEN succeeded or failed
	readyOnce sync.Once
	exited    chan struct{}

	mu      sync.Mutex
	up      bool
	waiters store.Waiters
	resub   chan struct{} // closed, and replaced, at every (re)LISTEN
}

func newWakeHub(cfg *pgx.ConnConfig, closed <-chan struct{}) *wakeHub {
	return &wakeHub{
		cfg:     cfg,
		closed:  closed,
		ready:   make(chan struct{}),
		exited:  make(chan struct{}),
		waiters: store.Waiters{},
		resub:   make(chan struct{}),
	}
}

// listen registers a waiter for key. The channel receives when a wake-up
// for key arrives; listening reports whether the LISTEN connection is up
// (if not, the caller polls more often).
func (h *wakeHub) listen(ctx context.Context, key string) (w chan struct{}, listening bool) {
	h.startOnce.Do(func() { go h.loop() })
	t := time.NewTimer(confirmWait)
	select {
	case <-h.ready:
	case <-t.C:
	case <-ctx.Done():
	case <-h.closed:
	}
	t.Stop()
	w = make(chan struct{}, 1)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.waiters.Add(key, w)
	return w, h.up
}

func (h *wakeHub) stop(key string, w chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.waiters.Remove(key, w)
}

// resubscribed returns a channel closed at the next successful LISTEN.
func (h *wakeHub) resubscribed() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.resub
}

func (h *wakeHub) loop() {
	defer close(h.exited)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-h.closed:
			cancel()
		case <-ctx.Done():
		}
	}()
	backoff := listenRetryMin
	for ctx.Err() == nil {
		ok := h.session(ctx)
		h.readyOnce.Do(func() { close(h.ready) })
		if ok {
			backoff = listenRetryMin
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, listenRetryMax)
	}
}

// session holds one LISTEN connection until it fails; it reports whether
// the LISTEN went through.
func (h *wakeHub) session(ctx context.Context) bool {
	connectCtx, cancel := context.WithTimeout(ctx, h.cfg.ConnectTimeout+time.Second)
	conn, err := pgx.ConnectConfig(connectCtx, h.cfg)
	cancel()
	if err != nil {
		return false
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = conn.Close(closeCtx)
		cancel()
	}()
	if _, err := conn.Exec(ctx, `LISTEN `+Channel); err != nil {
		return false
	}
	h.mu.Lock()
	h.up = true
	close(h.resub)
	h.resub = make(chan struct{})
	h.mu.Unlock()
	h.readyOnce.Do(func() { close(h.ready) })
	defer func() {
		h.mu.Lock()
		h.up = false
		h.mu.Unlock()
	}()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return true
		}
		h.mu.Lock()
		h.waiters.Wake(n.Payload)
		h.mu.Unlock()
	}
}

// wait returns once the LISTEN loop has ended (after the Store closed).
func (h *wakeHub) wait() {
	h.startOnce.Do(func() { close(h.exited) }) // never started
	<-h.exited
}
