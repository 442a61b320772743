package redisstore_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/store"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/internal/store/storetest"
	"github.com/idemcp/idemcp/test/poll"
)

// prefix gives each test its own keys and wake channel on a shared server.
func prefix(t *testing.T) string {
	return "idemcp:{test/" + strings.ReplaceAll(t.Name(), "/", ".") + "}:"
}

func newStore(t *testing.T, opts redisstore.Options) *redisstore.Store {
	t.Helper()
	if opts.Prefix == "" {
		opts.Prefix = prefix(t)
	}
	s, err := redisstore.New(opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestMain(m *testing.M) {
	// go-redis logs every reconnect attempt, which these tests provoke on
	// purpose.
	redis.SetLogger(discard{})
	os.Exit(m.Run())
}

type discard struct{}

func (discard) Printf(context.Context, string, ...any) {}

func TestContract(t *testing.T) {
	srv := redistest.Start(t)
	storetest.Run(t, func(t *testing.T) store.Store {
		return newStore(t, redisstore.Options{Addrs: []string{srv.Addr}})
	})
}

func TestContractCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	storetest.Run(t, func(t *testing.T) store.Store {
		// No hash tag: the records spread over all three nodes.
		return newStore(t, redisstore.Options{Addrs: cluster.Addrs, Prefix: "idemcp:" + t.Name() + ":"})
	})
}

func TestContractSentinel(t *testing.T) {
	master := redistest.Start(t)
	sentinel := redistest.StartSentinel(t, master, "idemcp")
	storetest.Run(t, func(t *testing.T) store.Store {
		return newStore(t, redisstore.Options{Addrs: []string{sentinel.Addr}, SentinelMaster: "idemcp"})
	})
}

func TestNewWithoutAddresses(t *testing.T) {
	if _, err := redisstore.New(redisstore.Options{}); err == nil {
		t.Fatal("New accepted options without addresses")
	}
}

// counter is a go-redis hook counting round trips to the server: one per
// command, one per pipeline. The handshake of a new connection (HELLO,
// CLIENT SETINFO) is left out: a pool that grows is not a call that costs
// more.
type counter struct {
	mu    sync.Mutex
	n     int
	names []string
}

func (c *counter) DialHook(next redis.DialHook) redis.DialHook { return next }

func handshake(name string) bool {
	switch name {
	case "hello", "auth", "client", "select":
		return true
	}
	return false
}

func (c *counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !handshake(cmd.Name()) {
			c.add(cmd.Name())
		}
		return next(ctx, cmd)
	}
}

func (c *counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var names []string
		for _, cmd := range cmds {
			if !handshake(cmd.Name()) {
				names = append(names, cmd.Name())
			}
		}
		if len(names) > 0 {
			c.add(fmt.Sprint("pipeline", names))
		}
		return next(ctx, cmds)
	}
}

func (c *counter) add(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n++
	c.names = append(c.names, name)
}

func (c *counter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// during returns the round trips made by f, and their commands.
func (c *counter) during(f func()) (int, []string) {
	c.mu.Lock()
	before, from := c.n, len(c.names)
	c.mu.Unlock()
	f()
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n - before, slices.Clone(c.names[from:])
}

// sidecar is a Store with its own client, as each sidecar has, and a
// count of its round trips.
func sidecar(t *testing.T, addr, prefix string) (*redisstore.Store, *counter) {
	t.Helper()
	client := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = client.Close() })
	c := &counter{}
	client.AddHook(c)
	s := redisstore.NewFromClient(client, prefix)
	t.Cleanup(func() { _ = s.Close() })
	return s, c
}

func token() string { return rand.Text() }

func claim(key string, lease time.Duration) store.Claim {
	return store.Claim{Key: key, Fingerprint: "fp-" + key, Owner: token(), Lease: lease, Retention: time.Minute, TakeOver: true}
}

