package policystream

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"time"

	"github.com/go-logr/logr"
)

// handshakeListener hands net/http connections whose TLS handshake is
// done, each on a goroutine that ends with it. net/http would run the
// handshake on the goroutine that then serves the connection for as long
// as the sidecar holds it, and a goroutine's stack keeps the size its
// deepest call needed while the rest stays in use: the handshake (ECDSA,
// X25519MLKEM768) grew it to 16 KiB, where serving needs 8.
type handshakeListener struct {
	inner   net.Listener
	config  *tls.Config
	timeout time.Duration
	logger  logr.Logger

	ready chan net.Conn
	errs  chan error
	// done ends with Close: the handshakes in progress end with it, as
	// http.Server's did with its own listener's close.
	done      context.Context
	closeDone context.CancelFunc
}

func newHandshakeListener(inner net.Listener, config *tls.Config, timeout time.Duration, logger logr.Logger) *handshakeListener {
	l := &handshakeListener{inner: inner, config: config, timeout: timeout, logger: logger,
		ready: make(chan net.Conn), errs: make(chan error)}
	l.done, l.closeDone = context.WithCancel(context.Background())
	go l.accept()
	return l
}

// accept takes connections from inner. An error waits for Accept to
// return it, so that http.Server's backoff on a temporary one holds.
func (l *handshakeListener) accept() {
	for {
		c, err := l.inner.Accept()
		if err != nil {
			select {
			case l.errs <- err:
			case <-l.done.Done():
				return
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		go l.handshake(c)
	}
}

// handshake bounds the handshake as http.Server does (its
// ReadHeaderTimeout, for both directions, as the connection's deadline),
// and ends it when the listener closes. A failed one is the caller's
// trouble (a sidecar that gave up, a scanner), which http.Server logged
// on its error log: here at V(1).
func (l *handshakeListener) handshake(c net.Conn) {
	tc := tls.Server(c, l.config)
	_ = c.SetDeadline(time.Now().Add(l.timeout))
	if err := tc.HandshakeContext(l.done); err != nil {
		if l.done.Err() == nil {
			l.logger.V(1).Info("TLS handshake failed", "remote", c.RemoteAddr().String(), "err", err.Error())
		}
		_ = c.Close()
		return
	}
	_ = c.SetDeadline(time.Time{})
	select {
	case l.ready <- tc:
	case <-l.done.Done():
		_ = c.Close()
	}
}

func (l *handshakeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ready:
		return c, nil
	case err := <-l.errs:
		return nil, err
	case <-l.done.Done():
		return nil, net.ErrClosed
	}
}

func (l *handshakeListener) Close() error {
	l.closeDone()
	return l.inner.Close()
}

func (l *handshakeListener) Addr() net.Addr { return l.inner.Addr() }
