package push

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/test/poll"
)

func memorySpec(defaultMode v1alpha1.ToolMode) v1alpha1.IdempotencyPolicySpec {
	return v1alpha1.IdempotencyPolicySpec{DefaultMode: defaultMode}
}

// TestChangeReachesTwentySidecars: a change to a policy reaches 20
// connected sidecars within a second, and the status and kubectl say so.
func TestChangeReachesTwentySidecars(t *testing.T) {
	const ns, name, n = "push-twenty", "payments", 20
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t))
	endpoint := "https://" + mgr.addr
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	start := compiled(t, ns, name, spec)

	var sidecars []*sidecarClient
	for i := range n {
		pod, token := createPod(t, ns, fmt.Sprintf("mcp-%d", i), name)
		sidecars = append(sidecars, startSidecarClient(t, endpoint, ns, name, pod.Name, token, start))
	}
	waitStatus(t, ns, name, 20*time.Second, synced(n, start.Hash))

	changed := time.Now()
	hash := updatePolicy(t, ns, name, func(s *v1alpha1.IdempotencyPolicySpec) {
		s.Tools = append(s.Tools, v1alpha1.ToolRule{Name: "refund", Mode: v1alpha1.ModePassthrough})
	})
	took := waitApplied(t, sidecars, hash, changed, time.Second)
	t.Logf("20 sidecars applied the change in %s", took)
	for _, s := range sidecars {
		if got := s.engine.Policy().RuleFor("refund").Mode; got != v1alpha1.ModePassthrough {
			t.Fatalf("sidecar %s: refund is %s after the change, want Passthrough", s.pod, got)
		}
	}
	p := waitStatus(t, ns, name, 5*time.Second, synced(n, hash))
	if p.Status.PolicyHash != hash {
		t.Fatalf("status.policyHash = %s, want %s", p.Status.PolicyHash, hash)
	}

	user, err := env.ControlPlane.AddUser(envtest.User{Name: "push-kubectl", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kubectl, err := user.Kubectl()
	if err != nil {
		t.Fatal(err)
	}
	out, errOut, err := kubectl.Run("get", "idpol", "-n", ns)
	if err != nil {
		b, _ := io.ReadAll(errOut)
		t.Fatalf("kubectl get idpol: %v: %s", err, b)
	}
	b, _ := io.ReadAll(out)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], "SYNCED") || !strings.Contains(lines[1], "20/20") {
		t.Fatalf("kubectl get idpol printed\n%s\nwant a SYNCED column showing 20/20", b)
	}
}

// TestRefusedCallersReceiveNothing: only a token bound to a live pod of
// the policy's namespace that names the policy gets it.
func TestRefusedCallersReceiveNothing(t *testing.T) {
	const ns, other, name = "push-auth", "push-auth-other", "payments"
	namespace(t, ns)
	namespace(t, other)
	mgr := startManager(t, "a", freeAddr(t))
	endpoint := "https://" + mgr.addr
	spec := memorySpec(v1alpha1.ModeDeduplicate)
	createPolicy(t, ns, name, spec)
	createPolicy(t, ns, "other-policy", memorySpec(v1alpha1.ModeAuto))
	createPolicy(t, other, name, spec)
	hash := hashOf(t, spec)

	good, goodToken := createPod(t, ns, "good", name)
	_, foreignToken := createPod(t, other, "foreign", name)
	_, otherPolicyToken := createPod(t, ns, "names-another", "other-policy")
	wrongAudience := podToken(t, good, "not-idemcp")

	// The control: the right caller gets the policy, and a token re-signed
	// with a later expiry still works, so the expired one below is refused
	// for its expiry alone.
	poll.Within(t, 15*time.Second, "the leader to serve", func() error {
		code, body := rawStream(t, endpoint, ns, name, goodToken)
		if code != http.StatusOK || !strings.Contains(body, hash) {
			return fmt.Errorf("the pod's own token got %d %q", code, body)
		}
		return nil
	})
	if code, body := rawStream(t, endpoint, ns, name, resign(t, goodToken, time.Now().Add(30*time.Minute))); code != http.StatusOK || !strings.Contains(body, hash) {
		t.Fatalf("a re-signed valid token got %d %q, want the policy", code, body)
	}

	for _, tc := range []struct {
		name, token string
		code        int
	}{
		{"token bound to a pod of another namespace", foreignToken, http.StatusForbidden},
		{"pod names another policy", otherPolicyToken, http.StatusForbidden},
		{"wrong audience", wrongAudience, http.StatusUnauthorized},
		{"expired token", resign(t, goodToken, time.Now().Add(-time.Minute)), http.StatusUnauthorized},
		{"no token", "", http.StatusUnauthorized},
		{"garbage token", "not-a-token", http.StatusUnauthorized},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := rawStream(t, endpoint, ns, name, tc.token)
			if code != tc.code {
				t.Fatalf("got %d %q, want %d", code, body, tc.code)
			}
			if strings.Contains(body, hash) || strings.Contains(body, "defaultMode") {
				t.Fatalf("a refused caller received policy data: %q", body)
			}
		})
	}

	// A deleted pod's token is refused too.
	if err := k8s.Delete(context.Background(), good, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	poll.Within(t, 15*time.Second, "the deleted pod's token to be refused", func() error {
		if code, body := rawStream(t, endpoint, ns, name, goodToken); code == http.StatusOK || strings.Contains(body, hash) {
			return fmt.Errorf("got %d %q", code, body)
		}
		return nil
	})
}

