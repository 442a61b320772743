package sidecar

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The admin port (probes and metrics) is reachable from every pod in the
// cluster (the webhook binds it on all interfaces, for the kubelet and the
// scrapers), so it holds little for anybody: its few clients need a
// handful of short requests at once.
const (
	adminReadHeaderTimeout = 5 * time.Second
	adminReadTimeout       = 10 * time.Second
	adminWriteTimeout      = 15 * time.Second
	adminIdleTimeout       = 10 * time.Second
	adminMaxHeaderBytes    = 16 << 10
	// adminMaxConns bounds the admin connections held at once, and
	// adminMaxConnsPerClient those of one IP address: one pod holding
	// connections open takes at most 16, and cannot alone keep out the
	// kubelet's probes (from the node's address). Several pods together
	// can still hold all 128, and then HTTP probes get 503: that is why
	// the webhook makes the liveness probe a TCP connect (a connection
	// accepted and answered 503 is alive), so the sidecar is not
	// restarted and the calls it runs do not become "outcome unknown";
	// readiness may fail meanwhile, which takes the pod out of its
	// Service's endpoints, not its calls.
	adminMaxConns          = 128
	adminMaxConnsPerClient = 16
)

// proxyReadHeaderTimeout bounds how long a connection to the proxy may
// take to send a request's headers, from its first byte or, for a new
// connection, from its accept: an idle or slow (slowloris) connection is
// closed then. Response streams are not bounded (no write timeout): SSE
// streams last as long as their sessions.
const proxyReadHeaderTimeout = 10 * time.Second

// connMetrics count, per listener, the connections held and those turned
// away at a bound.
type connMetrics struct {
	open    *prometheus.GaugeVec
	refused *prometheus.CounterVec
}

func newConnMetrics(reg prometheus.Registerer) *connMetrics {
	m := &connMetrics{
		open: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idemcp_open_connections",
			Help: "Client connections the sidecar holds open, by listener (proxy, admin).",
		}, []string{"listener"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idemcp_connections_refused_total",
			Help: "Client connections closed at accept because a bound was reached, by listener (proxy, admin) and bound (total, per_client).",
		}, []string{"listener", "bound"}),
	}
	reg.MustRegister(m.open, m.refused)
	return m
}

// limitListener bounds the connections it hands out: at most total at
// once, and at most perClient from one IP address (<= 0: no such bound).
// A connection over a bound is answered 503 and closed at once rather than
// left waiting in the accept queue, so that what it costs is one accept,
// and a client that waits for a slot is told why.
type limitListener struct {
	net.Listener
	name      string
	total     int
	perClient int
	open      prometheus.Gauge
	refusedT  prometheus.Counter
	refusedC  prometheus.Counter

	mu       sync.Mutex
	n        int
	byClient map[netip.Addr]int
}

func newLimitListener(l net.Listener, name string, total, perClient int, m *connMetrics) *limitListener {
	return &limitListener{
		Listener: l, name: name, total: total, perClient: perClient,
		open:     m.open.WithLabelValues(name),
		refusedT: m.refused.WithLabelValues(name, "total"),
		refusedC: m.refused.WithLabelValues(name, "per_client"),
		byClient: map[netip.Addr]int{},
	}
}

// refusal is written to a connection turned away: a plain HTTP/1.1 answer
// fits the socket's empty send buffer, so writing it never blocks.
var refusal = func() []byte {
	const body = "the idemcp sidecar holds its limit of connections; retry later\n"
	return fmt.Appendf(nil, "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"+
		"Content-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}()

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		client := clientAddr(c)
		l.mu.Lock()
		over := l.total > 0 && l.n >= l.total
		overClient := !over && l.perClient > 0 && l.byClient[client] >= l.perClient
		if !over && !overClient {
			l.n++
			l.byClient[client]++
		}
		l.mu.Unlock()
		switch {
		case over:
			l.refusedT.Inc()
		case overClient:
			l.refusedC.Inc()
		default:
			l.open.Inc()
			return &limitConn{Conn: c, release: sync.OnceFunc(func() { l.release(client) })}, nil
		}
		_ = c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
		_, _ = c.Write(refusal)
		_ = c.Close()
	}
}

func (l *limitListener) release(client netip.Addr) {
	l.mu.Lock()
	l.n--
	if l.byClient[client]--; l.byClient[client] <= 0 {
		delete(l.byClient, client)
	}
	l.mu.Unlock()
	l.open.Dec()
}

func clientAddr(c net.Conn) netip.Addr {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

type limitConn struct {
	net.Conn
	release func()
}

// CloseWrite keeps the half close of the connection underneath: net/http
// closes a connection whose request body it did not read by shutting its
// write side first, so that the client reads the answer before a reset.
func (c *limitConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.release()
	return err
}

// adminServer is the admin port's server: every phase of a request is
// bounded, as no probe or scrape needs long.
func adminServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: adminReadHeaderTimeout,
		ReadTimeout:       adminReadTimeout,
		WriteTimeout:      adminWriteTimeout,
		IdleTimeout:       adminIdleTimeout,
		MaxHeaderBytes:    adminMaxHeaderBytes,
	}
}
