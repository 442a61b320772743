package push

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/test/poll"
)

// tokenReviews reads idemcp_policy_stream_token_reviews_total{result}.
func tokenReviews(t testing.TB, result string) float64 {
	t.Helper()
	families, err := ctrlmetrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "idemcp_policy_stream_token_reviews_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" && l.GetValue() == result {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestTokenReviewsAreCached: a token presented again costs no second
// TokenReview, and a remembered review never outlives its token.
func TestTokenReviewsAreCached(t *testing.T) {
	const ns, name = "push-review-cache", "payments"
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t))
	endpoint := "https://" + mgr.addr
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	hash := hashOf(t, spec)
	_, token := createPod(t, ns, "mcp-0", name)
	poll.Within(t, 15*time.Second, "the leader to serve", func() error {
		if code, body := rawStream(t, endpoint, ns, name, token); code != http.StatusOK || !strings.Contains(body, hash) {
			return fmt.Errorf("got %d %q", code, body)
		}
		return nil
	})

	reviewed, cached := tokenReviews(t, "reviewed"), tokenReviews(t, "cached")
	for range 3 {
		if code, body := rawStream(t, endpoint, ns, name, token); code != http.StatusOK || !strings.Contains(body, hash) {
			t.Fatalf("the same token again got %d %q", code, body)
		}
	}
	if got := tokenReviews(t, "reviewed") - reviewed; got != 0 {
		t.Errorf("3 more streams with one token made %v TokenReviews, want 0", got)
	}
	if got := tokenReviews(t, "cached") - cached; got != 3 {
		t.Errorf("3 more streams with one token used the cache %v times, want 3", got)
	}

	// A token that expires in a few seconds is accepted now, and refused
	// once it expired, although its review was remembered.
	short := resign(t, token, time.Now().Add(4*time.Second))
	if code, body := rawStream(t, endpoint, ns, name, short); code != http.StatusOK || !strings.Contains(body, hash) {
		t.Fatalf("a token valid for 4 more seconds got %d %q", code, body)
	}
	time.Sleep(5 * time.Second)
	if code, body := rawStream(t, endpoint, ns, name, short); code != http.StatusUnauthorized || strings.Contains(body, hash) {
		t.Fatalf("the expired token got %d %q, want 401 and no policy", code, body)
	}
}

// TestTokenReviewsLimitedAndStreamsCapped: beyond its TokenReview rate or
// its stream limit, the manager answers 503 saying why, and sends nothing.
func TestTokenReviewsLimitedAndStreamsCapped(t *testing.T) {
	const ns, name = "push-limits", "payments"
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t), func(o *manager.Options) {
		o.PolicyStreamTokenReviews = 0.2 // one every 5s, burst 1
		o.PolicyStreamMaxStreams = 1
	})
	endpoint := "https://" + mgr.addr
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	hash := hashOf(t, spec)
	first, firstToken := createPod(t, ns, "mcp-0", name)
	_, secondToken := createPod(t, ns, "mcp-1", name)
	poll.Within(t, 15*time.Second, "the leader to serve", func() error {
		if code, body := rawStream(t, endpoint, ns, name, firstToken); code != http.StatusOK || !strings.Contains(body, hash) {
			return fmt.Errorf("got %d %q", code, body)
		}
		return nil
	})

	limited := tokenReviews(t, "limited")
	code, body := rawStream(t, endpoint, ns, name, secondToken)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "checking too many tokens") || strings.Contains(body, hash) {
		t.Fatalf("a new token right after the rate's burst got %d %q, want 503 saying too many tokens", code, body)
	}
	if got := tokenReviews(t, "limited") - limited; got != 1 {
		t.Errorf("limited TokenReviews went up by %v, want 1", got)
	}

	// One sidecar holds the only stream; the next caller is refused.
	s := startSidecarClient(t, endpoint, ns, name, first.Name, firstToken, compiled(t, ns, name, spec))
	poll.Within(t, 15*time.Second, "the sidecar to connect", func() error {
		if !s.client.Connected() {
			return fmt.Errorf("not connected")
		}
		return nil
	})
	code, body = rawStream(t, endpoint, ns, name, firstToken)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "limit of 1 policy streams") || strings.Contains(body, hash) {
		t.Fatalf("a stream beyond the limit got %d %q, want 503 naming the limit", code, body)
	}
}
