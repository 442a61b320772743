package httpproxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/internal/store"
)

// Tests may only reach loopback, so 127.0.0.2 plays the pod's IP: another
// address of the same host, where a server may or may not listen.
var podIP = netip.MustParseAddr("127.0.0.2")

// freePortOn returns a port free on every one of hosts.
func freePortOn(t *testing.T, hosts ...string) int {
	t.Helper()
	for range 20 {
		p := freeport.LoopbackPort(t)
		ok := true
		for _, h := range hosts {
			l, err := net.Listen("tcp", net.JoinHostPort(h, strconv.Itoa(p)))
			if err != nil {
				ok = false
				break
			}
			_ = l.Close()
		}
		if ok {
			return p
		}
	}
	t.Fatalf("no port free on %v", hosts)
	return 0
}

func listenAt(t *testing.T, host string, port int) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// acceptInto accepts connections on l until it is closed, and sends each
// one's local address.
func acceptInto(l net.Listener, got chan<- string) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		got <- c.LocalAddr().String()
		_ = c.Close()
	}
}

func dialOnce(t *testing.T, d *UpstreamDialer, addr string) (string, error) {
	t.Helper()
	c, err := d.DialContext(t.Context(), "tcp", addr)
	if err != nil {
		return "", err
	}
	defer func() { _ = c.Close() }()
	return c.RemoteAddr().String(), nil
}

// TestDialerFallsBackToLoopbackAndRechecks: a server that listens only on
// loopback is reached there, and the dialer stays with loopback until the
// recheck; one that starts to listen on the pod IP is reached there after
// it, and when it goes away again the next connection falls back at once.
func TestDialerFallsBackToLoopbackAndRechecks(t *testing.T) {
	port := freePortOn(t, "127.0.0.1", "127.0.0.2")
	loop, pod := net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), net.JoinHostPort("127.0.0.2", strconv.Itoa(port))
	loopSeen := make(chan string, 16)
	go acceptInto(listenAt(t, "127.0.0.1", port), loopSeen)

	up, _ := url.Parse("http://" + loop)
	d := NewUpstreamDialer(up, []netip.Addr{podIP}, nil)
	now := time.Now()
	d.now = func() time.Time { return now }
	if got := d.Addrs(); strings.Join(got, ",") != pod+","+loop {
		t.Fatalf("addresses %v, want the pod IP then the upstream URL's", got)
	}

	for i := range 2 {
		if got, err := dialOnce(t, d, loop); err != nil || got != loop {
			t.Fatalf("dial %d: connected to %q (%v), want the loopback server at %s", i, got, err, loop)
		}
		<-loopSeen
	}

	// A server now listens on the pod IP too. Until the recheck the
	// dialer goes on with loopback, which answers.
	podSeen := make(chan string, 16)
	podLn := listenAt(t, "127.0.0.2", port)
	go acceptInto(podLn, podSeen)
	if got, err := dialOnce(t, d, loop); err != nil || got != loop {
		t.Fatalf("before the recheck: connected to %q (%v), want loopback %s", got, err, loop)
	}
	<-loopSeen
	now = now.Add(DialRecheck)
	for i := range 2 {
		if got, err := dialOnce(t, d, loop); err != nil || got != pod {
			t.Fatalf("after the recheck, dial %d: connected to %q (%v), want the pod IP %s", i, got, err, pod)
		}
		<-podSeen
	}

	// The pod IP stops answering: the next dial falls back, no recheck
	// needed.
	_ = podLn.Close()
	if got, err := dialOnce(t, d, loop); err != nil || got != loop {
		t.Fatalf("after the pod IP's server left: connected to %q (%v), want loopback %s", got, err, loop)
	}
	<-loopSeen
	select {
	case a := <-podSeen:
		t.Errorf("a connection reached %s after its listener closed", a)
	default:
	}
}

// TestDialerReportsEveryAddressTried: with nothing listening, the error
// names each address, pod IP first, and is a connection refused.
func TestDialerReportsEveryAddressTried(t *testing.T) {
	port := freePortOn(t, "127.0.0.1", "127.0.0.2")
	loop := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	up, _ := url.Parse("http://" + loop)
	d := NewUpstreamDialer(up, []netip.Addr{podIP}, nil)
	_, err := dialOnce(t, d, loop)
	if err == nil {
		t.Fatal("dial succeeded with nothing listening")
	}
	msg := err.Error()
	if i, j := strings.Index(msg, "127.0.0.2:"), strings.Index(msg, loop); i < 0 || j < i || !strings.Contains(msg, "connection refused") {
		t.Errorf("error %q: want the pod IP's refusal, then the upstream URL's", msg)
	}
}

