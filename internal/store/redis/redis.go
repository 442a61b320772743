// Package redisstore is a store.Store shared by every sidecar of a policy,
// backed by Redis: standalone, Sentinel or Cluster, all through go-redis's
// UniversalClient.
//
// Each record is one key, and every operation is one Lua script on that key
// (one round trip, atomic, and valid on Redis Cluster whatever the key's
// slot). Leases are measured on the Redis server's clock. Waiters share one
// pub/sub subscription per Store.
//
// Records must not be evicted: run Redis with maxmemory-policy noeviction,
// since every record has a TTL and a volatile-* policy would drop pending
// claims, letting a duplicate run. Redis 5 or later is required (scripts
// that read TIME and then write).
package redisstore

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/store"
)

var _ store.Store = (*Store)(nil)

// Defaults for the zero values of Options. The timeouts are short because
// the store sits on the path of every deduplicated call: when Redis is
// away, the engine's FailOpen or FailClosed should decide soon.
const (
	DefaultPrefix       = "idemcp:"
	DefaultDialTimeout  = 2 * time.Second
	DefaultReadTimeout  = time.Second
	DefaultWriteTimeout = time.Second
	DefaultPollInterval = time.Second
	// DefaultReplicaTimeout bounds how long a write waits for MinReplicas.
	DefaultReplicaTimeout = time.Second
)

// unconfirmedPause is how long Wait holds a caller whose Reserve found a
// result its replicas had not acknowledged, before it tries again.
const unconfirmedPause = 100 * time.Millisecond

// Options says how to reach Redis.
type Options struct {
	// Addrs: one address for a standalone Redis; the seed nodes of a
	// Cluster (two or more addresses, or set Cluster); the Sentinels when
	// SentinelMaster is set.
	Addrs []string
	// SentinelMaster is the name of the master the Sentinels at Addrs
	// monitor.
	SentinelMaster string
	// Cluster forces Cluster mode with a single address (a managed
	// Cluster's configuration endpoint).
	Cluster bool

	Username         string
	Password         string
	SentinelPassword string
	// DB selects a database of a standalone or Sentinel Redis (Cluster has
	// only 0).
	DB int

	// TLS connects with TLS. TLSConfig, if set, is used as is (a private CA,
	// a client certificate); otherwise the system roots verify the server.
	TLS       bool
	TLSConfig *tls.Config

	// Prefix is put before every key, e.g. "idemcp:{shop/payments}:".
	// Braces make the prefix a hash tag: on a Cluster all of a policy's
	// records then live in one slot, and so on one node.
	Prefix string

	DialTimeout  time.Duration
	ReadTimeout  time.Duration
	WriteTimeout time.Duration
	// MaxRetries is how often go-redis retries a command that failed on
	// the network (0: go-redis's default of 3, -1: never). The scripts are
	// written so that a re-sent command does no harm.
	MaxRetries int
	PoolSize   int

	// PollInterval bounds how long a waiter trusts pub/sub alone: it
	// re-reads the record at least this often, in case a wake-up was lost.
	PollInterval time.Duration

	// MinReplicas, when above 0, makes every claim, renewal and stored
	// result wait (Redis WAIT, on the connection that wrote it) until that
	// many replicas have it. Redis replicates asynchronously: without it a
	// failover to a replica that had not yet received a claim loses the
	// claim, and a retry runs the call again. A write acknowledged by fewer
	// replicas within ReplicaTimeout fails with ErrUnavailable (it did
	// reach the primary; a claim is then released by the engine), so the
	// policy's onStoreUnavailable decides, as for a store that is down.
	// A result is replayed only once that many replicas acknowledged it: a
	// Reserve that finds one they have not (its Complete fell short, or
	// is still waiting) writes and waits again, and reports it Pending if
	// they still fall short, so a retry never gets a result that a
	// failover can still lose.
	MinReplicas int
	// ReplicaTimeout bounds the wait for MinReplicas (default
	// DefaultReplicaTimeout; a shorter deadline of the caller wins).
	ReplicaTimeout time.Duration
}

