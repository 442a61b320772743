package store

import (
	"bytes"
	"container/heap"
	"container/list"
	"context"
	"sync"
	"time"
)

// Bounds of a memory store that is given none.
const (
	DefaultMaxEntries = 100_000
	DefaultMaxBytes   = 64 << 20
)

// entryOverhead is what a record costs besides its strings: the map slot,
// the entry, its channel and list element.
const entryOverhead = 256

var _ Store = (*Memory)(nil)

// Memory is a store inside one sidecar: no infrastructure, nothing shared
// between replicas. It is bounded in records and in bytes: when full,
// expired records go first, then completed ones, oldest first, from the
// tenant (Claim.Tenant) that holds the largest part of the bound: one
// caller filling the store with cheap distinct calls evicts its own
// results before anyone else's. A pending claim is never evicted, and
// neither is the result just stored (a result larger than the whole bound
// is kept alone).
type Memory struct {
	mu         sync.Mutex
	entries    map[string]*memEntry
	tenants    map[string]*tenantUse
	byUse      tenantHeap // tenants with completed records, largest use first
	maxEntries int
	maxBytes   int64
	bytes      int64 // what every record costs, as entrySize counts
	now        func() time.Time
	lastSweep  time.Time // when sweepLocked last read every record
	stop       chan struct{}
	stopOnce   sync.Once
}

// sweepAtMost is how often a full store sweeps out expired records before
// an insert.
const sweepAtMost = time.Second

type memEntry struct {
	fingerprint string
	owner       string
	tenant      string
	tool, pod   string
	claimed     time.Time
	response    []byte
	completed   bool
	leaseUntil  time.Time
	expires     time.Time
	done        chan struct{} // closed when the pending claim ends
	elem        *list.Element // in its tenant's order, once completed
	size        int64
}

// tenantUse is what one tenant's completed records take.
type tenantUse struct {
	name    string
	order   *list.List // keys of completed records, oldest first
	records int
	bytes   int64
	index   int // in Memory.byUse
	m       *Memory
}

// use is the larger of the tenant's shares of the record and byte bounds.
func (t *tenantUse) use() float64 {
	return max(float64(t.records)/float64(t.m.maxEntries), float64(t.bytes)/float64(t.m.maxBytes))
}

type tenantHeap []*tenantUse

func (h tenantHeap) Len() int           { return len(h) }
func (h tenantHeap) Less(i, j int) bool { return h[i].use() > h[j].use() }
func (h tenantHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *tenantHeap) Push(x any) {
	t := x.(*tenantUse)
	t.index = len(*h)
	*h = append(*h, t)
}
func (h *tenantHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	*h = old[:len(old)-1]
	t.index = -1
	return t
}

// NewMemory returns a memory store holding at most maxEntries records
// (DefaultMaxEntries if maxEntries <= 0) and DefaultMaxBytes.
func NewMemory(maxEntries int) *Memory { return NewMemorySized(maxEntries, 0) }

// NewMemorySized returns a memory store holding at most maxEntries records
// (DefaultMaxEntries if <= 0) of at most maxBytes in all (DefaultMaxBytes
// if <= 0).
func NewMemorySized(maxEntries int, maxBytes int64) *Memory {
	if maxEntries <= 0 {
		maxEntries = DefaultMaxEntries
	}
	if maxBytes <= 0 {
		maxBytes = DefaultMaxBytes
	}
	m := &Memory{
		entries:    make(map[string]*memEntry),
		tenants:    make(map[string]*tenantUse),
		maxEntries: maxEntries,
		maxBytes:   maxBytes,
		now:        time.Now,
		stop:       make(chan struct{}),
	}
	go m.janitor(time.Minute)
	return m
}

// SetClock makes the store read the time from now instead of time.Now, so
// that a test can step over a ttl or a retry window without waiting. Call
// it before the store is used.
func (m *Memory) SetClock(now func() time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.now = now
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
	m.lastSweep = now
	for k, e := range m.entries {
		if !now.Before(e.expires) {
			m.deleteLocked(k, e)
		}
	}
}

func (m *Memory) deleteLocked(key string, e *memEntry) {
	delete(m.entries, key)
	m.bytes -= e.size
	if e.elem != nil {
		t := m.tenants[e.tenant]
		t.order.Remove(e.elem)
		e.elem = nil
		t.records--
		t.bytes -= e.size
		if t.records == 0 {
			heap.Remove(&m.byUse, t.index)
			delete(m.tenants, e.tenant)
		} else {
			heap.Fix(&m.byUse, t.index)
		}
	}
	if !e.completed {
		close(e.done)
	}
}

// addCompletedLocked counts a record just completed (and sized) in its
// tenant's use.
func (m *Memory) addCompletedLocked(key string, e *memEntry) {
	t, ok := m.tenants[e.tenant]
	if !ok {
		t = &tenantUse{name: e.tenant, order: list.New(), m: m}
		m.tenants[e.tenant] = t
		heap.Push(&m.byUse, t)
	}
	e.elem = t.order.PushBack(key)
	t.records++
	t.bytes += e.size
	heap.Fix(&m.byUse, t.index)
}

// victimLocked returns the oldest completed record of the tenant with the
// largest use, other than keep: the root of the heap, or (when the root's
// only record is keep) the larger of its children.
func (m *Memory) victimLocked(keep string) string {
	// keep is in one tenant's records: if that is the root's only one,
	// the next largest tenant is one of the root's children.
	cands := []int{0, 1, 2}
	if len(m.byUse) > 2 && m.byUse.Less(2, 1) {
		cands = []int{0, 2, 1}
	}
	for _, i := range cands {
		if i >= len(m.byUse) {
			break
		}
		for el := m.byUse[i].order.Front(); el != nil; el = el.Next() {
			if k := el.Value.(string); k != keep {
				return k
			}
		}
	}
	return ""
}