// TestManagerAwayAndFailover: while no manager serves, sidecars keep
// enforcing their policy; when one comes back, or the other replica takes
// over, they resync within 10 seconds without a restart, and the counts
// stay right with two replicas.
func TestManagerAwayAndFailover(t *testing.T) {
	const ns, name, n = "push-away", "payments", 5
	namespace(t, ns)
	addrA, addrB := freeAddr(t), freeAddr(t)
	a := startManager(t, "a", addrA)
	front := newFront(t, func() string {
		switch {
		case a.leading():
			return addrA
		}
		return ""
	})
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	start := compiled(t, ns, name, spec)
	var sidecars []*sidecarClient
	for i := range n {
		pod, token := createPod(t, ns, fmt.Sprintf("mcp-%d", i), name)
		sidecars = append(sidecars, startSidecarClient(t, "https://"+front.addr, ns, name, pod.Name, token, start))
	}
	waitStatus(t, ns, name, 20*time.Second, synced(n, start.Hash))

	// The manager goes away; the policy changes meanwhile.
	a.stop()
	h1 := updatePolicy(t, ns, name, func(s *v1alpha1.IdempotencyPolicySpec) { s.DefaultMode = v1alpha1.ModeDeduplicate })
	time.Sleep(time.Second)
	for _, s := range sidecars {
		if s.engine.Policy().Hash != start.Hash || !s.engine.Deduplicates("charge_card") {
			t.Fatalf("sidecar %s lost its policy while the manager was away", s.pod)
		}
	}

	// It comes back (same address): resync without restarting anything.
	a2 := startManager(t, "a2", addrA)
	front.pick(func() string {
		if a2.leading() {
			return addrA
		}
		return ""
	})
	back := time.Now()
	waitApplied(t, sidecars, h1, back, 10*time.Second)
	t.Logf("resynced %s after the manager came back", time.Since(back))
	waitStatus(t, ns, name, 10*time.Second, synced(n, h1))

	// Two replicas: b waits as the follower, and the front (the Service)
	// routes to whichever leads, as the leader label makes it.
	b := startManager(t, "b", addrB)
	front.pick(func() string {
		switch {
		case a2.leading():
			return addrA
		case b.leading():
			return addrB
		}
		return ""
	})
	time.Sleep(500 * time.Millisecond)
	if b.leading() {
		t.Fatal("both replicas lead")
	}
	// The follower serves nothing, so it can never hand out a stale policy.
	pod0, token0 := createPod(t, ns, "probe", name)
	_ = pod0
	if code, body := rawStream(t, "https://"+addrB, ns, name, token0); code != http.StatusServiceUnavailable || strings.Contains(body, h1) {
		t.Fatalf("the follower answered %d %q, want 503 and no policy", code, body)
	}
	if err := k8s.Delete(context.Background(), pod0); err != nil {
		t.Fatal(err)
	}

	a2.stop()
	failover := time.Now()
	poll.Within(t, 15*time.Second, "b to take the lead", func() error {
		if !b.leading() {
			return fmt.Errorf("b does not lead")
		}
		return nil
	})
	// No acknowledgement is lost: b learns from each sidecar's first
	// report what it enforces, before any new snapshot.
	poll.Within(t, 15*time.Second, "every sidecar to reach b", func() error {
		if c, s := b.stream.Streams(ns, name); c != n || s != n {
			return fmt.Errorf("b holds %d streams, %d synced", c, s)
		}
		return nil
	})
	t.Logf("every sidecar reconnected to the new leader, synced, %s after the failover", time.Since(failover))
	if c, _ := a2.stream.Streams(ns, name); c != 0 {
		t.Fatalf("the stopped replica still holds %d streams", c)
	}
	h2 := updatePolicy(t, ns, name, func(s *v1alpha1.IdempotencyPolicySpec) { s.DefaultMode = v1alpha1.ModePassthrough })
	waitApplied(t, sidecars, h2, time.Now(), 10*time.Second)
	p := waitStatus(t, ns, name, 10*time.Second, synced(n, h2))
	if p.Status.Sidecars.Connected != n {
		t.Fatalf("connected = %d with two replicas, want %d", p.Status.Sidecars.Connected, n)
	}
}