func TestOneRoundTripPerCall(t *testing.T) {
	srv := redistest.Start(t)
	s, c := sidecar(t, srv.Addr, prefix(t))
	ctx := context.Background()
	key := token()
	first := claim(key, 10*time.Second)

	released := claim(token(), time.Second)
	steps := []struct {
		name string
		do   func() error
	}{
		{"Reserve that wins", func() error {
			r, err := s.Reserve(ctx, first)
			if err == nil && r.State != store.Won {
				t.Errorf("state = %s, want won", r.State)
			}
			return err
		}},
		{"Reserve that finds it pending", func() error {
			r, err := s.Reserve(ctx, claim(key, time.Second))
			if err == nil && r.State != store.Pending {
				t.Errorf("state = %s, want pending", r.State)
			}
			return err
		}},
		{"Renew", func() error { return s.Renew(ctx, key, first.Owner, 10*time.Second) }},
		{"Wait on a key nobody holds", func() error { return s.Wait(ctx, token()) }},
		{"Complete", func() error { return s.Complete(ctx, key, first.Owner, []byte(`{"result":{}}`), time.Minute) }},
		{"Reserve that finds it completed", func() error {
			r, err := s.Reserve(ctx, claim(key, time.Second))
			if err == nil && (r.State != store.Completed || string(r.Response) != `{"result":{}}`) {
				t.Errorf("reservation = %s %q, want the completed response", r.State, r.Response)
			}
			return err
		}},
		{"Reserve of another key", func() error {
			_, err := s.Reserve(ctx, released)
			return err
		}},
		{"Release", func() error { return s.Release(ctx, released.Key, released.Owner) }},
	}
	for _, step := range steps {
		n, names := c.during(func() {
			if err := step.do(); err != nil {
				t.Fatalf("%s: %v", step.name, err)
			}
		})
		if n != 1 {
			t.Errorf("%s took %d round trips %v, want 1", step.name, n, names)
		}
	}

	// Redis lost its script cache (a restart, a failover, SCRIPT FLUSH):
	// the next call still works, at one extra round trip.
	if _, err := redistest.Do(srv.Addr, "SCRIPT", "FLUSH"); err != nil {
		t.Fatal(err)
	}
	for i, want := range []int{2, 1} {
		n, names := c.during(func() {
			if _, err := s.Reserve(ctx, claim(token(), time.Second)); err != nil {
				t.Fatalf("Reserve after SCRIPT FLUSH: %v", err)
			}
		})
		if n != want {
			t.Errorf("Reserve %d after SCRIPT FLUSH took %d round trips %v, want %d", i+1, n, names, want)
		}
	}
}

func TestStaleOwnerAcrossSidecars(t *testing.T) {
	srv := redistest.Start(t)
	p := prefix(t)
	a, _ := sidecar(t, srv.Addr, p)
	b, _ := sidecar(t, srv.Addr, p)
	ctx := context.Background()
	key := token()

	old := claim(key, 300*time.Millisecond)
	if r, err := a.Reserve(ctx, old); err != nil || r.State != store.Won {
		t.Fatalf("sidecar a Reserve = %v, %v; want won", r.State, err)
	}
	if r, err := b.Reserve(ctx, claim(key, time.Second)); err != nil || r.State != store.Pending {
		t.Fatalf("sidecar b Reserve under a live lease = %v, %v; want pending", r.State, err)
	}
	time.Sleep(400 * time.Millisecond)
	next := claim(key, 10*time.Second)
	r, err := b.Reserve(ctx, next)
	if err != nil || r.State != store.Won || !r.TookOver {
		t.Fatalf("sidecar b Reserve after the lease ran out = %+v, %v; want won, took over", r, err)
	}
	if r.Fingerprint != old.Fingerprint {
		t.Errorf("took-over fingerprint = %q, want the abandoned claim's %q", r.Fingerprint, old.Fingerprint)
	}

	if err := a.Renew(ctx, key, old.Owner, time.Minute); !errors.Is(err, store.ErrNotOwner) {
		t.Errorf("stale Renew from sidecar a = %v, want ErrNotOwner", err)
	}
	if err := a.Complete(ctx, key, old.Owner, []byte("stale"), time.Minute); !errors.Is(err, store.ErrNotOwner) {
		t.Errorf("stale Complete from sidecar a = %v, want ErrNotOwner", err)
	}
	if err := a.Release(ctx, key, old.Owner); !errors.Is(err, store.ErrNotOwner) {
		t.Errorf("stale Release from sidecar a = %v, want ErrNotOwner", err)
	}
	if r, err := a.Reserve(ctx, claim(key, time.Second)); err != nil || r.State != store.Pending {
		t.Fatalf("sidecar a sees %v, %v; want b's claim pending", r.State, err)
	}

	if err := b.Complete(ctx, key, next.Owner, []byte("fresh"), time.Minute); err != nil {
		t.Fatalf("sidecar b Complete: %v", err)
	}
	r, err = a.Reserve(ctx, claim(key, time.Second))
	if err != nil || r.State != store.Completed || string(r.Response) != "fresh" {
		t.Fatalf("sidecar a replay = %s %q, %v; want b's response", r.State, r.Response, err)
	}
	if err := a.Complete(ctx, key, old.Owner, []byte("stale"), time.Minute); !errors.Is(err, store.ErrNotOwner) {
		t.Errorf("stale Complete over a stored result = %v, want ErrNotOwner", err)
	}
}

