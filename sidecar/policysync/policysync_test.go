package policysync

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
)

func TestBackoffIsCappedAndJittered(t *testing.T) {
	seen := map[time.Duration]bool{}
	for n := range 50 {
		d := backoff(200*time.Millisecond, 5*time.Second, n)
		if d > 5*time.Second || d < 100*time.Millisecond {
			t.Fatalf("attempt %d waits %s, want within [100ms, 5s]", n, d)
		}
		if n >= 5 && d < 2500*time.Millisecond {
			t.Fatalf("attempt %d waits %s: not backing off to the cap", n, d)
		}
		seen[d] = true
	}
	if len(seen) < 40 {
		t.Fatalf("only %d distinct waits in 50: no jitter", len(seen))
	}
}

func snapshotOf(t *testing.T, spec v1alpha1.IdempotencyPolicySpec, version string) *policywire.Snapshot {
	t.Helper()
	p, err := policy.Compile(spec)
	if err != nil {
		t.Fatal(err)
	}
	if version == "" {
		version = p.Hash
	}
	return &policywire.Snapshot{Version: version, Nonce: "1", Policy: &v1alpha1.IdempotencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "pay"}, Spec: p.Spec,
	}}
}

func TestApply(t *testing.T) {
	start := policy.Default()
	start.Namespace, start.Name = "shop", "pay"
	newClient := func() (*Client, *engine.Engine) {
		eng := engine.New(engine.Options{Policy: start})
		c, err := New(Options{Endpoint: "https://manager", Namespace: "shop", Name: "pay", Token: func() (string, error) { return "t", nil },
			Engine: eng, StoreIdentity: policywire.StoreIdentity(start.Spec.Store)})
		if err != nil {
			t.Fatal(err)
		}
		return c, eng
	}

	t.Run("applies and acknowledges", func(t *testing.T) {
		c, eng := newClient()
		snap := snapshotOf(t, v1alpha1.IdempotencyPolicySpec{DefaultMode: v1alpha1.ModeDeduplicate}, "")
		if restart, nack := c.apply(snap); restart != "" || nack != "" {
			t.Fatalf("restart %q nack %q", restart, nack)
		}
		if eng.Policy().Hash != snap.Version || c.report(snap.Nonce, "", "").Version != snap.Version {
			t.Fatal("the snapshot was not applied")
		}
	})
	t.Run("a hash it cannot reproduce is NACKed and the old policy kept", func(t *testing.T) {
		c, eng := newClient()
		snap := snapshotOf(t, v1alpha1.IdempotencyPolicySpec{DefaultMode: v1alpha1.ModeDeduplicate}, "0000000000000000")
		_, nack := c.apply(snap)
		if !strings.Contains(nack, "compiles to") || eng.Policy().Hash != start.Hash {
			t.Fatalf("nack %q, enforcing %s", nack, eng.Policy().Hash)
		}
		if r := c.report(snap.Nonce, "", nack); r.Version != start.Hash || r.Error == "" {
			t.Fatalf("report %+v, want the old version and the error", r)
		}
	})
	t.Run("another policy's snapshot is NACKed", func(t *testing.T) {
		c, eng := newClient()
		snap := snapshotOf(t, v1alpha1.IdempotencyPolicySpec{}, "")
		snap.Policy.Name = "other"
		if _, nack := c.apply(snap); nack == "" || eng.Policy().Name != "pay" {
			t.Fatalf("nack %q", nack)
		}
	})
	t.Run("a store change is applied but needs a restart", func(t *testing.T) {
		c, eng := newClient()
		snap := snapshotOf(t, v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis,
			Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{Addresses: []string{"r:6379"}}}}}, "")
		restart, nack := c.apply(snap)
		if restart == "" || nack != "" || eng.Policy().Hash != snap.Version {
			t.Fatalf("restart %q nack %q", restart, nack)
		}
		if r := c.report("", "", ""); r.RestartRequired == "" {
			t.Fatal("the first report after a reconnect forgets the restart")
		}
	})
}

func TestStoreIdentityIgnoresManagedRedisSizing(t *testing.T) {
	a := v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{Managed: &v1alpha1.ManagedRedis{Image: "redis:7"}}}
	b := v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{Managed: &v1alpha1.ManagedRedis{Image: "redis:8"}}}
	if policywire.StoreIdentity(a) != policywire.StoreIdentity(b) {
		t.Fatal("a new Redis image would require a restart")
	}
	if policywire.StoreIdentity(a) == policywire.StoreIdentity(v1alpha1.StoreSpec{}) {
		t.Fatal("Memory and managed Redis look the same")
	}
	if policywire.StoreIdentity(v1alpha1.StoreSpec{}) != policywire.StoreIdentity(v1alpha1.StoreSpec{Type: v1alpha1.StoreMemory}) {
		t.Fatal("the default store differs from Memory")
	}
}

// TestStalledManagerIsGivenUp: a manager address that takes the connection
// and never answers (as a Service still routing to a pod that just died
// can look) ends the attempt by itself, so the sidecar retries and finds
// the new leader, rather than waiting minutes on one connection.
func TestStalledManagerIsGivenUp(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0") // held open: no port race
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	var held []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c) // accepted, never answered
			mu.Unlock()
		}
	}()
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			_ = c.Close()
		}
	}()
	start := policy.Default()
	c, err := New(Options{Endpoint: "https://" + ln.Addr().String(), Namespace: "shop", Name: "pay",
		Token: func() (string, error) { return "t", nil }, Engine: engine.New(engine.Options{Policy: start}),
		ConnectTimeout: 300 * time.Millisecond, HeaderTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	got, err := c.session(ctx)
	if ctx.Err() != nil {
		t.Fatal("the attempt on a manager that never answers was still waiting after 5s, with a connect timeout of 300ms")
	}
	if got || err == nil {
		t.Fatalf("session = %v, %v; want an error that ends the attempt", got, err)
	}
}