// TestStoreChangeRequiresRestart: a policy that changes its store is
// applied but the store stays; the status says RestartRequired with the
// pods' count, and after the restart it shows synced.
func TestStoreChangeRequiresRestart(t *testing.T) {
	const ns, name, n = "push-store", "payments", 3
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t))
	endpoint := "https://" + mgr.addr
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	start := compiled(t, ns, name, spec)
	var sidecars []*sidecarClient
	for i := range n {
		pod, token := createPod(t, ns, fmt.Sprintf("mcp-%d", i), name)
		sidecars = append(sidecars, startSidecarClient(t, endpoint, ns, name, pod.Name, token, start))
	}
	waitStatus(t, ns, name, 20*time.Second, synced(n, start.Hash))

	hash := updatePolicy(t, ns, name, func(s *v1alpha1.IdempotencyPolicySpec) {
		s.Store = v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{Addresses: []string{"redis.example:6379"}}}}
	})
	waitApplied(t, sidecars, hash, time.Now(), 5*time.Second)
	p := waitStatus(t, ns, name, 10*time.Second, func(p *v1alpha1.IdempotencyPolicy) error {
		c := condition(p, v1alpha1.ConditionSidecarsSynced)
		if c == nil || c.Reason != v1alpha1.ReasonRestartRequired || p.Status.Sidecars.RestartRequired != n {
			return fmt.Errorf("SidecarsSynced = %+v, sidecars = %+v", c, p.Status.Sidecars)
		}
		if r := condition(p, v1alpha1.ConditionReady); r == nil || r.Status != metav1.ConditionFalse || r.Reason != v1alpha1.ReasonSidecarsNotSynced {
			return fmt.Errorf("Ready = %+v, want False/%s", r, v1alpha1.ReasonSidecarsNotSynced)
		}
		return nil
	})
	c := condition(p, v1alpha1.ConditionSidecarsSynced)
	if c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, fmt.Sprintf("%d pods", n)) || !strings.Contains(c.Message, "kubectl -n "+ns) {
		t.Fatalf("SidecarsSynced = %+v, want False with the pods' count and the command to run", c)
	}
	if r := condition(p, v1alpha1.ConditionReady); r == nil || r.Status != metav1.ConditionFalse || r.Reason != v1alpha1.ReasonSidecarsNotSynced {
		t.Fatalf("Ready = %+v, want False/%s", r, v1alpha1.ReasonSidecarsNotSynced)
	}
	t.Logf("SidecarsSynced: %s", c.Message)

	// The rollout: old pods go, new ones start from the new snapshot.
	newStart := compiled(t, ns, name, p.Spec)
	for i, s := range sidecars {
		s.cancel()
		<-s.done
		if err := k8s.Delete(context.Background(), &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: s.pod}}); err != nil {
			t.Fatal(err)
		}
		pod, token := createPod(t, ns, fmt.Sprintf("mcp-new-%d", i), name)
		startSidecarClient(t, endpoint, ns, name, pod.Name, token, newStart)
	}
	waitStatus(t, ns, name, 10*time.Second, synced(n, hash))
}

// front stands for the stream's Service: it forwards each connection to
// the replica picked now, and refuses it when none is (no endpoints).
type front struct {
	addr   string
	mu     sync.Mutex
	target func() string
}

func newFront(t testing.TB, target func() string) *front {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &front{addr: ln.Addr().String(), target: target}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go f.forward(c)
		}
	}()
	return f
}

func (f *front) pick(target func() string) {
	f.mu.Lock()
	f.target = target
	f.mu.Unlock()
}

func (f *front) forward(c net.Conn) {
	defer func() { _ = c.Close() }()
	f.mu.Lock()
	to := f.target()
	f.mu.Unlock()
	if to == "" {
		return
	}
	up, err := net.Dial("tcp", to)
	if err != nil {
		return
	}
	defer func() { _ = up.Close() }()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
	<-done
}

// TestIdleStreamStaysOpen: a stream that carries nothing for longer than
// the write timeout stays open, so sidecars do not reconnect (a TLS
// handshake and a TokenReview each) every few seconds, and the next change
// arrives on the stream they hold.
func TestIdleStreamStaysOpen(t *testing.T) {
	const ns, name = "push-idle", "payments"
	const writeTimeout = 300 * time.Millisecond
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t), func(o *manager.Options) { o.PolicyStreamWriteTimeout = writeTimeout })
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	start := compiled(t, ns, name, spec)
	pod, token := createPod(t, ns, "mcp-0", name)
	s := startSidecarClient(t, "https://"+mgr.addr, ns, name, pod.Name, token, start)
	waitStatus(t, ns, name, 20*time.Second, synced(1, start.Hash))

	time.Sleep(10 * writeTimeout)
	hash := updatePolicy(t, ns, name, func(s *v1alpha1.IdempotencyPolicySpec) { s.DefaultMode = v1alpha1.ModeDeduplicate })
	waitApplied(t, []*sidecarClient{s}, hash, time.Now(), 10*time.Second)
	time.Sleep(10 * writeTimeout)
	if !s.client.Connected() || s.client.Sessions() != 1 {
		t.Fatalf("after idle periods of 10 write timeouts: connected %v, %d streams opened; want the first stream still open", s.client.Connected(), s.client.Sessions())
	}
}