func TestRedisGoesAwayAndComesBack(t *testing.T) {
	srv := redistest.Start(t)
	const timeout = 200 * time.Millisecond
	s := newStore(t, redisstore.Options{
		Addrs:       []string{srv.Addr},
		DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout,
	})
	ctx := context.Background()
	if _, err := s.Reserve(ctx, claim(token(), time.Second)); err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	// Start the Store's subscription, to see it come back too.
	if err := s.Wait(ctx, token()); err != nil {
		t.Fatalf("Wait: %v", err)
	}

	srv.Stop()
	start := time.Now()
	_, err := s.Reserve(ctx, claim(token(), time.Second))
	if !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("Reserve with Redis down = %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("Reserve took %v to report Redis down", d)
	} else {
		t.Logf("Reserve reported Redis down after %v: %v", d, err)
	}
	if err := s.Ping(ctx); !errors.Is(err, store.ErrUnavailable) {
		t.Errorf("Ping with Redis down = %v, want ErrUnavailable", err)
	}
	if err := s.Complete(ctx, token(), "owner", nil, time.Minute); !errors.Is(err, store.ErrUnavailable) || errors.Is(err, store.ErrNotOwner) {
		t.Errorf("Complete with Redis down = %v, want ErrUnavailable and not ErrNotOwner", err)
	}
	if err := s.Wait(ctx, token()); !errors.Is(err, store.ErrUnavailable) {
		t.Errorf("Wait with Redis down = %v, want ErrUnavailable", err)
	}

	srv.Start()
	key := token()
	c := claim(key, 10*time.Second)
	r, err := s.Reserve(ctx, c)
	if err != nil || r.State != store.Won {
		t.Fatalf("Reserve after Redis came back = %v, %v; want won", r.State, err)
	}
	if err := s.Ping(ctx); err != nil {
		t.Errorf("Ping after Redis came back: %v", err)
	}
	// The subscription is back as well: a waiter wakes on Complete, not
	// on the poll.
	woke := make(chan error, 1)
	go func() { woke <- s.Wait(ctx, key) }()
	time.Sleep(100 * time.Millisecond)
	completed := time.Now()
	if err := s.Complete(ctx, key, c.Owner, []byte("r"), time.Minute); err != nil {
		t.Fatalf("Complete after Redis came back: %v", err)
	}
	select {
	case err := <-woke:
		if err != nil {
			t.Fatalf("Wait: %v", err)
		}
		if d := time.Since(completed); d > 500*time.Millisecond {
			t.Errorf("waiter woke %v after Complete; the subscription did not come back", d)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("waiter did not wake after Complete")
	}
}

func TestCanceledCallIsNotUnavailability(t *testing.T) {
	srv := redistest.Start(t)
	s := newStore(t, redisstore.Options{Addrs: []string{srv.Addr}})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := s.Reserve(ctx, claim(token(), time.Second))
	if !errors.Is(err, context.Canceled) || errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("Reserve with a canceled context = %v, want context.Canceled, not ErrUnavailable", err)
	}
}

