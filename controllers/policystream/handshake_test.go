package policystream

import (
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/go-logr/logr"
)

// TestHandshakeListener: Accept hands over connections whose handshake is
// done, a client that never completes one is cut off after the timeout
// without reaching Accept, and Close ends Accept.
func TestHandshakeListener(t *testing.T) {
	ts := httptest.NewTLSServer(http.NotFoundHandler())
	serverConfig := &tls.Config{Certificates: ts.TLS.Certificates}
	clientConfig := ts.Client().Transport.(*http.Transport).TLSClientConfig.Clone()
	ts.Close()

	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := newHandshakeListener(inner, serverConfig, 300*time.Millisecond, logr.Discard())
	accepted := make(chan net.Conn, 2)
	acceptErr := make(chan error, 1)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				acceptErr <- err
				return
			}
			accepted <- c
		}
	}()

	silent, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = silent.Close() }()
	client, err := tls.Dial("tcp", inner.Addr().String(), clientConfig)
	if err != nil {
		t.Fatalf("handshake: %v", err)
	}
	defer func() { _ = client.Close() }()

	select {
	case c := <-accepted:
		tc, ok := c.(*tls.Conn)
		if !ok || !tc.ConnectionState().HandshakeComplete {
			t.Fatalf("Accept returned %T without a completed handshake", c)
		}
		_ = c.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("the TLS client's connection was not accepted")
	}
	_ = silent.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := silent.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the silent connection was not closed after the handshake timeout: %v", err)
	}
	select {
	case c := <-accepted:
		t.Fatalf("Accept returned the connection that never completed a handshake (%s)", c.RemoteAddr())
	default:
	}

	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-acceptErr:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Accept after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Accept did not return after Close")
	}
}

// TestHandshakeListenerCloseEndsHandshakes: a connection still in its
// handshake when the listener closes is closed then, not a timeout later
// (the manager's shutdown leaves no socket behind).
func TestHandshakeListenerCloseEndsHandshakes(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewTLSServer(http.NotFoundHandler())
	serverConfig := &tls.Config{Certificates: ts.TLS.Certificates}
	ts.Close()
	l := newHandshakeListener(inner, serverConfig, time.Minute, logr.Discard())
	silent, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = silent.Close() }()
	// The first byte of a ClientHello's record: the server is now in the
	// handshake, waiting for the rest.
	if _, err := silent.Write([]byte{0x16}); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	_ = silent.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := silent.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a connection in its handshake outlived the listener's Close: %v", err)
	}
}
