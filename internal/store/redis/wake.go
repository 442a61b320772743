package redisstore

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/store"
)

// confirmWait bounds how long the first Wait of a Store waits for its
// subscription to be confirmed. Going on without it risks only a lost
// wake-up, which the poll catches.
const confirmWait = time.Second

// wakeHub multiplexes one subscription to a Store's waiters: Complete and
// Release publish the record key on one channel per prefix, so a sidecar
// holds one pub/sub connection however many calls wait, instead of one
// connection (or a SUBSCRIBE and UNSUBSCRIBE) per waiter.
type wakeHub struct {
	client  redis.UniversalClient
	channel string
	closed  chan struct{}

	subMu     sync.Mutex // guards pubsub and its start
	pubsub    *redis.PubSub
	ready     chan struct{} // closed at the first subscription confirmation
	readyOnce sync.Once
	closeOnce sync.Once

	mu      sync.Mutex
	waiters store.Waiters
	resub   chan struct{} // closed, and replaced, at every (re)subscription
}

func newWakeHub(c redis.UniversalClient, channel string) *wakeHub {
	return &wakeHub{
		client:  c,
		channel: channel,
		closed:  make(chan struct{}),
		ready:   make(chan struct{}),
		waiters: store.Waiters{},
		resub:   make(chan struct{}),
	}
}

// listen registers a waiter for key. The returned channel receives when a
// wake-up for key arrives.
func (h *wakeHub) listen(ctx context.Context, key string) (chan struct{}, error) {
	h.subscribe(ctx)
	w := make(chan struct{}, 1)
	h.mu.Lock()
	defer h.mu.Unlock()
	select {
	case <-h.closed:
		return nil, fmt.Errorf("%w: store closed", store.ErrUnavailable)
	default:
	}
	h.waiters.Add(key, w)
	return w, nil
}

func (h *wakeHub) stop(key string, w chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.waiters.Remove(key, w)
}

// resubscribed returns a channel closed at the next (re)subscription.
func (h *wakeHub) resubscribed() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.resub
}

// subscribe starts the subscription on first use, so a Store that never
// waits holds no pub/sub connection, and waits a little for it to be
// confirmed. go-redis then keeps it alive: it pings the connection and
// reconnects and resubscribes after Redis restarts or fails over.
func (h *wakeHub) subscribe(ctx context.Context) {
	h.subMu.Lock()
	select {
	case <-h.closed:
		h.subMu.Unlock()
		return
	default:
	}
	if h.pubsub == nil {
		// Not the caller's ctx: the subscription outlives this Wait.
		h.pubsub = h.client.Subscribe(context.Background(), h.channel)
		go h.dispatch(h.pubsub.ChannelWithSubscriptions())
	}
	h.subMu.Unlock()

	t := time.NewTimer(confirmWait)
	defer t.Stop()
	select {
	case <-h.ready:
	case <-t.C:
	case <-ctx.Done():
	case <-h.closed:
	}
}

func (h *wakeHub) dispatch(ch <-chan any) {
	for m := range ch {
		switch m := m.(type) {
		case *redis.Subscription:
			if m.Kind != "subscribe" {
				continue
			}
			h.mu.Lock()
			close(h.resub)
			h.resub = make(chan struct{})
			h.mu.Unlock()
			h.readyOnce.Do(func() { close(h.ready) })
		case *redis.Message:
			h.mu.Lock()
			h.waiters.Wake(m.Payload)
			h.mu.Unlock()
		}
	}
}

func (h *wakeHub) close() {
	h.closeOnce.Do(func() {
		close(h.closed)
		h.subMu.Lock()
		defer h.subMu.Unlock()
		if h.pubsub != nil {
			_ = h.pubsub.Close()
		}
	})
}
