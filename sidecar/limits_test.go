package sidecar

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestTricklingBodyIsCutOff: a client that sends a 4 MiB body a few bytes
// at a time loses its connection at the deadline; a prompt body and a slow
// response stream after it are untouched.
func TestTricklingBodyIsCutOff(t *testing.T) {
	readErr := make(chan error, 1)
	srv := httptest.NewServer(withBodyDeadline(300*time.Millisecond, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, err := io.Copy(io.Discard, r.Body)
		if r.URL.Path == "/trickle" {
			readErr <- err
			return
		}
		if err != nil {
			t.Errorf("reading a prompt body: %v", err)
		}
		// A response stream longer than the body deadline.
		for i := range 3 {
			_, _ = fmt.Fprintf(w, "event %d after %d bytes\n", i, n)
			w.(http.Flusher).Flush()
			time.Sleep(250 * time.Millisecond)
		}
	})))
	defer srv.Close()

	resp, err := http.Post(srv.URL+"/prompt", "application/json", strings.NewReader(`{"jsonrpc":"2.0"}`))
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if err != nil || strings.Count(string(b), "event") != 3 {
		t.Fatalf("a prompt body's 750ms response stream: %q, %v; want 3 events", b, err)
	}

	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_, _ = fmt.Fprintf(conn, "POST /trickle HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", 4<<20)
	start := time.Now()
	go func() {
		for range 100 {
			if _, err := conn.Write([]byte("{")); err != nil {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()
	select {
	case err := <-readErr:
		if err == nil {
			t.Fatal("the trickled body was read in full")
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Fatalf("the trickling client was cut off after %v, want about 300ms", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a client trickling a 4 MiB body still holds its request after 5s")
	}
}
