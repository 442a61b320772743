package httpproxy

// directTransport sends a request to a plain-HTTP upstream from the
// caller's goroutine. net/http's Transport hands every request to two
// goroutines of its connection (one writes, one reads) and back over
// channels: on loopback, where the round trip itself is short, those
// hand-offs and their wake-ups are a large part of a call's CPU. Here the
// request is written and its response read where RoundTrip is called, over
// a pooled keep-alive connection, with net/http's own request writer
// (Request.Write) and response parser (http.ReadResponse), so the bytes on
// the wire are what the Transport would send and read.
//
// What it does not do goes to the Transport: TLS, upgrades, and a request
// body that is not already in memory and small (a server may answer before
// it reads a large body, and the Transport reads that answer while it
// still writes).

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"net/url"
	"sync"
	"sync/atomic"
	"time"
)

// directMaxBody is the largest request body the direct path writes: one
// that fits in a socket's buffer, so writing it never waits for the server
// to read.
const directMaxBody = 64 << 10

type directTransport struct {
	// fallback sends what the direct path does not (see above): transport
	// under noResend.
	fallback  http.RoundTripper
	transport *http.Transport
	dial      func(ctx context.Context, network, addr string) (net.Conn, error)

	maxIdle     int           // idle connections kept per address
	idleTimeout time.Duration // an idle connection older than this is closed
	maxHeader   int64         // bytes a response's header may take

	mu       sync.Mutex
	idle     map[string][]*directConn // per address, the most recently used last
	sweep    *time.Timer              // runs closeStale while sweeping
	sweeping bool                     // some connection is idle: sweep is set
}