func TestManyWaitersAcrossSidecars(t *testing.T) {
	srv := redistest.Start(t)
	p := prefix(t)
	owner, _ := sidecar(t, srv.Addr, p)
	a, countA := sidecar(t, srv.Addr, p)
	b, countB := sidecar(t, srv.Addr, p)
	ctx := context.Background()
	key := token()
	c := claim(key, 30*time.Second)
	if r, err := owner.Reserve(ctx, c); err != nil || r.State != store.Won {
		t.Fatalf("Reserve = %v, %v", r.State, err)
	}

	const waiters = 20
	before := countA.count() + countB.count()
	woke := make(chan time.Time, waiters)
	var wg sync.WaitGroup
	for i := range waiters {
		s := a
		if i%2 == 1 {
			s = b
		}
		wg.Go(func() {
			if err := s.Wait(ctx, key); err != nil {
				t.Errorf("Wait: %v", err)
			}
			woke <- time.Now()
		})
	}
	// Long enough for every waiter to be blocked, short of the poll.
	time.Sleep(300 * time.Millisecond)
	if n := len(woke); n > 0 {
		t.Fatalf("%d waiters returned while the claim is pending", n)
	}
	completed := time.Now()
	if err := owner.Complete(ctx, key, c.Owner, []byte("r"), time.Minute); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		t.Fatalf("only %d of %d waiters woke", len(woke), waiters)
	}
	close(woke)
	for at := range woke {
		if d := at.Sub(completed); d > time.Second {
			t.Errorf("a waiter woke %v after Complete", d)
		}
	}
	// Each Wait reads the record once; a busy loop would show hundreds.
	if n := countA.count() + countB.count() - before; n > 2*waiters {
		t.Errorf("%d waiters cost %d round trips, want at most %d", waiters, n, 2*waiters)
	} else {
		t.Logf("%d waiters cost %d round trips", waiters, n)
	}
}

func TestClusterWakeUpCrossesNodes(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	p := "idemcp:" + t.Name() + ":"
	owner := newStore(t, redisstore.Options{Addrs: cluster.Addrs, Prefix: p})
	waiter := newStore(t, redisstore.Options{Addrs: cluster.Addrs[2:], Cluster: true, Prefix: p})
	ctx := context.Background()
	// Keys in many slots, so most are on a node other than the one the
	// waiter's subscription uses.
	for range 6 {
		key := token()
		c := claim(key, 30*time.Second)
		if r, err := owner.Reserve(ctx, c); err != nil || r.State != store.Won {
			t.Fatalf("Reserve = %v, %v", r.State, err)
		}
		woke := make(chan error, 1)
		go func() { woke <- waiter.Wait(ctx, key) }()
		time.Sleep(100 * time.Millisecond)
		completed := time.Now()
		if err := owner.Complete(ctx, key, c.Owner, []byte("r"), time.Minute); err != nil {
			t.Fatalf("Complete: %v", err)
		}
		select {
		case err := <-woke:
			if err != nil {
				t.Fatalf("Wait: %v", err)
			}
		case <-time.After(3 * time.Second):
			t.Fatal("waiter did not wake")
		}
		if d := time.Since(completed); d > 500*time.Millisecond {
			t.Errorf("waiter woke %v after Complete, by the poll rather than pub/sub", d)
		}
	}
}

func TestContractSealed(t *testing.T) {
	srv := redistest.Start(t)
	key := make([]byte, store.SealKeyBytes)
	_, _ = rand.Read(key)
	ring, err := store.NewKeyring(key)
	if err != nil {
		t.Fatal(err)
	}
	storetest.RunCore(t, func(t *testing.T) store.Store {
		return store.Seal(newStore(t, redisstore.Options{Addrs: []string{srv.Addr}}), store.SealOptions{Keyring: ring, Context: prefix(t)})
	})
}

func TestContractMinReplicas(t *testing.T) {
	primary := redistest.Start(t)
	redistest.StartReplica(t, primary)
	storetest.Run(t, func(t *testing.T) store.Store {
		// The contract is not about time: a loaded machine may take more
		// than the default second to acknowledge.
		return newStore(t, redisstore.Options{Addrs: []string{primary.Addr}, MinReplicas: 1, ReplicaTimeout: 10 * time.Second})
	})
}

