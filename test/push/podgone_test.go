package push

import (
	"bufio"
	"context"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/test/poll"
)

// TestDeletedPodStreamEnds: the stream of a pod that is deleted ends, as
// a new one from its token would be refused; it does not go on receiving
// the policy's changes until the token expires (up to an hour).
func TestDeletedPodStreamEnds(t *testing.T) {
	const ns, name = "push-pod-gone", "payments"
	namespace(t, ns)
	mgr := startManager(t, "a", freeAddr(t))
	endpoint := "https://" + mgr.addr
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	hash := hashOf(t, spec)
	pod, token := createPod(t, ns, "mcp-0", name)
	poll.Within(t, 15*time.Second, "the leader to serve", func() error {
		if code, body := rawStream(t, endpoint, ns, name, token); code != http.StatusOK || !strings.Contains(body, hash) {
			return fmt.Errorf("the pod's own token got %d %q", code, body)
		}
		return nil
	})

	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: tlsConfig(pool), ForceAttemptHTTP2: true}}
	pr, pw := io.Pipe()
	defer func() { _ = pw.Close() }()
	req, _ := http.NewRequest(http.MethodPost, endpoint+policywire.StreamPath(ns, name), pr)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("opening the stream: %v", err)
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the stream answered %d", resp.StatusCode)
	}
	lines := bufio.NewReader(resp.Body)
	first, err := lines.ReadString('\n')
	if err != nil || !strings.Contains(first, hash) {
		t.Fatalf("first line %q, %v; want the snapshot", first, err)
	}

	if err := k8s.Delete(context.Background(), pod, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	poll.Within(t, 15*time.Second, "the deleted pod's token to be refused on a new stream", func() error {
		if code, _ := rawStream(t, endpoint, ns, name, token); code == http.StatusOK {
			return fmt.Errorf("got %d", code)
		}
		return nil
	})
	changed := updatePolicy(t, ns, name, func(s *v1alpha1.IdempotencyPolicySpec) {
		s.Tools = append(s.Tools, v1alpha1.ToolRule{Name: "refund", Mode: v1alpha1.ModePassthrough})
	})

	// Bound the read, so that a stream that stays open fails the test
	// rather than hanging it.
	guard := time.AfterFunc(20*time.Second, func() { _ = pw.Close(); _ = resp.Body.Close() })
	defer guard.Stop()
	for {
		line, err := lines.ReadString('\n')
		if strings.Contains(line, changed) {
			t.Fatalf("the stream of deleted pod %s received the policy change %s", pod.Name, changed)
		}
		if err != nil {
			if !guard.Stop() {
				t.Fatalf("the stream of deleted pod %s stayed open 20s after its pod was gone and a new stream was refused", pod.Name)
			}
			return // the manager ended it
		}
	}
}
