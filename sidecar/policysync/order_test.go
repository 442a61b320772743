package policysync

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
)

// fakeEngine holds a policy; it starts no goroutines, so it can live in a
// synctest bubble.
type fakeEngine struct{ p atomic.Pointer[policy.Policy] }

func (e *fakeEngine) Policy() *policy.Policy     { return e.p.Load() }
func (e *fakeEngine) SetPolicy(p *policy.Policy) { e.p.Store(p) }

func newFakeEngine() *fakeEngine {
	start := policy.Default()
	start.Namespace, start.Name = "shop", "pay"
	e := &fakeEngine{}
	e.SetPolicy(start)
	return e
}

// TestNeverAppliesAnOlderPolicy: a snapshot of an earlier generation of
// the object the sidecar enforces is NACKed and the policy kept, whichever
// manager sends it; the same policy sent again with an older order is
// acknowledged. A snapshot of another object (UID) is applied: the manager
// forgets a deleted policy's UID, so across UIDs it is trusted.
func TestNeverAppliesAnOlderPolicy(t *testing.T) {
	eng := newFakeEngine()
	c, err := New(Options{Endpoint: "https://manager", Namespace: "shop", Name: "pay", Token: func() (string, error) { return "t", nil }, Engine: eng})
	if err != nil {
		t.Fatal(err)
	}
	created := time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC)
	dedup := v1alpha1.IdempotencyPolicySpec{DefaultMode: v1alpha1.ModeDeduplicate}
	pass := v1alpha1.IdempotencyPolicySpec{DefaultMode: v1alpha1.ModePassthrough}
	at := func(spec v1alpha1.IdempotencyPolicySpec, uid string, created time.Time, gen int64) *policywire.Snapshot {
		s := snapshotOf(t, spec, "")
		s.Order = &policywire.Order{UID: uid, Created: created, Generation: gen}
		return s
	}
	steps := []struct {
		name  string
		snap  *policywire.Snapshot
		nack  bool
		wants *policywire.Snapshot // the policy enforced after it
	}{
		{name: "generation 2", snap: at(dedup, "u1", created, 2)},
		{name: "generation 1 from a replica that is behind", snap: at(pass, "u1", created, 1), nack: true},
		{name: "generation 1 of the policy it enforces", snap: at(dedup, "u1", created, 1)},
		{name: "generation 3", snap: at(pass, "u1", created, 3)},
		{name: "the policy created again", snap: at(dedup, "u2", created.Add(time.Hour), 1)},
		{name: "generation 1 of it from a replica that is behind", snap: at(pass, "u2", created.Add(time.Hour), 0), nack: true},
	}
	var enforced *policywire.Snapshot
	for _, s := range steps {
		_, nack := c.apply(s.snap)
		if !s.nack {
			enforced = s.snap
		}
		switch {
		case s.nack && !strings.Contains(nack, "older"):
			t.Errorf("%s: NACK %q, want one saying it is older than the policy enforced", s.name, nack)
		case !s.nack && nack != "":
			t.Errorf("%s: NACK %q, want it applied", s.name, nack)
		}
		if got := eng.Policy().Hash; got != enforced.Version {
			t.Fatalf("%s: enforcing %s, want %s", s.name, got, enforced.Version)
		}
	}
}

// TestAppliesAReplacedPolicyCreatedEarlierByTheClock: kubectl replace
// --force (or Argo CD's Replace=true) deletes the policy and creates it
// again; on API servers with skewed clocks the new object can carry an
// earlier creationTimestamp than the old. The sidecar applies the new
// object's policy, and then its later generations, instead of refusing
// every new policy until its pod restarts.
func TestAppliesAReplacedPolicyCreatedEarlierByTheClock(t *testing.T) {
	eng := newFakeEngine()
	c, err := New(Options{Endpoint: "https://manager", Namespace: "shop", Name: "pay", Token: func() (string, error) { return "t", nil }, Engine: eng})
	if err != nil {
		t.Fatal(err)
	}
	created := time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC)
	at := func(mode v1alpha1.ToolMode, uid string, created time.Time, gen int64) *policywire.Snapshot {
		s := snapshotOf(t, v1alpha1.IdempotencyPolicySpec{DefaultMode: mode}, "")
		s.Order = &policywire.Order{UID: uid, Created: created, Generation: gen}
		return s
	}
	for _, s := range []*policywire.Snapshot{
		at(v1alpha1.ModeDeduplicate, "old", created, 5),
		at(v1alpha1.ModePassthrough, "new", created.Add(-2*time.Second), 1), // replaced; a skewed clock
		at(v1alpha1.ModeAuto, "new", created.Add(-2*time.Second), 2),
	} {
		if _, nack := c.apply(s); nack != "" {
			t.Fatalf("generation %d of %s: NACK %q, want it applied", s.Order.Generation, s.Order.UID, nack)
		}
		if got := eng.Policy().Hash; got != s.Version {
			t.Fatalf("generation %d of %s: enforcing %s, want %s", s.Order.Generation, s.Order.UID, got, s.Version)
		}
	}
}