// TestMinReplicas: with MinReplicas a claim and a stored result reach the
// replica before they are acknowledged; with the replica stopped a claim
// fails as a store failure that says why, and reads still work.
func TestMinReplicas(t *testing.T) {
	primary := redistest.Start(t)
	replica := redistest.StartReplica(t, primary)
	s := newStore(t, redisstore.Options{Addrs: []string{primary.Addr}, MinReplicas: 1, ReplicaTimeout: 2 * time.Second})
	ctx := context.Background()
	onReplica := func(key string) string {
		v, _ := redistest.Do(replica.Addr, "HGET", prefix(t)+key, "s")
		return v
	}

	c := claim("done", time.Minute)
	if r, err := s.Reserve(ctx, c); err != nil || r.State != store.Won {
		t.Fatalf("Reserve with the replica up: %v, %v", r.State, err)
	}
	// WAIT returned, so the replica has the claim now, not eventually.
	if got := onReplica("done"); got != "p" {
		t.Fatalf("the claim acknowledged with MinReplicas 1 is %q on the replica, want pending", got)
	}
	if err := s.Complete(ctx, "done", c.Owner, []byte("result"), time.Minute); err != nil {
		t.Fatalf("Complete with the replica up: %v", err)
	}
	if got := onReplica("done"); got != "c" {
		t.Fatalf("the result acknowledged with MinReplicas 1 is %q on the replica, want completed", got)
	}

	replica.Pause()
	defer replica.Resume()
	start := time.Now()
	_, err := s.Reserve(ctx, claim("lonely", time.Minute))
	if !errors.Is(err, store.ErrUnavailable) || !errors.Is(err, redisstore.ErrTooFewReplicas) {
		t.Fatalf("Reserve with the replica stopped: %v, want ErrUnavailable and ErrTooFewReplicas", err)
	}
	if !strings.Contains(err.Error(), "0 of the 1 replicas") {
		t.Errorf("the error does not say how many replicas acknowledged: %v", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the failed claim took %v, far over ReplicaTimeout", d)
	}
	// A replay writes nothing and waits for nobody.
	if r, err := s.Reserve(ctx, claim("done", time.Minute)); err != nil || r.State != store.Completed || string(r.Response) != "result" {
		t.Fatalf("replay with the replica stopped: %v %q, %v", r.State, r.Response, err)
	}
	replica.Resume()
	poll.Within(t, 10*time.Second, "claims to succeed once the replica is back", poll.True(func() bool {
		r, err := s.Reserve(ctx, claim("again", time.Minute))
		return err == nil && r.State == store.Won
	}))
}

// TestReplayOnlyWhatReplicasHave: with MinReplicas a result that only the
// primary holds (its Complete fell short of replicas: the owner's sidecar
// may die before it stores it again, and a failover then loses it) is not
// replayed: the retry is told the call is still running, until the
// replicas confirm the result; from then on it replays without waiting.
// Before, the retry got the result, and the chaos run saw a failover lose
// it and a later retry run the call again (ReplayedThenLost).
func TestReplayOnlyWhatReplicasHave(t *testing.T) {
	primary := redistest.Start(t)
	replica := redistest.StartReplica(t, primary)
	// 2s, not less: a replica's acknowledgement took over 300ms on a
	// loaded CI machine, and a paused replica costs this test the whole
	// timeout once.
	s := newStore(t, redisstore.Options{Addrs: []string{primary.Addr}, MinReplicas: 1, ReplicaTimeout: 2 * time.Second})
	ctx := context.Background()

	c := claim("lonely", time.Minute)
	if r, err := s.Reserve(ctx, c); err != nil || r.State != store.Won {
		t.Fatalf("Reserve with the replica up: %v, %v", r.State, err)
	}
	replica.Pause()
	defer replica.Resume()
	if err := s.Complete(ctx, c.Key, c.Owner, []byte("result"), time.Minute); !errors.Is(err, redisstore.ErrTooFewReplicas) {
		t.Fatalf("Complete with the replica stopped: %v, want ErrTooFewReplicas", err)
	}
	retry := claim("lonely", time.Minute)
	if r, err := s.Reserve(ctx, retry); err != nil || r.State != store.Pending || r.Fingerprint != retry.Fingerprint {
		t.Fatalf("retry of a result only the primary has: %v %q, %v; want pending (never a replay a failover can lose)", r.State, r.Response, err)
	}
	// A waiter is let go to try again, not held for the lease.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := s.Wait(wctx, "lonely"); err != nil {
		t.Fatalf("Wait on a result still to be confirmed: %v", err)
	}

	replica.Resume()
	poll.Within(t, 10*time.Second, "the retry to replay the result once the replica has it", poll.True(func() bool {
		r, err := s.Reserve(ctx, retry)
		return err == nil && r.State == store.Completed && string(r.Response) == "result"
	}))
	if v, _ := redistest.Do(replica.Addr, "HGET", prefix(t)+"lonely", "r"); v != "result" {
		t.Fatalf("the replayed result is %q on the replica, want it there", v)
	}
	// Confirmed once, it replays with the replica away, as a result whose
	// Complete the replica acknowledged does.
	replica.Pause()
	if r, err := s.Reserve(ctx, retry); err != nil || r.State != store.Completed || string(r.Response) != "result" {
		t.Fatalf("replay of a confirmed result with the replica stopped: %v %q, %v", r.State, r.Response, err)
	}
}