// Store is a store.Store in Redis. It is safe for concurrent use.
type Store struct {
	client redis.UniversalClient
	// rep is MinReplicas with its ReplicaTimeout, read once by each
	// operation; SetMinReplicas swaps it while the store serves.
	rep        atomic.Pointer[replication]
	ownsClient bool
	prefix     string
	channel    string
	poll       time.Duration
	waiters    *wakeHub
	closeOnce  sync.Once
	closeErr   error
}

// New connects to Redis as opts says. It does not fail when Redis cannot be
// reached yet: calls then return errors wrapping store.ErrUnavailable until
// it can, and Ping reports it.
func New(opts Options) (*Store, error) {
	if len(opts.Addrs) == 0 {
		return nil, errors.New("redis store: no addresses")
	}
	if opts.MinReplicas < 0 {
		return nil, fmt.Errorf("redis store: MinReplicas %d: want 0 (do not wait for replicas) or more", opts.MinReplicas)
	}
	uo := &redis.UniversalOptions{
		Addrs:            opts.Addrs,
		MasterName:       opts.SentinelMaster,
		IsClusterMode:    opts.Cluster,
		Username:         opts.Username,
		Password:         opts.Password,
		SentinelPassword: opts.SentinelPassword,
		DB:               opts.DB,
		DialTimeout:      orDefault(opts.DialTimeout, DefaultDialTimeout),
		ReadTimeout:      orDefault(opts.ReadTimeout, DefaultReadTimeout),
		WriteTimeout:     orDefault(opts.WriteTimeout, DefaultWriteTimeout),
		// A caller's deadline shorter than ReadTimeout should win.
		ContextTimeoutEnabled: true,
		MaxRetries:            opts.MaxRetries,
		// go-redis already retries a failed dial as a failed command;
		// retrying inside each dial too would multiply the time a caller
		// waits while Redis is down.
		DialerRetries: 1,
		PoolSize:      opts.PoolSize,
		ClientName:    "idemcp",
	}
	if opts.TLS || opts.TLSConfig != nil {
		uo.TLSConfig = opts.TLSConfig
		if uo.TLSConfig == nil {
			uo.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
		}
	}
	s := newStore(redis.NewUniversalClient(uo), opts.Prefix, opts.PollInterval)
	s.ownsClient = true
	s.rep.Store(&replication{n: opts.MinReplicas, timeout: orDefault(opts.ReplicaTimeout, DefaultReplicaTimeout)})
	s.preload(uo.DialTimeout)
	return s, nil
}

// NewFromClient wraps a client the caller made and still owns: Close leaves
// it open.
func NewFromClient(c redis.UniversalClient, prefix string) *Store {
	s := newStore(c, prefix, 0)
	s.preload(DefaultDialTimeout)
	return s
}

func newStore(c redis.UniversalClient, prefix string, poll time.Duration) *Store {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	s := &Store{
		client:  c,
		prefix:  prefix,
		channel: prefix + "wake",
		poll:    orDefault(poll, DefaultPollInterval),
	}
	s.waiters = newWakeHub(c, s.channel)
	s.rep.Store(&replication{timeout: DefaultReplicaTimeout})
	return s
}

// replication is how many replicas every write waits for, and for how
// long.
type replication struct {
	n       int
	timeout time.Duration
}

// SetMinReplicas changes MinReplicas and ReplicaTimeout (0: the default)
// of a store that serves: a policy's store.redis.external.minReplicas
// changed live. Each store operation reads it once, so its write, its
// WAIT and its acknowledgement mark agree; the next operation of a call
// under way may read the new value. Results stored while it was 0 carry no acknowledgement,
// so once it is raised each is confirmed with the replicas (written and
// waited for again) before its first replay.
func (s *Store) SetMinReplicas(n int, timeout time.Duration) error {
	if n < 0 {
		return fmt.Errorf("redis store: MinReplicas %d: want 0 (do not wait for replicas) or more", n)
	}
	switch s.client.(type) {
	case *redis.ClusterClient, *redis.Client:
	default:
		if n > 0 {
			return fmt.Errorf("redis store: MinReplicas needs a standalone, Sentinel or Cluster client, not %T", s.client)
		}
	}
	s.rep.Store(&replication{n: n, timeout: orDefault(timeout, DefaultReplicaTimeout)})
	return nil
}

