package push

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/test/poll"
)

func withTicket(ticket string) http.Header {
	return http.Header{policywire.ReviewTicketHeader: {ticket}}
}

// TestReviewTicketSparesTheSuccessorTokenReviews: after a failover, the
// new leader takes a sidecar's review ticket from the old one instead of a
// TokenReview; a ticket with another pod's token or a garbled one is
// refused and the token reviewed; a ticket whose pod was deleted or
// replaced (another UID) admits nobody.
func TestReviewTicketSparesTheSuccessorTokenReviews(t *testing.T) {
	const ns, name = "push-ticket", "payments"
	namespace(t, ns)
	addr := freeAddr(t)
	endpoint := "https://" + addr
	a := startManager(t, "a", addr)
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	hash := hashOf(t, spec)
	start := compiled(t, ns, name, spec)
	const holder, other, gone, side, garbled = 0, 1, 2, 3, 4
	pods, tokens, tickets := make([]*corev1.Pod, 5), make([]string, 5), make([]string, 5)
	for i := range pods {
		pods[i], tokens[i] = createPod(t, ns, fmt.Sprintf("mcp-%d", i), name)
	}
	poll.Within(t, 15*time.Second, "the leader to serve", func() error {
		code, body, h := rawStreamWith(t, endpoint, ns, name, tokens[holder], nil)
		if code != http.StatusOK || !strings.Contains(body, hash) {
			return fmt.Errorf("got %d %q", code, body)
		}
		tickets[holder] = h.Get(policywire.ReviewTicketHeader)
		return nil
	})
	if tickets[holder] == "" {
		t.Fatal("an accepted stream came with no review ticket")
	}
	_, _, h := rawStreamWith(t, endpoint, ns, name, tokens[gone], nil)
	if tickets[gone] = h.Get(policywire.ReviewTicketHeader); tickets[gone] == "" {
		t.Fatal("an accepted stream came with no review ticket")
	}
	sidecar := startSidecarClient(t, endpoint, ns, name, pods[side].Name, tokens[side], start)
	poll.Within(t, 15*time.Second, "the sidecar to connect", func() error {
		if c, s := a.stream.Streams(ns, name); c != 1 || s != 1 {
			return fmt.Errorf("a holds %d streams, %d synced", c, s)
		}
		return nil
	})

	// The successor (its own review cache, empty) on the same address.
	a.stop()
	reviewed, ticketed := tokenReviews(t, "reviewed"), tokenReviews(t, "ticket")
	b := startManager(t, "b", addr)
	poll.Within(t, 15*time.Second, "the successor to serve the ticket's holder", func() error {
		code, body, h := rawStreamWith(t, endpoint, ns, name, tokens[holder], withTicket(tickets[holder]))
		if code != http.StatusOK || !strings.Contains(body, hash) {
			return fmt.Errorf("got %d %q", code, body)
		}
		if h.Get(policywire.ReviewTicketHeader) == "" {
			return fmt.Errorf("no new ticket")
		}
		return nil
	})
	poll.Within(t, 15*time.Second, "the sidecar to reconnect to the successor", func() error {
		if c, s := b.stream.Streams(ns, name); c != 1 || s != 1 {
			return fmt.Errorf("b holds %d streams, %d synced", c, s)
		}
		return nil
	})
	if !sidecar.client.Connected() {
		t.Fatal("the sidecar is not connected")
	}
	if got := tokenReviews(t, "reviewed") - reviewed; got != 0 {
		t.Errorf("the successor made %v TokenReviews for callers with tickets, want 0", got)
	}
	if got := tokenReviews(t, "ticket") - ticketed; got < 2 {
		t.Errorf("the successor took %v tickets, want at least 2 (the raw caller's and the sidecar's)", got)
	}

	// Another pod's token with the holder's ticket: the ticket is refused
	// and the token reviewed, so its caller is served as itself only.
	refused, reviewed := tokenReviews(t, "ticket_refused"), tokenReviews(t, "reviewed")
	if code, body, _ := rawStreamWith(t, endpoint, ns, name, tokens[other], withTicket(tickets[holder])); code != http.StatusOK || !strings.Contains(body, hash) {
		t.Fatalf("a pod's own token with another pod's ticket got %d %q, want 200 after a review", code, body)
	}
	if code, body, _ := rawStreamWith(t, endpoint, ns, name, tokens[garbled], withTicket("garbled.ticket")); code != http.StatusOK || !strings.Contains(body, hash) {
		t.Fatalf("a token with a garbled ticket got %d %q, want 200 after a review", code, body)
	}
	if got := tokenReviews(t, "ticket_refused") - refused; got != 2 {
		t.Errorf("refused tickets went up by %v, want 2", got)
	}
	if got := tokenReviews(t, "reviewed") - reviewed; got != 2 {
		t.Errorf("TokenReviews went up by %v, want 2 (each refused ticket's token reviewed)", got)
	}

	// The pod is deleted and another takes its name: its ticket, still
	// valid in itself, admits nobody, and no TokenReview is needed to know.
	reviewed = tokenReviews(t, "reviewed")
	if err := k8s.Delete(context.Background(), pods[gone], client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	poll.Within(t, 15*time.Second, "the deleted pod's ticket to be refused", func() error {
		if code, body, _ := rawStreamWith(t, endpoint, ns, name, tokens[gone], withTicket(tickets[gone])); code != http.StatusForbidden || strings.Contains(body, hash) {
			return fmt.Errorf("got %d %q, want 403 and no policy", code, body)
		}
		return nil
	})
	createPod(t, ns, pods[gone].Name, name)
	poll.Within(t, 15*time.Second, "the replaced pod's ticket to be refused", func() error {
		code, body, _ := rawStreamWith(t, endpoint, ns, name, tokens[gone], withTicket(tickets[gone]))
		if code != http.StatusForbidden || !strings.Contains(body, "is gone") {
			return fmt.Errorf("got %d %q, want 403 saying the pod is gone", code, body)
		}
		return nil
	})
	if got := tokenReviews(t, "reviewed") - reviewed; got != 0 {
		t.Errorf("refusing a gone pod's ticket made %v TokenReviews, want 0", got)
	}
}