func TestDialerAddresses(t *testing.T) {
	for _, tc := range []struct {
		upstream string
		ips      []string
		want     string
	}{
		{"http://127.0.0.1:8080", nil, "127.0.0.1:8080"},
		{"http://127.0.0.1:8080/mcp", []string{"10.1.2.3"}, "10.1.2.3:8080,127.0.0.1:8080"},
		// Dual stack: status.podIPs lists the primary first, then the
		// other family; IPv6 takes brackets.
		{"http://127.0.0.1:8080", []string{"fd00::3", "10.1.2.3"}, "[fd00::3]:8080,10.1.2.3:8080,127.0.0.1:8080"},
		{"https://127.0.0.1", []string{"10.1.2.3", "10.1.2.3", "127.0.0.1"}, "10.1.2.3:443,127.0.0.1:443"},
		{"http://[::1]:9000", []string{"::1", "fd00::3"}, "[fd00::3]:9000,[::1]:9000"},
	} {
		up, _ := url.Parse(tc.upstream)
		var ips []netip.Addr
		for _, s := range tc.ips {
			ips = append(ips, netip.MustParseAddr(s))
		}
		if got := strings.Join(NewUpstreamDialer(up, ips, nil).Addrs(), ","); got != tc.want {
			t.Errorf("%s with %v: addresses %s, want %s", tc.upstream, tc.ips, got, tc.want)
		}
	}
}

// TestLegacyEndpointAtThePodIP: a legacy SSE server that writes its
// endpoint with the address it was reached at (the pod IP) gets its
// clients' POSTs through the sidecar, as with the upstream URL's host.
func TestLegacyEndpointAtThePodIP(t *testing.T) {
	in := httptest.NewRequest(http.MethodGet, "http://mcp.shop.svc/sse", nil)
	up, _ := url.Parse("http://127.0.0.1:9000")
	d := NewUpstreamDialer(up, []netip.Addr{netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("fd00::3")}, nil)
	p := New(Options{Upstream: up, Dialer: d, Engine: engine.New(engine.Options{Store: store.NewMemory(10)})})
	for _, tc := range []struct {
		data, want string
		ours       bool
	}{
		{"http://10.1.2.3:9000/message?s=1", "/message?s=1", true},
		{"http://[fd00::3]:9000/message?s=1", "/message?s=1", true},
		{"http://127.0.0.1:9000/message?s=1", "/message?s=1", true},
		{"http://10.1.2.3:9001/message?s=1", "http://10.1.2.3:9001/message?s=1", false},
		{"http://10.9.9.9:9000/message?s=1", "http://10.9.9.9:9000/message?s=1", false},
	} {
		got, _, ours := p.clientEndpoint(tc.data, in)
		if got != tc.want || ours != tc.ours {
			t.Errorf("endpoint %q: got (%q, %v), want (%q, %v)", tc.data, got, ours, tc.want, tc.ours)
		}
	}
}

// whereServer answers every JSON-RPC request with the address the
// connection was made to and the Host it carried.
func whereServer(t *testing.T, l net.Listener) {
	t.Helper()
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var m struct {
			ID json.RawMessage `json:"id"`
		}
		_ = json.NewDecoder(r.Body).Decode(&m)
		local := r.Context().Value(http.LocalAddrContextKey).(net.Addr).String()
		w.Header().Set("Content-Type", "application/json")
		_, _ = fmt.Fprintf(w, `{"jsonrpc":"2.0","id":%s,"result":{"content":[{"type":"text","text":%q}]}}`, m.ID, local+" "+r.Host)
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
}

// TestProxyReachesTheServerAtThePodIP: deduplicated and passthrough calls
// both reach the server at the pod IP, with the client's Host: what an MCP
// SDK's DNS rebinding protection accepts.
func TestProxyReachesTheServerAtThePodIP(t *testing.T) {
	port := freePortOn(t, "127.0.0.1", "127.0.0.2")
	whereServer(t, listenAt(t, "127.0.0.2", port))
	loopLn := listenAt(t, "127.0.0.1", port)
	whereServer(t, loopLn)
	proxy, e := podIPProxy(t, port)

	for i, body := range []string{
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge_card","arguments":{"amount":5}}}`,
		`{"jsonrpc":"2.0","id":2,"method":"ping"}`,
	} {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, proxy.URL+"/mcp", strings.NewReader(body))
		req.Host = "mcp.shop.svc:80"
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer caller-a")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		want := fmt.Sprintf("127.0.0.2:%d mcp.shop.svc:80", port)
		if !strings.Contains(string(got), want) {
			t.Errorf("request %d: the server answered %s, want it reached at %q", i, got, want)
		}
	}
	drain(t, e)
}

