package store

import (
	"container/list"
	"context"
	"sync"
	"time"
)

// DefaultMaxEntries bounds a memory store that is given no bound.
const DefaultMaxEntries = 100_000

var _ Store = (*Memory)(nil)

// Memory is a store inside one sidecar: no infrastructure, nothing shared
// between replicas. It is bounded: when full, expired records go first,
// then the oldest completed ones; a pending claim is never evicted.
type Memory struct {
	mu         sync.Mutex
	entries    map[string]*memEntry
	order      *list.List // completed entries, oldest first
	maxEntries int
	now        func() time.Time
	stop       chan struct{}
	stopOnce   sync.Once
}

type memEntry struct {
	fingerprint string
	owner       string
	response    []byte
	completed   bool
	leaseUntil  time.Time
	expires     time.Time
	done        chan struct{} // closed when the pending claim ends
	elem        *list.Element
}

// NewMemory returns a memory store holding at most maxEntries records
// (DefaultMaxEntries if maxEntries <= 0).
func NewMemory(maxEntries int) *Memory {
	if maxEntries <= 0 {
		maxEntries = DefaultMaxEntries
	}
	m := &Memory{
		entries:    make(map[string]*memEntry),
		order:      list.New(),
		maxEntries: maxEntries,
		now:        time.Now,
		stop:       make(chan struct{}),
	}
	go m.janitor(time.Minute)
	return m
}

func (m *Memory) janitor(every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-t.C:
			m.mu.Lock()
			m.sweepLocked(m.now())
			m.mu.Unlock()
		}
	}
}

func (m *Memory) sweepLocked(now time.Time) {
	for k, e := range m.entries {
		if !now.Before(e.expires) {
			m.deleteLocked(k, e)
		}
	}
}

func (m *Memory) deleteLocked(key string, e *memEntry) {
	delete(m.entries, key)
	if e.elem != nil {
		m.order.Remove(e.elem)
	}
	if !e.completed {
		close(e.done)
	}
}

// makeRoomLocked keeps the store within its bound before an insert.
func (m *Memory) makeRoomLocked(now time.Time) bool {
	if len(m.entries) < m.maxEntries {
		return true
	}
	m.sweepLocked(now)
	for len(m.entries) >= m.maxEntries {
		front := m.order.Front()
		if front == nil {
			return false // everything is pending
		}
		key := front.Value.(string)
		m.deleteLocked(key, m.entries[key])
	}
	return true
}

// Reserve implements Store.
func (m *Memory) Reserve(_ context.Context, c Claim) (Reservation, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	if e, ok := m.entries[c.Key]; ok && now.Before(e.expires) {
		switch {
		case e.completed:
			return Reservation{State: Completed, Fingerprint: e.fingerprint, Response: e.response}, nil
		case now.Before(e.leaseUntil):
			return Reservation{State: Pending, Fingerprint: e.fingerprint}, nil
		case !c.TakeOver:
			return Reservation{State: Abandoned, Fingerprint: e.fingerprint}, nil
		}
		close(e.done) // wake waiters of the dead owner's claim
		m.entries[c.Key] = newPending(c, now)
		return Reservation{State: Won, Fingerprint: e.fingerprint, TookOver: true}, nil
	} else if ok {
		m.deleteLocked(c.Key, e)
	}
	if !m.makeRoomLocked(now) {
		return Reservation{}, errFull
	}
	m.entries[c.Key] = newPending(c, now)
	return Reservation{State: Won}, nil
}

var errFull = &fullError{}

type fullError struct{}

func (*fullError) Error() string { return "memory store is full of pending claims" }
func (*fullError) Unwrap() error { return ErrUnavailable }

func newPending(c Claim, now time.Time) *memEntry {
	retention := max(c.Retention, c.Lease)
	return &memEntry{
		fingerprint: c.Fingerprint,
		owner:       c.Owner,
		leaseUntil:  now.Add(c.Lease),
		expires:     now.Add(retention),
		done:        make(chan struct{}),
	}
}

// ownedLocked returns the live pending entry held by owner.
func (m *Memory) ownedLocked(key, owner string, now time.Time) (*memEntry, error) {
	e, ok := m.entries[key]
	if !ok || e.completed || e.owner != owner || !now.Before(e.expires) {
		return nil, ErrNotOwner
	}
	return e, nil
}

// Renew implements Store.
func (m *Memory) Renew(_ context.Context, key, owner string, lease time.Duration) error {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.ownedLocked(key, owner, now)
	if err != nil {
		return err
	}
	e.leaseUntil = now.Add(lease)
	if e.expires.Before(e.leaseUntil) {
		e.expires = e.leaseUntil
	}
	return nil
}

// Complete implements Store.
func (m *Memory) Complete(_ context.Context, key, owner string, response []byte, ttl time.Duration) error {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.ownedLocked(key, owner, now)
	if err != nil {
		return err
	}
	e.completed = true
	e.response = response
	e.expires = now.Add(ttl)
	e.elem = m.order.PushBack(key)
	close(e.done)
	return nil
}

// Release implements Store.
func (m *Memory) Release(_ context.Context, key, owner string) error {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.ownedLocked(key, owner, now)
	if err != nil {
		return err
	}
	m.deleteLocked(key, e)
	return nil
}

// Wait implements Store.
func (m *Memory) Wait(ctx context.Context, key string) error {
	now := m.now()
	m.mu.Lock()
	e, ok := m.entries[key]
	if !ok || e.completed || !now.Before(e.leaseUntil) || !now.Before(e.expires) {
		m.mu.Unlock()
		return nil
	}
	done, leaseLeft := e.done, e.leaseUntil.Sub(now)
	m.mu.Unlock()
	// The lease may be renewed meanwhile: the caller reserves again and,
	// still finding it pending, waits again.
	t := time.NewTimer(leaseLeft)
	defer t.Stop()
	select {
	case <-done:
		return nil
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Ping implements Store.
func (m *Memory) Ping(context.Context) error { return nil }

// Len reports how many records the store holds.
func (m *Memory) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.entries)
}

// Close implements Store.
func (m *Memory) Close() error {
	m.stopOnce.Do(func() { close(m.stop) })
	return nil
}