func newDirectTransport(t *http.Transport) *directTransport {
	d := &directTransport{
		fallback:    noResend{next: t},
		transport:   t,
		dial:        t.DialContext,
		maxIdle:     t.MaxIdleConnsPerHost,
		idleTimeout: t.IdleConnTimeout,
		maxHeader:   t.MaxResponseHeaderBytes,
		idle:        map[string][]*directConn{},
	}
	if d.dial == nil {
		d.dial = (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	}
	if d.maxIdle <= 0 {
		d.maxIdle = http.DefaultMaxIdleConnsPerHost
	}
	if d.maxHeader <= 0 {
		d.maxHeader = 10 << 20 // the Transport's default
	}
	return d
}

// direct says whether req goes the direct path. An upgrade carries an
// Upgrade header: the proxy's requests lose it with the other hop-by-hop
// fields, except where ReverseProxy passes an upgrade on.
func (d *directTransport) direct(req *http.Request) bool {
	if req.URL == nil || req.URL.Scheme != "http" || req.URL.Host == "" {
		return false
	}
	if _, ok := req.Header["Upgrade"]; ok {
		return false
	}
	if req.Body == nil || req.Body == http.NoBody {
		return true
	}
	return req.ContentLength > 0 && req.ContentLength <= directMaxBody
}

func (d *directTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if !d.direct(req) {
		return d.fallback.RoundTrip(req)
	}
	ctx := req.Context()
	if err := ctx.Err(); err != nil {
		closeBody(req)
		return nil, context.Cause(ctx)
	}
	addr := canonicalAddr(req.URL)
	c, err := d.get(ctx, addr)
	if err != nil {
		closeBody(req)
		return nil, err
	}
	// Canceling the request, at any point until its response body is
	// done, closes the connection: a read or write that waits on it ends.
	stop := context.AfterFunc(ctx, func() { _ = c.conn.Close() })
	resp, err := c.roundTrip(req, d.maxHeader)
	if err != nil {
		stop()
		_ = c.conn.Close()
		if ctx.Err() != nil {
			err = context.Cause(ctx)
		}
		return nil, err
	}
	keep := !resp.Close && !req.Close
	b := &directBody{body: resp.Body, c: c, t: d, ctx: ctx, stop: stop, keep: keep}
	if resp.Body == http.NoBody {
		// Nothing to read: the connection is free now.
		b.finish(true)
		return resp, nil
	}
	resp.Body = b
	return resp, nil
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// canonicalAddr is the host:port to dial for u, an http URL, as
// UpstreamDialer expects it: port 80 when u names none. (The Transport
// also turns a host name that is not ASCII into its punycode; neither
// this nor UpstreamDialer does.)
func canonicalAddr(u *url.URL) string {
	port := u.Port()
	if port == "" {
		port = "80"
	}
	return net.JoinHostPort(u.Hostname(), port)
}

// get returns an idle connection to addr that the server has not closed,
// or a new one.
func (d *directTransport) get(ctx context.Context, addr string) (*directConn, error) {
	now := time.Now()
	for {
		d.mu.Lock()
		conns := d.idle[addr]
		if len(conns) == 0 {
			d.mu.Unlock()
			break
		}
		c := conns[len(conns)-1]
		conns[len(conns)-1] = nil
		d.idle[addr] = conns[:len(conns)-1]
		d.mu.Unlock()
		if d.stale(c, now) {
			_ = c.conn.Close()
			continue
		}
		return c, nil
	}
	conn, err := d.dial(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	c := &directConn{conn: conn, addr: addr}
	c.br = bufio.NewReaderSize(c, 4<<10)
	c.bw = bufio.NewWriterSize(conn, 4<<10)
	return c, nil
}

// stale says an idle connection must not carry another request: idle for
// longer than the idle timeout, or closed (or written to) by its server.
func (d *directTransport) stale(c *directConn, now time.Time) bool {
	return d.idleTimeout > 0 && now.Sub(c.idleSince) >= d.idleTimeout || !c.usable()
}

// put keeps c for the next request to its address, or closes it.
func (d *directTransport) put(c *directConn) {
	if c.br.Buffered() > 0 || !canPeek {
		// Bytes past the response: not a connection to reuse.
		_ = c.conn.Close()
		return
	}
	d.mu.Lock()
	conns := d.idle[c.addr]
	if len(conns) >= d.maxIdle {
		d.mu.Unlock()
		_ = c.conn.Close()
		return
	}
	c.idleSince = time.Now()
	d.idle[c.addr] = append(conns, c)
	if !d.sweeping {
		d.sweeping = true
		if d.sweep == nil {
			d.sweep = time.AfterFunc(d.sweepEvery(), d.closeStale)
		} else {
			d.sweep.Reset(d.sweepEvery())
		}
	}
	d.mu.Unlock()
}

// sweepEvery is how often idle connections are checked: those idle too
// long, and those their server closed (a Node.js server closes an idle
// one after 5 seconds), are closed rather than kept half-open.
func (d *directTransport) sweepEvery() time.Duration {
	if d.idleTimeout > 0 {
		return min(d.idleTimeout, directSweep)
	}
	return directSweep
}

// directSweep bounds how long a connection the server closed stays open
// on the sidecar's side while idle.
const directSweep = 5 * time.Second

// closeStale closes the idle connections that stayed idle too long or
// that their server closed, and comes back while any stays idle.
func (d *directTransport) closeStale() {
	now := time.Now()
	var stale []*directConn
	d.mu.Lock()
	for addr, conns := range d.idle {
		keep := conns[:0]
		for _, c := range conns {
			if d.stale(c, now) {
				stale = append(stale, c)
			} else {
				keep = append(keep, c)
			}
		}
		clear(conns[len(keep):])
		if len(keep) == 0 {
			delete(d.idle, addr)
		} else {
			d.idle[addr] = keep
		}
	}
	d.sweeping = len(d.idle) > 0
	if d.sweeping {
		d.sweep.Reset(d.sweepEvery())
	}
	d.mu.Unlock()
	for _, c := range stale {
		_ = c.conn.Close()
	}
}

// CloseIdleConnections closes the idle connections of both paths.
func (d *directTransport) CloseIdleConnections() {
	d.mu.Lock()
	idle := d.idle
	d.idle = map[string][]*directConn{}
	if d.sweep != nil {
		d.sweep.Stop()
	}
	d.sweeping = false
	d.mu.Unlock()
	for _, conns := range idle {
		for _, c := range conns {
			_ = c.conn.Close()
		}
	}
	d.transport.CloseIdleConnections()
}

// directConn is one connection to the upstream, its reader limited while
// a response header is read.
type directConn struct {
	conn      net.Conn
	addr      string        // what was dialed: its key in the pool
	br        *bufio.Reader // reads c (below), not conn
	bw        *bufio.Writer
	limited   bool
	left      int64 // while limited, bytes the header may still take
	idleSince time.Time
}

var errHeaderTooLarge = errors.New("the server's response header is too large")

// Read is the connection's, within the header limit while one is set.
func (c *directConn) Read(p []byte) (int, error) {
	if !c.limited {
		return c.conn.Read(p)
	}
	if c.left <= 0 {
		return 0, errHeaderTooLarge
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.conn.Read(p)
	c.left -= int64(n)
	return n, err
}

func (c *directConn) roundTrip(req *http.Request, maxHeader int64) (*http.Response, error) {
	if err := req.Write(c.bw); err != nil {
		return nil, err
	}
	if err := c.bw.Flush(); err != nil {
		return nil, err
	}
	// As the Transport reads a response: informational ones (100
	// Continue, 102 Processing, 103 Early Hints) are skipped, or given to
	// the request's httptrace (ReverseProxy relays them to its client),
	// and together with the real one bounded by maxHeader unless they were
	// given on. A 101 ends the response, as with the Transport, and its
	// body is what follows on the connection, which is not reused; but
	// that body cannot be written to, as the Transport's can: a request
	// here never asks for an upgrade, so a 101 is the server's fault, and
	// ReverseProxy answers it with a 502 rather than a tunnel.
	c.limited, c.left = true, maxHeader
	defer func() { c.limited = false }()
	trace := httptrace.ContextClientTrace(req.Context())
	for {
		resp, err := http.ReadResponse(c.br, req)
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = fmt.Errorf("the server closed the connection before it answered: %w", io.ErrUnexpectedEOF)
			}
			return nil, err
		}
		switch code := resp.StatusCode; {
		case code == http.StatusSwitchingProtocols:
			resp.Body = io.NopCloser(c.br)
			resp.Close = true
			return resp, nil
		case code >= 100 && code <= 199:
			if trace != nil && trace.Got1xxResponse != nil {
				if err := trace.Got1xxResponse(code, textproto.MIMEHeader(resp.Header)); err != nil {
					return nil, err
				}
				c.left = maxHeader
			}
		default:
			return resp, nil
		}
	}
}

// directBody is a response's body: once read to its end, its connection
// goes back to the pool; closed before that, or on a response that ends
// the connection, the connection is closed.
type directBody struct {
	body io.ReadCloser
	c    *directConn
	t    *directTransport
	ctx  context.Context
	stop func() bool
	keep bool
	done atomic.Bool // the connection was put back or closed
}

func (b *directBody) Read(p []byte) (int, error) {
	n, err := b.body.Read(p)
	switch {
	case errors.Is(err, io.EOF):
		b.finish(true)
	case err != nil && b.ctx.Err() != nil:
		err = context.Cause(b.ctx)
	}
	return n, err
}

func (b *directBody) Close() error {
	b.finish(false)
	return nil
}

// finish releases the connection once: back to the pool when the body was
// read to its end (eof) and the response lets it be reused.
func (b *directBody) finish(eof bool) {
	if !b.done.CompareAndSwap(false, true) {
		return
	}
	// A cancel that already closed the connection keeps it from the pool.
	if b.stop() && eof && b.keep {
		b.t.put(b.c)
		return
	}
	_ = b.c.conn.Close()
}