func TestMinReplicasNegative(t *testing.T) {
	_, err := redisstore.New(redisstore.Options{Addrs: []string{"127.0.0.1:1"}, MinReplicas: -1})
	if err == nil || !strings.Contains(err.Error(), "MinReplicas -1") {
		t.Fatalf("New with MinReplicas -1: %v, want an error naming it", err)
	}
}

// TestMinReplicasAcrossFailover: claims and results acknowledged with
// MinReplicas 1 are all on the replica that Sentinel promotes, and the
// store follows the Sentinel to it.
func TestMinReplicasAcrossFailover(t *testing.T) {
	primary := redistest.Start(t)
	redistest.StartReplica(t, primary)
	redistest.StartReplica(t, primary)
	sentinel := redistest.StartSentinel(t, primary, "idemcp")
	s := newStore(t, redisstore.Options{Addrs: []string{sentinel.Addr}, SentinelMaster: "idemcp", MinReplicas: 1, ReplicaTimeout: 2 * time.Second})
	ctx := context.Background()
	const n = 50
	for i := range n {
		c := claim(fmt.Sprintf("k%d", i), time.Minute)
		if r, err := s.Reserve(ctx, c); err != nil || r.State != store.Won {
			t.Fatalf("Reserve %d: %v, %v", i, r.State, err)
		}
		if i%2 == 0 {
			if err := s.Complete(ctx, c.Key, c.Owner, []byte(c.Key), time.Minute); err != nil {
				t.Fatalf("Complete %d: %v", i, err)
			}
		}
	}
	// Sentinel learns of the replicas from the primary's INFO, every
	// few seconds: until then it has none to promote.
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := redistest.Do(sentinel.Addr, "SENTINEL", "FAILOVER", "idemcp")
		if err == nil {
			break
		}
		if !strings.Contains(err.Error(), "NOGOODSLAVE") || time.Now().After(deadline) {
			t.Fatalf("SENTINEL FAILOVER: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	poll.Within(t, 10*time.Second, "the Sentinel to name a new primary", poll.True(func() bool {
		addr, err := redistest.Do(sentinel.Addr, "SENTINEL", "get-master-addr-by-name", "idemcp")
		return err == nil && strings.Replace(addr, "\n", ":", 1) != primary.Addr
	}))
	for i := range n {
		key := fmt.Sprintf("k%d", i)
		var r store.Reservation
		poll.Within(t, 10*time.Second, "the store to reach the new primary", poll.True(func() bool {
			var err error
			r, err = s.Reserve(ctx, claim(key, time.Minute))
			return err == nil
		}))
		want := store.Pending
		if i%2 == 0 {
			want = store.Completed
		}
		if r.State != want {
			t.Errorf("after the failover %s is %v, want %v", key, r.State, want)
		}
	}
}

