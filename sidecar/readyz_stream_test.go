package sidecar

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func readyz(t *testing.T, s *Sidecar) string {
	t.Helper()
	srv := httptest.NewServer(s.AdminHandler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(resp.Body)
	return string(body)
}

// TestReadyzSaysWhetherTheStreamIsOpen: kubectl idemcp status reads it,
// per pod, where the manager publishes only counts.
func TestReadyzSaysWhetherTheStreamIsOpen(t *testing.T) {
	s, err := New(Options{Upstream: "http://127.0.0.1:1", LogLevel: "error"})
	if err != nil {
		t.Fatal(err)
	}
	if got := readyz(t, s); !strings.HasSuffix(got, " stream=off\n") {
		t.Errorf("/readyz without --policy-endpoint: %q, want stream=off", got)
	}

	s, err = New(Options{Upstream: "http://127.0.0.1:1", LogLevel: "error",
		Policy: "apiVersion: idemcp.io/v1alpha1\nkind: IdempotencyPolicy\nmetadata: {name: p, namespace: ns}\nspec: {}\n",
		Push:   PushOptions{Endpoint: "https://127.0.0.1:1", TokenFile: t.TempDir() + "/token"}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := s.startPush(ctx); err != nil {
		t.Fatal(err)
	}
	if got := readyz(t, s); !strings.HasSuffix(got, " stream=disconnected\n") {
		t.Errorf("/readyz with no manager to reach: %q, want stream=disconnected", got)
	}
}
