package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/store"
)

var _ store.Inspector = (*Store)(nil)

// scanBatch is how many keys one SCAN asks for.
const scanBatch = 500

// Records implements store.Inspector: a SCAN of the prefix (on every
// primary of a Cluster), each record read with one HMGET and PTTL. Only
// keys whose remainder after the prefix is a bare hex hash are records of
// this store: an IdempotentProxy under a policy writes under the policy's
// prefix + "idpx/NAME:", and its records, which the keys API could not
// address by hash, are not listed here.
func (s *Store) Records(ctx context.Context, limit int) ([]store.Record, error) {
	out := []store.Record{}
	full := func() bool { return limit > 0 && len(out) >= limit }
	scan := func(ctx context.Context, c redis.Cmdable) error {
		var cursor uint64
		for {
			keys, next, err := c.Scan(ctx, cursor, scanPattern(s.prefix), scanBatch).Result()
			if err != nil {
				return unavailable("scan", s.prefix+"*", err)
			}
			for _, k := range keys {
				if k == s.channel || full() {
					continue
				}
				key := strings.TrimPrefix(k, s.prefix)
				if !isHashKey(key) {
					continue // another store's key under a longer prefix
				}
				r, _, err := s.lookup(ctx, c, key, false)
				if errors.Is(err, store.ErrNoRecord) {
					continue // expired meanwhile, or not a record
				}
				if err != nil {
					return err
				}
				out = append(out, r)
			}
			if cursor = next; cursor == 0 || full() {
				return nil
			}
		}
	}
	if cc, ok := s.client.(*redis.ClusterClient); ok {
		// One primary at a time: scan appends to out.
		var mu sync.Mutex
		err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			mu.Lock()
			defer mu.Unlock()
			return scan(ctx, c)
		})
		return out, err
	}
	return out, scan(ctx, s.client)
}

// isHashKey says whether key is a bare hex hash, as the engine makes keys.
func isHashKey(key string) bool {
	if key == "" {
		return false
	}
	for i := 0; i < len(key); i++ {
		c := key[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// scanPattern escapes the glob characters of a prefix ({ns/name} is a
// hash tag, and [ ] * ? \ would be patterns).
func scanPattern(prefix string) string {
	var b strings.Builder
	for _, r := range prefix {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String() + "*"
}

// Lookup implements store.Inspector; the response is as stored (sealed,
// for a sidecar's store: store.Sealed opens it).
func (s *Store) Lookup(ctx context.Context, key string) (store.Record, []byte, error) {
	return s.lookup(ctx, s.client, key, true)
}

func (s *Store) lookup(ctx context.Context, c redis.Cmdable, key string, withResponse bool) (store.Record, []byte, error) {
	fields := []string{"s", "l", "t", "pd", "at"}
	if withResponse {
		fields = append(fields, "r")
	}
	var hm *redis.SliceCmd
	var ttl *redis.DurationCmd
	_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		hm = p.HMGet(ctx, s.prefix+key, fields...)
		ttl = p.PTTL(ctx, s.prefix+key)
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return store.Record{}, nil, unavailable("lookup", key, err)
	}
	v := hm.Val()
	str := func(i int) string {
		if i < len(v) {
			if s, ok := v[i].(string); ok {
				return s
			}
		}
		return ""
	}
	if str(0) != "p" && str(0) != "c" {
		return store.Record{}, nil, store.ErrNoRecord
	}
	r := recordOf(key, str(0), str(1), str(2), str(3), str(4), ttl.Val())
	var resp []byte
	if withResponse && r.Completed {
		resp = []byte(str(5))
	}
	return r, resp, nil
}

// recordOf makes a record of the fields as the scripts store them
// (millisecond strings of the server's clock).
func recordOf(key, state, lease, tool, pod, claimed string, pttl time.Duration) store.Record {
	r := store.Record{Key: key, Tool: tool, Pod: pod, Completed: state == "c"}
	if ms, err := strconv.ParseInt(claimed, 10, 64); err == nil && ms > 0 {
		r.Claimed = time.UnixMilli(ms)
	}
	if ms, err := strconv.ParseInt(lease, 10, 64); err == nil && !r.Completed {
		r.LeaseUntil = time.UnixMilli(ms)
	}
	if pttl > 0 {
		r.Expires = time.Now().Add(pttl)
	}
	return r
}

// Drop implements store.Inspector in one script: the record is checked and
// deleted atomically, and its waiters woken.
func (s *Store) Drop(ctx context.Context, key string, d store.Drop) (store.Record, error) {
	state := "p"
	if d == store.DropResult {
		state = "c"
	}
	res, err := dropScript.Run(ctx, s.client, []string{s.prefix + key}, state, s.channel).Result()
	if err != nil {
		return store.Record{}, unavailable("drop", key, err)
	}
	reply := asSlice(res)
	code, _ := field[int64](reply, 0)
	if code == 0 {
		return store.Record{}, store.ErrNoRecord
	}
	st, _ := field[string](reply, 1)
	lease, _ := field[string](reply, 2)
	tool, _ := field[string](reply, 3)
	pod, _ := field[string](reply, 4)
	claimed, _ := field[string](reply, 5)
	pttl, _ := field[int64](reply, 6)
	r := recordOf(key, st, lease, tool, pod, claimed, time.Duration(pttl)*time.Millisecond)
	switch code {
	case 1:
		return r, nil
	case -1:
		return r, store.ErrWrongState
	case -2:
		return r, store.ErrLeaseLive
	}
	return r, unavailable("drop", key, fmt.Errorf("unexpected reply %v", reply))
}