// MinReplicas is the number of replicas every write waits for now.
func (s *Store) MinReplicas() int { return s.rep.Load().n }

// ReplicaTimeout bounds each wait for MinReplicas now.
func (s *Store) ReplicaTimeout() time.Duration { return s.rep.Load().timeout }

// preload puts the scripts in Redis's script cache, so that the first call
// of each is one EVALSHA rather than a NOSCRIPT and an EVAL. Failure is
// harmless: Script.Run falls back to EVAL, as it must anyway after Redis
// restarts with an empty cache.
func (s *Store) preload(timeout time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for _, sc := range allScripts {
		if err := sc.Load(ctx, s.client).Err(); err != nil {
			return
		}
	}
}

func orDefault(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

// millis rounds up, so a lease or TTL is never shortened.
func millis(d time.Duration) string {
	if d <= 0 {
		return "0"
	}
	return strconv.FormatInt(int64((d+time.Millisecond-1)/time.Millisecond), 10)
}

// unavailable wraps a failure to talk to Redis. A caller that gave up
// (context.Canceled) is not told the store is down; a deadline that ran out
// is, since a store too slow to answer in time is unavailable to the call.
func unavailable(op, key string, err error) error {
	if errors.Is(err, context.Canceled) {
		return fmt.Errorf("redis %s %s: %w", op, key, err)
	}
	return fmt.Errorf("redis %s %s: %w: %w", op, key, store.ErrUnavailable, err)
}

// Reserve implements store.Store. Owner tokens are unique per call, so a
// pending claim found under the caller's own token is this very Reserve,
// re-sent by go-redis after its reply was lost, and is reported Won, its
// lease started again: the re-send may come most of a lease later, once
// Redis is back, and the owner runs the call with a whole lease ahead.
func (s *Store) Reserve(ctx context.Context, c store.Claim) (store.Reservation, error) {
	takeOver := "0"
	if c.TakeOver {
		takeOver = "1"
	}
	discard := "0"
	if c.Discard != nil {
		discard = "1"
	}
	rep := *s.rep.Load() // once: the script's confirm and the WAIT agree
	confirm := "0"
	if rep.n > 0 {
		confirm = "1"
	}
	res, err := s.write(ctx, rep, "reserve", c.Key, reserveScript, func(r any) bool {
		code, _ := field[int64](asSlice(r), 0)
		return code == codeWon || code == codeTookOver || code == codeUnconfirmed
	}, c.Fingerprint, c.Owner, millis(c.Lease), millis(max(c.Retention, c.Lease)), takeOver, discard, c.Discard, confirm, c.Tool, c.Pod)
	reply := asSlice(res)
	code, _ := field[int64](reply, 0)
	fp, _ := field[string](reply, 1)
	if code == codeUnconfirmed {
		return s.confirmed(ctx, c.Key, reply, err)
	}
	if err != nil {
		return store.Reservation{}, err
	}
	switch code {
	case codeWon:
		return store.Reservation{State: store.Won}, nil
	case codeTookOver:
		return store.Reservation{State: store.Won, Fingerprint: fp, TookOver: true}, nil
	case codeCompleted:
		resp, _ := field[string](reply, 2)
		return store.Reservation{State: store.Completed, Fingerprint: fp, Response: []byte(resp)}, nil
	case codePending:
		return store.Reservation{State: store.Pending, Fingerprint: fp}, nil
	case codeAbandoned:
		return store.Reservation{State: store.Abandoned, Fingerprint: fp}, nil
	}
	return store.Reservation{}, unavailable("reserve", c.Key, fmt.Errorf("unexpected reply %v", reply))
}

// confirmed settles a Reserve that found a completed record its replicas
// have not acknowledged: the owner's Complete is still waiting for them, or
// failed to get them, or the mark of it was lost in a failover. Replaying
// it could hand out a result that a failover then loses, and the next
// retry would run the call again. So the reserve wrote to the record and
// waited for MinReplicas (werr is that wait's failure). Acknowledged, the
// record is marked so and replayed. Not, it is reported Pending, as if its
// call were still running, whatever the failure: the result exists, so the
// call must not run again (Wait paces the next try); the engine answers
// the retry with its retry-later error once waitTimeout is over (at once
// under inFlight: Reject).
func (s *Store) confirmed(ctx context.Context, key string, reply []any, werr error) (store.Reservation, error) {
	fp, _ := field[string](reply, 1)
	if werr != nil {
		return store.Reservation{State: store.Pending, Fingerprint: fp}, nil
	}
	resp, _ := field[string](reply, 2)
	nonce, _ := field[string](reply, 3)
	// Best effort: without the mark the next replay confirms again.
	_ = ackScript.Run(ctx, s.client, []string{s.prefix + key}, nonce).Err()
	return store.Reservation{State: store.Completed, Fingerprint: fp, Response: []byte(resp)}, nil
}

func asSlice(r any) []any {
	v, _ := r.([]any)
	return v
}

func field[T any](reply []any, i int) (T, bool) {
	var zero T
	if i >= len(reply) {
		return zero, false
	}
	v, ok := reply[i].(T)
	return v, ok
}

// owned runs a compare-and-set script that replies 1 when the owner still
// held the claim.
func (s *Store) owned(ctx context.Context, rep replication, op, key string, sc *redis.Script, args ...any) error {
	r, err := s.write(ctx, rep, op, key, sc, func(r any) bool { n, _ := r.(int64); return n == 1 }, args...)
	if err != nil {
		return err
	}
	if n, _ := r.(int64); n != 1 {
		return fmt.Errorf("redis %s %s: %w", op, key, store.ErrNotOwner)
	}
	return nil
}

// write runs a script on key. With MinReplicas set, a script that wrote
// (as wrote says of its reply) is followed by WAIT on the same connection,
// since WAIT counts the replicas that have that connection's writes. A
// failed WAIT returns the script's reply with its error. rep is the
// operation's one reading of MinReplicas.
func (s *Store) write(ctx context.Context, rep replication, op, key string, sc *redis.Script, wrote func(any) bool, args ...any) (any, error) {
	full := s.prefix + key
	if rep.n == 0 {
		r, err := sc.Run(ctx, s.client, []string{full}, args...).Result()
		if err != nil {
			return nil, unavailable(op, key, err)
		}
		return r, nil
	}
	conn, err := s.conn(ctx, full)
	if err != nil {
		return nil, unavailable(op, key, err)
	}
	defer func() { _ = conn.Close() }()
	r, err := sc.Run(ctx, conn, []string{full}, args...).Result()
	if err != nil {
		return nil, unavailable(op, key, err)
	}
	if !wrote(r) {
		return r, nil
	}
	timeout := rep.timeout
	if dl, ok := ctx.Deadline(); ok {
		// WAIT 0 would block forever.
		timeout = max(min(timeout, time.Until(dl)), time.Millisecond)
	}
	acked, err := conn.Wait(ctx, rep.n, timeout).Result()
	if err != nil {
		return r, unavailable(op, key, fmt.Errorf("waiting for %d replicas: %w", rep.n, err))
	}
	if acked < int64(rep.n) {
		return r, unavailable(op, key, fmt.Errorf("%w: written on the primary, but %d of the %d replicas required (MinReplicas) acknowledged it within %v",
			ErrTooFewReplicas, acked, rep.n, timeout))
	}
	return r, nil
}

// ErrTooFewReplicas is wrapped, with store.ErrUnavailable, by a write that
// fewer than MinReplicas replicas acknowledged in time.
var ErrTooFewReplicas = errors.New("too few replicas acknowledged the write")

// conn is one connection to the primary that owns key: the node of a
// Cluster, the master a Sentinel names, or the standalone server.
func (s *Store) conn(ctx context.Context, key string) (*redis.Conn, error) {
	switch c := s.client.(type) {
	case *redis.ClusterClient:
		node, err := c.MasterForKey(ctx, key)
		if err != nil {
			return nil, err
		}
		return node.Conn(), nil
	case *redis.Client:
		return c.Conn(), nil
	}
	return nil, fmt.Errorf("MinReplicas needs a standalone, Sentinel or Cluster client, not %T", s.client)
}

// Renew implements store.Store.
func (s *Store) Renew(ctx context.Context, key, owner string, lease time.Duration) error {
	return s.owned(ctx, *s.rep.Load(), "renew", key, renewScript, owner, millis(lease))
}

// Complete implements store.Store. With MinReplicas set, a result its
// replicas acknowledged is marked so (ackScript): only a marked result is
// replayed without confirming it first (see confirmed).
func (s *Store) Complete(ctx context.Context, key, owner string, response []byte, ttl time.Duration) error {
	nonce := rand.Text()
	// Read once: a result is marked acknowledged only after a WAIT for
	// the replicas this very write waited for.
	rep := *s.rep.Load()
	if err := s.owned(ctx, rep, "complete", key, completeScript, owner, response, millis(ttl), nonce, s.channel); err != nil {
		return err
	}
	if rep.n > 0 {
		// Best effort: without the mark the first replay confirms it.
		_ = ackScript.Run(ctx, s.client, []string{s.prefix + key}, nonce).Err()
	}
	return nil
}

// Release implements store.Store. A Release that go-redis re-sends after a
// lost reply finds the key gone and reports ErrNotOwner, although the
// claim was released. It does not wait for replicas: a release that a
// failover loses leaves a claim that lapses with its lease, which is safe.
func (s *Store) Release(ctx context.Context, key, owner string) error {
	n, err := releaseScript.Run(ctx, s.client, []string{s.prefix + key}, owner, s.channel).Int64()
	if err != nil {
		return unavailable("release", key, err)
	}
	if n != 1 {
		return fmt.Errorf("redis release %s: %w", key, store.ErrNotOwner)
	}
	return nil
}

// Wait implements store.Store. It costs one command, plus one per
// PollInterval while the claim stays pending, whatever the number of
// waiters: wake-ups arrive on the Store's one subscription.
func (s *Store) Wait(ctx context.Context, key string) error {
	full := s.prefix + key
	// Listen before reading the record: a Complete between the read and
	// the listening would otherwise go unnoticed until the next poll.
	w, err := s.waiters.listen(ctx, full)
	if err != nil {
		return fmt.Errorf("redis wait %s: %w", key, err)
	}
	defer s.waiters.stop(full, w)

	// Reset discards a stale tick (Go 1.23 timers), so the timer is reused
	// without draining.
	timer := time.NewTimer(s.poll)
	defer timer.Stop()
	for {
		resub := s.waiters.resubscribed()
		confirm := "0"
		if s.rep.Load().n > 0 {
			confirm = "1"
		}
		left, err := probeScript.Run(ctx, s.client, []string{full}, confirm).Int64()
		if err != nil {
			if ctx.Err() != nil {
				// The caller's wait is over; that is not Redis's fault.
				return ctx.Err()
			}
			return unavailable("wait", key, err)
		}
		if left == -1 {
			// A result Reserve could not yet confirm with its replicas
			// (see confirmed): no wake-up says when they are back, so the
			// next Reserve tries again after a pause.
			timer.Reset(unconfirmedPause)
			select {
			case <-timer.C:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			case <-s.waiters.closed:
				return fmt.Errorf("redis wait %s: %w: store closed", key, store.ErrUnavailable)
			}
		}
		if left <= 0 {
			return nil
		}
		// The margin covers the time between Redis computing left and this
		// timer starting, so that the next probe finds the lease run out.
		timer.Reset(min(time.Duration(left)*time.Millisecond+10*time.Millisecond, s.poll))
		select {
		case <-w:
			return nil
		case <-resub:
			// Wake-ups published while the subscription was down are lost:
			// read the record again.
		case <-timer.C:
		case <-ctx.Done():
			return ctx.Err()
		case <-s.waiters.closed:
			return fmt.Errorf("redis wait %s: %w: store closed", key, store.ErrUnavailable)
		}
	}
}

// KeyPrefix is the prefix the store puts before every key: Options.Prefix,
// or DefaultPrefix when that is empty. Seal records bound to this, not to
// Options.Prefix, so that "" and DefaultPrefix open each other's records.
func (s *Store) KeyPrefix() string { return s.prefix }

// Ping implements store.Store.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.client.Ping(ctx).Err(); err != nil {
		return unavailable("ping", s.prefix, err)
	}
	return nil
}

// Close implements store.Store.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.waiters.close()
		if s.ownsClient {
			s.closeErr = s.client.Close()
		}
	})
	return s.closeErr
}