// TestRestoredPolicyNACKSaysWhy: after an etcd restore the policy's
// generation goes back while its UID stays. The sidecar keeps what it
// enforces, and its NACK (which the policy's status shows) says that a
// restore is the likely cause and what to do.
func TestRestoredPolicyNACKSaysWhy(t *testing.T) {
	eng := newFakeEngine()
	c, err := New(Options{Endpoint: "https://manager", Namespace: "shop", Name: "pay", Token: func() (string, error) { return "t", nil }, Engine: eng})
	if err != nil {
		t.Fatal(err)
	}
	created := time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC)
	now := snapshotOf(t, v1alpha1.IdempotencyPolicySpec{DefaultMode: v1alpha1.ModeDeduplicate}, "")
	now.Order = &policywire.Order{UID: "u1", Created: created, Generation: 7}
	if _, nack := c.apply(now); nack != "" {
		t.Fatal(nack)
	}
	restored := snapshotOf(t, v1alpha1.IdempotencyPolicySpec{DefaultMode: v1alpha1.ModePassthrough}, "")
	restored.Order = &policywire.Order{UID: "u1", Created: created, Generation: 3}
	_, nack := c.apply(restored)
	for _, want := range []string{"generation 3", "generation 7", "restore", "restart"} {
		if !strings.Contains(nack, want) {
			t.Errorf("NACK %q does not say %q", nack, want)
		}
	}
	if eng.Policy().Hash != now.Version {
		t.Error("the restored, older generation was applied")
	}
}

// blockedManager answers the stream with a body the test writes, and
// never reads the sidecar's reports: a manager that stopped reading.
type blockedManager struct {
	mu       sync.Mutex
	sessions []*io.PipeWriter
	opened   chan struct{}
}

func (m *blockedManager) RoundTrip(r *http.Request) (*http.Response, error) {
	pr, pw := io.Pipe()
	m.mu.Lock()
	m.sessions = append(m.sessions, pw)
	m.mu.Unlock()
	m.opened <- struct{}{}
	context.AfterFunc(r.Context(), func() { _ = pw.CloseWithError(r.Context().Err()) })
	return &http.Response{StatusCode: 200, Body: pr, Header: http.Header{}, Request: r}, nil
}

// TestReportToAManagerThatStopsReadingIsBounded: after messages that fail
// to parse, each answered by a report, the reports to a manager that
// stopped reading them pile up; the session gives up on the manager after
// the report timeout and connects again, rather than blocking forever.
func TestReportToAManagerThatStopsReadingIsBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := &blockedManager{opened: make(chan struct{}, 16)}
		c, err := New(Options{Endpoint: "https://manager", Namespace: "shop", Name: "pay",
			Token: func() (string, error) { return "t", nil }, Engine: newFakeEngine(), Transport: m})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = c.Run(ctx)
		}()
		<-m.opened
		m.mu.Lock()
		body := m.sessions[0]
		m.mu.Unlock()
		start := time.Now()
		go func() {
			for range 10 {
				if _, err := io.WriteString(body, "{not json\n"); err != nil {
					return
				}
			}
		}()
		<-m.opened // the sidecar gave up on the first session and connected again
		if d := time.Since(start); d > DefaultReportTimeout+10*time.Second {
			t.Errorf("the sidecar connected again %v after the manager stopped reading, want about %v", d, DefaultReportTimeout)
		}
		cancel()
		<-done
	})
}