// closingServer reads each request, then closes the connection without
// an answer, counting what it read.
func closingServer(l net.Listener, reads *atomic.Int32) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer func() { _ = c.Close() }()
			if _, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
				reads.Add(1)
			}
		}()
	}
}

// TestCallSentToThePodIPIsNeverSentToLoopback: once a connection to the
// pod IP is made, a failure after the request was sent is the call's
// outcome; the request never goes to the loopback address as well.
func TestCallSentToThePodIPIsNeverSentToLoopback(t *testing.T) {
	port := freePortOn(t, "127.0.0.1", "127.0.0.2")
	var podReads, loopReads atomic.Int32
	go closingServer(listenAt(t, "127.0.0.2", port), &podReads)
	go closingServer(listenAt(t, "127.0.0.1", port), &loopReads)
	proxy, e := podIPProxy(t, port)

	for i, body := range []string{
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge_card","arguments":{"amount":5}}}`,
		`{"jsonrpc":"2.0","id":2,"method":"ping"}`,
	} {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, proxy.URL+"/mcp", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer caller-a")
		req.Header.Set("Idempotency-Key", "key-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			cancel()
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		cancel()
		if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(got), "-32015") {
			t.Errorf("request %d: HTTP %d %s, want 502 with error -32015", i, resp.StatusCode, got)
		}
	}
	drain(t, e)
	if n, m := podReads.Load(), loopReads.Load(); n != 2 || m != 0 {
		t.Errorf("the pod IP's server read %d requests and loopback's %d, want 2 and 0", n, m)
	}
}

// TestDialerStaysWithThePodIPAfterATimeout: a server that listens on every
// address drops SYNs at the pod IP while its accept queue is full (a burst
// of load). That connect times out and this one connection falls back to
// loopback; but the pod IP still listens, so the next connection must try
// it first. Staying with loopback until the recheck would have every request
// of the next 30s reach a server with DNS rebinding protection on loopback
// with a Service's Host: 403 to all of them.
func TestDialerStaysWithThePodIPAfterATimeout(t *testing.T) {
	port := freePortOn(t, "127.0.0.1", "127.0.0.2")
	loop, pod := net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), net.JoinHostPort("127.0.0.2", strconv.Itoa(port))
	loopSeen := make(chan string, 16)
	go acceptInto(listenAt(t, "127.0.0.1", port), loopSeen)

	// The pod IP's listener, with a backlog of 0 and nothing accepting:
	// the kernel queues one connection and drops the SYNs of the next.
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	_ = syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1)
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 2}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	podLn, err := net.FileListener(os.NewFile(uintptr(fd), "pod"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = podLn.Close() })
	filler, err := net.Dial("tcp", pod)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = filler.Close() })

	up, _ := url.Parse("http://" + loop)
	d := NewUpstreamDialer(up, []netip.Addr{podIP}, nil)
	now := time.Now()
	d.now = func() time.Time { return now } // no recheck in this test
	if got, err := dialOnce(t, d, loop); err != nil || got != loop {
		t.Fatalf("with the pod IP's queue full: connected to %q (%v), want loopback %s", got, err, loop)
	}
	<-loopSeen

	// The burst is over: the server accepts again at the pod IP.
	podSeen := make(chan string, 16)
	go acceptInto(podLn, podSeen)
	<-podSeen // the filler
	if got, err := dialOnce(t, d, loop); err != nil || got != pod {
		t.Fatalf("after the burst: connected to %q (%v), want the pod IP %s", got, err, pod)
	}
}

// podIPProxy is a proxy whose upstream is 127.0.0.1:port and whose dialer
// tries the stand-in pod IP first.
func podIPProxy(t *testing.T, port int) (*httptest.Server, *engine.Engine) {
	t.Helper()
	up, _ := url.Parse("http://127.0.0.1:" + strconv.Itoa(port))
	e := engine.New(engine.Options{Store: store.NewMemory(100)})
	proxy := httptest.NewServer(New(Options{Upstream: up, Dialer: NewUpstreamDialer(up, []netip.Addr{podIP}, nil), Engine: e}))
	t.Cleanup(proxy.Close)
	return proxy, e
}
