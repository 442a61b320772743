package engine

import (
	"container/list"
	"crypto/sha256"
	"encoding/json"
	"sync"
	"time"

	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// CancelGrace is how long after a deduplicated call ended its request id is
// still known, so a cancel that crossed the response is still swallowed
// (SDKs send cancels asynchronously).
const CancelGrace = time.Minute

// CancelKey names a call in an InFlight set: a hash of who sent it (parts
// such as the principal and session) and its request id, so a client-chosen
// id of any length costs a fixed 32 bytes and never matches another
// caller's call. A transport that cannot tell who sent a call (no session,
// no principal) uses NoCancelKey instead: such a caller has nothing to
// match, since its cancel might be another anonymous caller's.
func CancelKey(id json.RawMessage, parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	h.Write([]byte(mcpmsg.IDKey(id)))
	return string(h.Sum(nil))
}

// NoCancelKey is the key of a call whose caller is unknown: an InFlight
// never remembers it, so no cancel is ever taken for it.
const NoCancelKey = ""

// InFlight remembers the deduplicated calls of a transport by request id
// while they are referenced, and for CancelGrace after their last release,
// so that a client's cancel for one of them is recognized and not
// forwarded (DESIGN rule 5). Every operation is O(1): released entries wait
// in release order and expire from the front.
type InFlight[V any] struct {
	mu    sync.Mutex
	m     map[string]*Call[V]
	idle  *list.List // of *Call[V] with no references, oldest release first
	grace time.Duration
	now   func() time.Time
}

// Call is one entry of an InFlight.
type Call[V any] struct {
	Value   V
	key     string
	refs    int
	expires time.Time
	idle    *list.Element
}

// NewInFlight returns an empty set that keeps released calls for grace.
func NewInFlight[V any](grace time.Duration) *InFlight[V] {
	return &InFlight[V]{m: make(map[string]*Call[V]), idle: list.New(), grace: grace, now: time.Now}
}

// Start registers a call with one reference. It returns nil when a call
// with this id is still referenced (a client reusing an id in flight).
func (s *InFlight[V]) Start(key string, v V) *Call[V] {
	if key == NoCancelKey {
		return &Call[V]{Value: v, refs: 1}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked()
	if old, ok := s.m[key]; ok {
		if old.refs > 0 {
			return nil
		}
		s.idle.Remove(old.idle)
	}
	c := &Call[V]{Value: v, key: key, refs: 1}
	s.m[key] = c
	return c
}

// Acquire adds a reference to the call registered under key, or registers
// a new one with v.
func (s *InFlight[V]) Acquire(key string, v V) *Call[V] {
	if key == NoCancelKey {
		return &Call[V]{Value: v, refs: 1}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked()
	if c, ok := s.m[key]; ok {
		s.holdLocked(c)
		return c
	}
	c := &Call[V]{Value: v, key: key, refs: 1}
	s.m[key] = c
	return c
}

// Hold adds a reference to c.
func (s *InFlight[V]) Hold(c *Call[V]) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.holdLocked(c)
}

func (s *InFlight[V]) holdLocked(c *Call[V]) {
	if c.refs == 0 && c.idle != nil {
		s.idle.Remove(c.idle)
		c.idle = nil
	}
	c.refs++
}

// Release drops a reference; the last one starts the grace period.
func (s *InFlight[V]) Release(c *Call[V]) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c.refs--
	if c.refs == 0 && s.m[c.key] == c {
		c.expires = s.now().Add(s.grace)
		c.idle = s.idle.PushBack(c)
	}
	s.expireLocked()
}

// Get returns the call registered under key if it is referenced or was
// released less than the grace period ago.
func (s *InFlight[V]) Get(key string) (*Call[V], bool) {
	if key == NoCancelKey {
		return nil, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked()
	c, ok := s.m[key]
	return c, ok
}

// Len reports how many calls are remembered.
func (s *InFlight[V]) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m)
}

func (s *InFlight[V]) expireLocked() {
	now := s.now()
	for e := s.idle.Front(); e != nil; e = s.idle.Front() {
		c := e.Value.(*Call[V])
		if now.Before(c.expires) {
			return
		}
		s.idle.Remove(e)
		c.idle = nil
		delete(s.m, c.key)
	}
}
