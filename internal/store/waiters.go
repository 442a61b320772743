package store

// Waiters are the wake-up channels of the callers waiting on each key, for
// stores that learn of settled keys from a notification (Redis pub/sub,
// PostgreSQL NOTIFY). Callers hold their own lock around every method.
type Waiters map[string]map[chan struct{}]struct{}

// Add registers w as waiting on key.
func (ws Waiters) Add(key string, w chan struct{}) {
	set := ws[key]
	if set == nil {
		set = make(map[chan struct{}]struct{})
		ws[key] = set
	}
	set[w] = struct{}{}
}

// Remove forgets w.
func (ws Waiters) Remove(key string, w chan struct{}) {
	if set := ws[key]; set != nil {
		delete(set, w)
		if len(set) == 0 {
			delete(ws, key)
		}
	}
}

// Wake signals every waiter of key without blocking: a waiter's channel
// has room for one signal, and one is enough.
func (ws Waiters) Wake(key string) {
	for w := range ws[key] {
		select {
		case w <- struct{}{}:
		default: // already woken
		}
	}
}