// putLocked adds or replaces a record and counts its size.
func (m *Memory) putLocked(key string, e *memEntry) {
	if old, ok := m.entries[key]; ok {
		m.bytes -= old.size
	}
	e.size = entrySize(key, e)
	m.bytes += e.size
	m.entries[key] = e
}

func entrySize(key string, e *memEntry) int64 {
	return int64(entryOverhead + len(key) + len(e.fingerprint) + len(e.owner) + len(e.tool) + len(e.pod) + len(e.response))
}

// makeRoomLocked keeps the store within its bounds before adding n records
// of extra bytes, sparing the record at keep. It reports false when only
// pending claims are left to evict and there are too many of them.
func (m *Memory) makeRoomLocked(now time.Time, n int, extra int64, keep string) bool {
	full := func() bool { return len(m.entries)+n > m.maxEntries || m.bytes+extra > m.maxBytes }
	if !full() {
		return true
	}
	// A sweep reads every record: once a second at most, or a full store
	// would pay it on every insert (7ms a call at 100,000 records, under
	// the store's one lock). Between sweeps an expired record is evicted
	// as a live one is (victimLocked, oldest first), so a live record
	// older than it may go first; a store left with only pending claims
	// sweeps before it refuses one.
	if now.Sub(m.lastSweep) >= sweepAtMost || now.Before(m.lastSweep) {
		m.sweepLocked(now)
	}
	for full() {
		key := m.victimLocked(keep)
		if key == "" && !m.lastSweep.Equal(now) {
			// Only pending claims are left, some perhaps expired since
			// the last sweep: sweep before refusing.
			m.sweepLocked(now)
			continue
		}
		if key == "" {
			// Only pending claims (and the record kept) are left: a
			// pending claim is never evicted. Over the byte bound that
			// is allowed; over the record bound the insert is refused.
			return len(m.entries)+n <= m.maxEntries
		}
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
		case e.completed && c.Discard != nil && bytes.Equal(e.response, c.Discard):
			m.deleteLocked(c.Key, e)
			m.putLocked(c.Key, newPending(c, now))
			return Reservation{State: Won}, nil
		case e.completed:
			return Reservation{State: Completed, Fingerprint: e.fingerprint, Response: e.response}, nil
		case now.Before(e.leaseUntil):
			return Reservation{State: Pending, Fingerprint: e.fingerprint}, nil
		case !c.TakeOver:
			return Reservation{State: Abandoned, Fingerprint: e.fingerprint}, nil
		}
		if e.fingerprint != c.Fingerprint {
			// Another call's claim: whoever reuses its key with other
			// arguments is told, and it stays as it is.
			return Reservation{State: Abandoned, Fingerprint: e.fingerprint}, nil
		}
		close(e.done) // wake waiters of the dead owner's claim
		m.putLocked(c.Key, newPending(c, now))
		return Reservation{State: Won, Fingerprint: e.fingerprint, TookOver: true}, nil
	} else if ok {
		m.deleteLocked(c.Key, e)
	}
	if !m.makeRoomLocked(now, 1, entryOverhead, "") {
		return Reservation{}, errFull
	}
	m.putLocked(c.Key, newPending(c, now))
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
		tenant:      c.Tenant,
		tool:        c.Tool,
		pod:         c.Pod,
		claimed:     now,
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
	close(e.done)
	m.putLocked(key, e)
	m.addCompletedLocked(key, e)
	m.makeRoomLocked(now, 0, 0, key)
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

// Bytes reports what the store's records cost, as its byte bound counts.
func (m *Memory) Bytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bytes
}

// Close implements Store.
func (m *Memory) Close() error {
	m.stopOnce.Do(func() { close(m.stop) })
	return nil
}

var _ Inspector = (*Memory)(nil)

func (e *memEntry) record(key string) Record {
	r := Record{Key: key, Tool: e.tool, Pod: e.pod, Completed: e.completed, Claimed: e.claimed, Expires: e.expires}
	if !e.completed {
		r.LeaseUntil = e.leaseUntil
	}
	return r
}

// Records implements Inspector.
func (m *Memory) Records(_ context.Context, limit int) ([]Record, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	out := []Record{}
	for k, e := range m.entries {
		if !now.Before(e.expires) {
			continue
		}
		if limit > 0 && len(out) == limit {
			break
		}
		out = append(out, e.record(k))
	}
	return out, nil
}

// Lookup implements Inspector.
func (m *Memory) Lookup(_ context.Context, key string) (Record, []byte, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.entries[key]
	if !ok || !now.Before(e.expires) {
		return Record{}, nil, ErrNoRecord
	}
	return e.record(key), e.response, nil
}

// Drop implements Inspector.
func (m *Memory) Drop(_ context.Context, key string, d Drop) (Record, error) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.entries[key]
	if !ok || !now.Before(e.expires) {
		return Record{}, ErrNoRecord
	}
	r := e.record(key)
	switch {
	case d == DropResult && !e.completed, d == DropClaim && e.completed:
		return r, ErrWrongState
	case d == DropClaim && now.Before(e.leaseUntil):
		return r, ErrLeaseLive
	}
	m.deleteLocked(key, e)
	return r, nil
}
