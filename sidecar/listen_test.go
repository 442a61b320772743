package sidecar

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemcp/idemcp/internal/storeopen"
)

// value reads a counter or a gauge.
func value(c prometheus.Metric) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	if m.Gauge != nil {
		return m.GetGauge().GetValue()
	}
	return m.GetCounter().GetValue()
}

// dialFrom connects to addr from the loopback address local (127.0.0.x),
// so that one test can be several clients.
func dialFrom(t *testing.T, local, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("dialling %s from %s: %v", addr, local, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// get sends one request on c and reads the answer.
func get(t *testing.T, c net.Conn, path string) (*http.Response, string) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "GET "+path+" HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatalf("writing a request: %v", err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	return resp, string(b)
}

// TestLimitListener: connections over the total bound, or over the bound
// of one client address, are answered 503 and closed at once and counted;
// a connection closed gives its slot back; the others are served.
func TestLimitListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m := newConnMetrics(prometheus.NewRegistry())
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "served") })}
	go func() { _ = srv.Serve(newLimitListener(ln, "admin", 4, 2, m)) }()
	t.Cleanup(func() { _ = srv.Close() })
	addr := ln.Addr().String()

	a1, a2 := dialFrom(t, "127.0.0.1", addr), dialFrom(t, "127.0.0.1", addr)
	for _, c := range []net.Conn{a1, a2} {
		if resp, body := get(t, c, "/"); resp.StatusCode != 200 || body != "served" {
			t.Fatalf("a connection within the bounds: %d %q", resp.StatusCode, body)
		}
	}
	resp, body := get(t, dialFrom(t, "127.0.0.1", addr), "/")
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || !strings.Contains(body, "limit of connections") {
		t.Fatalf("a third connection from one client: %d %q, want 503 with Retry-After", resp.StatusCode, body)
	}
	if n := value(m.refused.WithLabelValues("admin", "per_client")); n != 1 {
		t.Fatalf("refused per client = %v, want 1", n)
	}
	b1, b2 := dialFrom(t, "127.0.0.2", addr), dialFrom(t, "127.0.0.2", addr)
	for _, c := range []net.Conn{b1, b2} {
		if resp, _ := get(t, c, "/"); resp.StatusCode != 200 {
			t.Fatalf("another client, within the bounds: %d", resp.StatusCode)
		}
	}
	if resp, _ := get(t, dialFrom(t, "127.0.0.3", addr), "/"); resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("a fifth connection: %d, want 503 (total bound)", resp.StatusCode)
	}
	if n := value(m.refused.WithLabelValues("admin", "total")); n != 1 {
		t.Fatalf("refused in total = %v, want 1", n)
	}
	if n := value(m.open.WithLabelValues("admin")); n != 4 {
		t.Fatalf("open connections = %v, want 4", n)
	}
	_ = a1.Close()
	deadline := time.Now().Add(5 * time.Second)
	for value(m.open.WithLabelValues("admin")) != 3 {
		if time.Now().After(deadline) {
			t.Fatal("a closed connection did not give its slot back")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if resp, _ := get(t, dialFrom(t, "127.0.0.1", addr), "/"); resp.StatusCode != 200 {
		t.Fatalf("after a connection closed: %d, want its slot taken", resp.StatusCode)
	}
}

func TestMaxConnections(t *testing.T) {
	if got := maxConnections(-1); got != -1 {
		t.Errorf("maxConnections(-1) = %d, want no bound", got)
	}
	if got := maxConnections(50); got != 50 {
		t.Errorf("maxConnections(50) = %d", got)
	}
	got := maxConnections(0)
	if got > DefaultMaxConnections || got < 256 {
		t.Errorf("maxConnections(0) = %d, want within [256, %d]", got, DefaultMaxConnections)
	}
	if limit := openFileLimit(); limit > 0 && uint64(got)+1024 > limit && got != 256 {
		t.Errorf("maxConnections(0) = %d leaves less than 1024 of the %d open files", got, limit)
	}
}

// TestLimitConnHalfCloses: net/http's server ends a connection whose
// request body it did not read by closing its write side first
// (CloseWrite, found by a type assertion), so that the client reads the
// answer before the reset; the bounded listener's connections must still
// offer it.
func TestLimitConnHalfCloses(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := newLimitListener(ln, "proxy", 0, 0, newConnMetrics(prometheus.NewRegistry()))
	t.Cleanup(func() { _ = l.Close() })
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	client := dialFrom(t, "127.0.0.1", ln.Addr().String())
	c := <-accepted
	defer func() { _ = c.Close() }()
	cw, ok := c.(interface{ CloseWrite() error })
	if !ok {
		t.Fatal("the listener's connections have no CloseWrite: net/http would close them with a reset")
	}
	if err := cw.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := client.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the client read %v after the server's CloseWrite, want EOF", err)
	}
	if _, err := io.WriteString(client, "still writing"); err != nil {
		t.Fatalf("the client cannot write after a half close: %v", err)
	}
	buf := make([]byte, 13)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "still writing" {
		t.Fatalf("the server read %q, %v after its half close", buf, err)
	}
}

// TestReadyzDoesNotShowTheStoreError: the admin port is open to the
// cluster network, and a store's error names its addresses (and, for
// some, users): /readyz says whether the store answers, not why not.
func TestReadyzDoesNotShowTheStoreError(t *testing.T) {
	s, err := New(Options{Upstream: "http://127.0.0.1:1", LogLevel: "error",
		Store: storeopen.Options{Kind: "redis", RedisAddrs: "127.0.0.1:1", RedisKeyPrefix: "idemcp:t:"}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.store.Close() }()
	srv := httptest.NewServer(s.AdminHandler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), "store=unreachable") {
		t.Fatalf("/readyz with the store down: %d %q, want 200 saying the store is unreachable", resp.StatusCode, body)
	}
	if strings.Contains(string(body), "127.0.0.1:1") || strings.Contains(string(body), "dial") {
		t.Fatalf("/readyz shows the store's error: %q", body)
	}
}

// TestUpstreamPasswordStaysOut: a password in --upstream goes to the
// server as basic auth, and nowhere else: not into an error, and not into
// what keys the store's records (a new password must not move them, or a
// retry after the restart runs its call again).
func TestUpstreamPasswordStaysOut(t *testing.T) {
	var prefixes []string
	for _, pw := range []string{"secret", "rotated"} {
		s, err := New(Options{Upstream: "http://u:" + pw + "@127.0.0.1:1/mcp", LogLevel: "error", Store: storeopen.Options{Kind: "memory"}})
		if err != nil {
			t.Fatal(err)
		}
		prefixes = append(prefixes, s.opts.Store.Upstream)
	}
	if prefixes[0] != prefixes[1] || prefixes[0] != "http://127.0.0.1:1/mcp" {
		t.Fatalf("the store's keys follow %q and %q, want the server's URL without its credentials, the same for both", prefixes[0], prefixes[1])
	}
	_, err := New(Options{Upstream: "ftp://u:secret@127.0.0.1:1", LogLevel: "error"})
	if err == nil || strings.Contains(err.Error(), "secret") || !strings.Contains(err.Error(), "ftp://u:xxxxx@127.0.0.1:1") {
		t.Fatalf("a bad --upstream: %v, want an error naming it without its password", err)
	}
	if got := redactedURL("http://u:secret@h:1"); got != "http://u:xxxxx@h:1" {
		t.Fatalf("the log's upstream: %q", got)
	}
}