// TestReserveResentLateRenewsTheLease: a Reserve whose reply was lost and
// that go-redis re-sends once Redis is back (a restart, a failover) finds
// its own claim and is reported Won; the owner then runs the call with a
// whole lease ahead of it, so the claim's lease must start again there, not
// at the first send. The chaos run saw a claim taken over 61ms after its
// owner started, a second after a Redis restart.
func TestReserveResentLateRenewsTheLease(t *testing.T) {
	srv := redistest.Start(t)
	p := prefix(t)
	a, _ := sidecar(t, srv.Addr, p)
	b, _ := sidecar(t, srv.Addr, p)
	ctx := context.Background()
	key := token()
	c := claim(key, 500*time.Millisecond)
	if r, err := a.Reserve(ctx, c); err != nil || r.State != store.Won {
		t.Fatalf("first Reserve = %v, %v; want won", r.State, err)
	}
	time.Sleep(400 * time.Millisecond)
	if r, err := a.Reserve(ctx, c); err != nil || r.State != store.Won || r.TookOver {
		t.Fatalf("the same Reserve re-sent = %+v, %v; want won", r, err)
	}
	time.Sleep(200 * time.Millisecond)
	if r, err := b.Reserve(ctx, claim(key, time.Second)); err != nil || r.State != store.Pending {
		t.Fatalf("another caller's Reserve 200ms after the re-sent one (lease 500ms) = %+v, %v; want pending: the owner's lease runs from its re-sent Reserve", r, err)
	}
}

// TestSetMinReplicasLive: MinReplicas changed on a store that serves (a
// policy's minReplicas changed live) holds from the next call: raised,
// a claim with no replica in reach fails as too few replicas; lowered
// again, it succeeds; a result stored while it was 0 is confirmed with
// the replica before its first replay once it is raised.
func TestSetMinReplicasLive(t *testing.T) {
	primary := redistest.Start(t)
	replica := redistest.StartReplica(t, primary)
	s := newStore(t, redisstore.Options{Addrs: []string{primary.Addr}})
	ctx := context.Background()
	c := claim("before", time.Minute)
	if r, err := s.Reserve(ctx, c); err != nil || r.State != store.Won {
		t.Fatalf("Reserve with MinReplicas 0: %v, %v", r.State, err)
	}
	if err := s.Complete(ctx, "before", c.Owner, []byte("result"), time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := s.SetMinReplicas(-1, 0); err == nil || !strings.Contains(err.Error(), "MinReplicas -1") {
		t.Fatalf("SetMinReplicas(-1) = %v, want an error naming it", err)
	}
	if err := s.SetMinReplicas(1, 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if s.MinReplicas() != 1 {
		t.Fatalf("MinReplicas() = %d after SetMinReplicas(1)", s.MinReplicas())
	}
	// The replica has it: the replay of the earlier result confirms and
	// replays.
	poll.Within(t, 10*time.Second, "the unacknowledged result to replay once confirmed", poll.True(func() bool {
		r, err := s.Reserve(ctx, claim("before", time.Minute))
		return err == nil && r.State == store.Completed && string(r.Response) == "result"
	}))
	replica.Pause()
	_, err := s.Reserve(ctx, claim("lonely", time.Minute))
	if !errors.Is(err, redisstore.ErrTooFewReplicas) {
		replica.Resume()
		t.Fatalf("Reserve with MinReplicas raised to 1 and the replica paused: %v, want ErrTooFewReplicas", err)
	}
	if err := s.SetMinReplicas(0, 0); err != nil {
		t.Fatal(err)
	}
	// ("lonely" was claimed on the primary; WAIT only fell short.)
	if r, err := s.Reserve(ctx, claim("after", time.Minute)); err != nil || r.State != store.Won {
		t.Fatalf("Reserve with MinReplicas lowered to 0 and the replica paused: %v, %v; want won", r.State, err)
	}
	replica.Resume()
}
