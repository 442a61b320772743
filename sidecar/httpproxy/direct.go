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
	"strings"
	"sync"
	"time"
)

// directMaxBody is the largest request body the direct path writes: one
// that fits in a socket's buffer, so writing it never waits for the server
// to read.
const directMaxBody = 64 << 10

// directMax1xx is how many informational responses (100 Continue, 103
// Early Hints) may come before the real one, as net/http's Transport
// allows.
const directMax1xx = 5

type directTransport struct {
	// fallback sends what the direct path does not (see above), over
	// transport.
	fallback  http.RoundTripper
	transport *http.Transport
	dial      func(ctx context.Context, network, addr string) (net.Conn, error)

	maxIdle     int           // idle connections kept per address
	idleTimeout time.Duration // an idle connection older than this is closed
	maxHeader   int64         // bytes a response's header may take

	mu    sync.Mutex
	idle  map[string][]*directConn // per address, the most recently used last
	sweep *time.Timer              // closes what stayed idle too long; nil while nothing is idle
}

func newDirectTransport(fallback http.RoundTripper, t *http.Transport) *directTransport {
	d := &directTransport{
		fallback:    fallback,
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
		d.maxHeader = 1 << 20 // net/http's default
	}
	return d
}

// direct says whether req goes the direct path.
func (d *directTransport) direct(req *http.Request) bool {
	if req.URL == nil || req.URL.Scheme != "http" || req.URL.Host == "" {
		return false
	}
	if _, ok := req.Header["Upgrade"]; ok {
		return false
	}
	for _, v := range req.Header["Connection"] {
		if strings.Contains(strings.ToLower(v), "upgrade") {
			return false
		}
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
	addr := canonicalAddr(req.URL.Host)
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
	b := &directBody{body: resp.Body, c: c, t: d, addr: addr, ctx: ctx, stop: stop, keep: keep}
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

// canonicalAddr is host:port with the scheme's default port (http's).
func canonicalAddr(host string) string {
	if _, _, err := net.SplitHostPort(host); err == nil {
		return host
	}
	return net.JoinHostPort(strings.TrimSuffix(strings.TrimPrefix(host, "["), "]"), "80")
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
		if d.idleTimeout > 0 && now.Sub(c.idleSince) > d.idleTimeout || !c.usable() {
			_ = c.conn.Close()
			continue
		}
		return c, nil
	}
	conn, err := d.dial(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	c := &directConn{conn: conn}
	c.br = bufio.NewReaderSize(c, 4<<10)
	c.bw = bufio.NewWriterSize(conn, 4<<10)
	return c, nil
}

// put keeps c for the next request to addr, or closes it.
func (d *directTransport) put(addr string, c *directConn) {
	if c.br.Buffered() > 0 {
		// Bytes past the response: not a connection to reuse.
		_ = c.conn.Close()
		return
	}
	c.idleSince = time.Now()
	d.mu.Lock()
	conns := d.idle[addr]
	if len(conns) >= d.maxIdle {
		d.mu.Unlock()
		_ = c.conn.Close()
		return
	}
	d.idle[addr] = append(conns, c)
	if d.sweep == nil && d.idleTimeout > 0 {
		d.sweep = time.AfterFunc(d.idleTimeout, d.closeStale)
	}
	d.mu.Unlock()
}

// closeStale closes the connections idle for longer than the idle timeout
// (the oldest are first), a server's closed ones among them, and comes
// back while any stays idle.
func (d *directTransport) closeStale() {
	now := time.Now()
	var stale []*directConn
	d.mu.Lock()
	for addr, conns := range d.idle {
		n := 0
		for n < len(conns) && now.Sub(conns[n].idleSince) >= d.idleTimeout {
			n++
		}
		stale = append(stale, conns[:n]...)
		if n == len(conns) {
			delete(d.idle, addr)
		} else if n > 0 {
			d.idle[addr] = append(conns[:0], conns[n:]...)
		}
	}
	d.sweep = nil
	if len(d.idle) > 0 {
		d.sweep = time.AfterFunc(d.idleTimeout, d.closeStale)
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
		d.sweep = nil
	}
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
	c.limited, c.left = true, maxHeader
	defer func() { c.limited = false }()
	for range directMax1xx + 1 {
		resp, err := http.ReadResponse(c.br, req)
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = fmt.Errorf("the server closed the connection before it answered: %w", io.ErrUnexpectedEOF)
			}
			return nil, err
		}
		if resp.StatusCode < 100 || resp.StatusCode > 199 {
			return resp, nil
		}
		if resp.StatusCode == http.StatusSwitchingProtocols {
			return nil, errors.New("the server switched protocols on a request that asked for no upgrade")
		}
	}
	return nil, fmt.Errorf("the server sent more than %d informational (1xx) responses", directMax1xx)
}

// directBody is a response's body: once read to its end, its connection
// goes back to the pool; closed before that, or on a response that ends
// the connection, the connection is closed.
type directBody struct {
	body io.ReadCloser
	c    *directConn
	t    *directTransport
	addr string
	ctx  context.Context
	stop func() bool
	keep bool

	mu   sync.Mutex
	done bool // the connection was put back or closed
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
	b.mu.Lock()
	if b.done {
		b.mu.Unlock()
		return
	}
	b.done = true
	b.mu.Unlock()
	// A cancel that already closed the connection keeps it from the pool.
	if b.stop() && eof && b.keep {
		b.t.put(b.addr, b.c)
		return
	}
	_ = b.c.conn.Close()
}
