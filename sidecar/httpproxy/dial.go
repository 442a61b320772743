package httpproxy

// Which address the sidecar connects to, to reach the MCP server in its pod.
//
// MCP SDKs guard against DNS rebinding: the Go SDK answers 403 to a request
// that arrives on a loopback address with a Host that is not loopback, and
// the TypeScript and Python SDKs check Host when bound to localhost. The
// sidecar keeps the client's Host (the Service's name), so over loopback an
// unmodified server refuses every request. Like Istio's inbound since 1.10,
// the sidecar connects to the server at the pod's own IP instead: the
// server sees a request to its pod IP, with the Host its clients use. A
// server that listens only on loopback refuses that connection, and the
// sidecar falls back to the loopback address of --upstream. A connect that
// failed (refused, or not answered within earlyDialTimeout) carried
// nothing, so no call can run twice; once a connection is made, nothing
// sent on it is ever sent to another address.

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// Dialer timings.
const (
	// DialRecheck is how often a dialer that fell back to a later address
	// tries the earlier ones again, so that a server that starts to listen
	// on the pod IP is reached there.
	DialRecheck = 30 * time.Second
	// earlyDialTimeout bounds a connect to an address that is not the
	// last one tried. A connect to the pod's own address is answered by
	// the kernel at once; this only guards against one that is dropped.
	earlyDialTimeout = time.Second
)

// UpstreamDialer connects to the upstream's port at its alternative
// addresses first (the pod's IPs), then at the host of the upstream URL.
// It remembers the address that answered after the earlier ones refused,
// so that the hot path makes one connect; on a failure there, or every
// DialRecheck, it tries the others.
type UpstreamDialer struct {
	// addr is the upstream URL's host:port, as the transport asks for it;
	// addrs are the addresses to try, addr last.
	addr  string
	addrs []string
	dial  func(ctx context.Context, network, addr string) (net.Conn, error)
	log   *slog.Logger
	now   func() time.Time

	best    atomic.Int32 // index in addrs of the address that answered last
	recheck atomic.Int64 // when (Unix nanoseconds) to try addrs from the first again
}

// NewUpstreamDialer returns a dialer for upstream that tries ips (the
// pod's IPs, primary first) at upstream's port before upstream's own host.
// With no ips it dials as net.Dialer does. log may be nil.
func NewUpstreamDialer(upstream *url.URL, ips []netip.Addr, log *slog.Logger) *UpstreamDialer {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	port := upstream.Port()
	if port == "" {
		port = "80"
		if upstream.Scheme == "https" {
			port = "443"
		}
	}
	d := &UpstreamDialer{
		addr: net.JoinHostPort(upstream.Hostname(), port),
		dial: (&net.Dialer{}).DialContext,
		log:  log,
		now:  time.Now,
	}
	for _, ip := range ips {
		if s := net.JoinHostPort(ip.String(), port); ip.IsValid() && s != d.addr && !slices.Contains(d.addrs, s) {
			d.addrs = append(d.addrs, s)
		}
	}
	d.addrs = append(d.addrs, d.addr)
	return d
}

// Addrs returns the addresses the dialer tries, in order: the alternative
// ones, then the upstream URL's.
func (d *UpstreamDialer) Addrs() []string { return append([]string(nil), d.addrs...) }

// isUpstream reports whether hostport (from a URL's Host) is one of the
// addresses that reach the upstream.
func (d *UpstreamDialer) isUpstream(hostport string) bool {
	want, err := netip.ParseAddrPort(hostport)
	if err != nil {
		return false
	}
	for _, a := range d.addrs {
		if got, err := netip.ParseAddrPort(a); err == nil && got == want {
			return true
		}
	}
	return false
}

// DialContext is an http.Transport's DialContext.
func (d *UpstreamDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	if addr != d.addr || len(d.addrs) == 1 {
		return d.dial(ctx, network, addr)
	}
	best := int(d.best.Load())
	start := best
	if best > 0 {
		// One dial at a time looks again at the addresses before the one
		// that answered last.
		now := d.now().UnixNano()
		if at := d.recheck.Load(); now >= at && d.recheck.CompareAndSwap(at, now+int64(DialRecheck)) {
			start = 0
		}
	}
	var errs dialErrors
	refused := true // every address tried before this one refused
	for n := range d.addrs {
		i := (start + n) % len(d.addrs)
		c, err := d.dialOne(ctx, network, d.addrs[i], n == len(d.addrs)-1)
		if err == nil {
			// Only a refusal says nothing listens there. A connect not
			// answered in time (a listener whose accept queue is full
			// drops SYNs) falls back for this connection only: the
			// address that answered last stays the first one tried.
			if i != best && (i < best || refused) {
				d.switchTo(i, best)
			}
			return c, nil
		}
		refused = refused && errors.Is(err, syscall.ECONNREFUSED)
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, errs
}

func (d *UpstreamDialer) dialOne(ctx context.Context, network, addr string, last bool) (net.Conn, error) {
	if last {
		return d.dial(ctx, network, addr)
	}
	ctx, cancel := context.WithTimeout(ctx, earlyDialTimeout)
	defer cancel()
	return d.dial(ctx, network, addr)
}

// switchTo makes addrs[i] the first address tried, and says so: a server
// reached at its loopback address may refuse requests whose Host is not
// loopback.
func (d *UpstreamDialer) switchTo(i, was int) {
	if i > 0 {
		d.recheck.Store(d.now().Add(DialRecheck).UnixNano())
	}
	if d.best.CompareAndSwap(int32(was), int32(i)) { //nolint:gosec // a handful of addresses
		if i == len(d.addrs)-1 {
			// An SDK's DNS rebinding protection may then refuse every
			// request that keeps a Service's Host: worth a line in the log.
			d.log.Info("Reaching the MCP server at the upstream URL's address: nothing listens on its port at the pod's IP",
				"addr", d.addrs[i], "tried", strings.Join(d.addrs[:i], ","))
		} else {
			d.log.Info("Reaching the MCP server at the pod's IP", "addr", d.addrs[i])
		}
	}
}

// dialErrors are the failed connects of one dial, in the order tried.
type dialErrors []error

func (e dialErrors) Error() string {
	s := make([]string, len(e))
	for i, err := range e {
		s[i] = err.Error()
	}
	return strings.Join(s, "; ")
}

func (e dialErrors) Unwrap() []error { return e }
