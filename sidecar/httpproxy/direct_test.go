package httpproxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/test/poll"
)

// rawServer answers each request on a raw TCP connection with answer,
// which writes the response bytes itself (or none). It counts connections
// and requests, and keeps each request's bytes.
type rawServer struct {
	ln     net.Listener
	conns  atomic.Int64
	closed atomic.Int64 // connections the client closed, or the server
	mu     sync.Mutex
	reqs   [][]byte
	answer func(c net.Conn, n int, req *http.Request)
}

func newRawServer(t *testing.T, answer func(c net.Conn, n int, req *http.Request)) *rawServer {
	t.Helper()
	s := &rawServer{answer: answer}
	s.ln = listenTCP(t, func(c net.Conn) {
		s.conns.Add(1)
		s.serve(c)
	})
	return s
}

// listenTCP serves each connection to a new loopback listener with
// handle, on its own goroutine, until the test ends.
func listenTCP(t *testing.T, handle func(net.Conn)) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go handle(c)
		}
	}()
	return ln
}

func (s *rawServer) serve(c net.Conn) {
	defer func() { _ = c.Close(); s.closed.Add(1) }()
	var raw bytes.Buffer
	br := bufio.NewReader(io.TeeReader(c, &raw))
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, req.Body)
		s.mu.Lock()
		s.reqs = append(s.reqs, bytes.Clone(raw.Bytes()[:raw.Len()-br.Buffered()]))
		n := len(s.reqs)
		s.mu.Unlock()
		raw.Next(raw.Len() - br.Buffered())
		s.answer(c, n, req)
	}
}

func (s *rawServer) requests() [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([][]byte(nil), s.reqs...)
}

func (s *rawServer) url() string { return "http://" + s.ln.Addr().String() + "/mcp" }

func okAnswer(c net.Conn, _ int, _ *http.Request) {
	_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
}

func testDirect() *directTransport { return newDirectTransport(NewTransport()) }

func directCall(t *testing.T, rt http.RoundTripper, ctx context.Context, method, u, body string) (*http.Response, string, error) {
	t.Helper()
	var rb io.Reader
	if body != "" {
		rb = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rb)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "k1")
	req.Header = outgoingHeader(req.Header) // as the proxy sends it
	if body != "" {
		req.Body = onceBody([]byte(body))
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return nil, "", err
	}
	b, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	return resp, string(b), err
}

// TestDirectSendsWhatTheTransportSends: the same request, sent by the
// direct path and by net/http's Transport, arrives as the same bytes.
func TestDirectSendsWhatTheTransportSends(t *testing.T) {
	s := newRawServer(t, okAnswer)
	for _, method := range []string{"POST", "GET", "DELETE"} {
		body := ""
		if method == "POST" {
			body = `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge"}}`
		}
		for _, rt := range []http.RoundTripper{testDirect(), noResend{next: NewTransport()}} {
			if _, got, err := directCall(t, rt, context.Background(), method, s.url()+"?q=1", body); err != nil || got != "{}" {
				t.Fatalf("%s: %q, %v", method, got, err)
			}
		}
	}
	reqs := s.requests()
	if len(reqs) != 6 {
		t.Fatalf("the server got %d requests, want 6", len(reqs))
	}
	// A POST with no body: Content-Length: 0, where the Transport sends an
	// empty chunked body (noResend).
	req, _ := http.NewRequest("POST", s.url(), nil)
	req.Header = outgoingHeader(req.Header)
	if resp, err := testDirect().RoundTrip(req); err != nil {
		t.Fatal(err)
	} else {
		_ = resp.Body.Close()
	}
	if got := string(s.requests()[6]); got != "POST /mcp HTTP/1.1\r\nHost: "+s.ln.Addr().String()+"\r\nContent-Length: 0\r\n\r\n" {
		t.Errorf("a POST with no body went as\n%q", got)
	}
	for i := 0; i < len(reqs); i += 2 {
		direct, tr := string(reqs[i]), string(reqs[i+1])
		if direct != tr {
			t.Errorf("the direct path sent\n%q\nthe Transport\n%q", direct, tr)
		}
		if strings.Contains(direct, "User-Agent") || strings.Contains(direct, "Transfer-Encoding") {
			t.Errorf("the direct path added a header:\n%q", direct)
		}
		if !strings.Contains(direct, "Idempotency-Key: k1\r\n") || !strings.Contains(direct, "?q=1 HTTP/1.1\r\n") {
			t.Errorf("the direct path lost the request's header or query:\n%q", direct)
		}
	}
}

// TestDirectReusesAConnectionAndDropsOneTheServerClosed: calls in a row
// share one connection; once the server closes it while idle, the next
// call goes on a new one, and each call reaches the server once.
func TestDirectReusesAConnectionAndDropsOneTheServerClosed(t *testing.T) {
	var closeAfter atomic.Int64
	s := newRawServer(t, func(c net.Conn, n int, req *http.Request) {
		okAnswer(c, n, req)
		if int64(n) == closeAfter.Load() {
			_ = c.Close()
		}
	})
	d := testDirect()
	for i := range 3 {
		if _, got, err := directCall(t, d, context.Background(), "POST", s.url(), `{"n":1}`); err != nil || got != "{}" {
			t.Fatalf("call %d: %q, %v", i, got, err)
		}
	}
	if n := s.conns.Load(); n != 1 {
		t.Fatalf("3 calls in a row took %d connections, want 1", n)
	}
	closeAfter.Store(4)
	if _, _, err := directCall(t, d, context.Background(), "POST", s.url(), `{"n":4}`); err != nil {
		t.Fatal(err)
	}
	// Wait for the server's close to reach the idle connection: the next
	// call's peek must see it.
	addr := s.ln.Addr().String()
	poll.Within(t, 5*time.Second, "the server's close of the idle connection", poll.True(func() bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		conns := d.idle[addr]
		return len(conns) == 0 || !conns[len(conns)-1].usable()
	}))
	if _, got, err := directCall(t, d, context.Background(), "POST", s.url(), `{"n":5}`); err != nil || got != "{}" {
		t.Fatalf("the call after the server closed the idle connection: %q, %v", got, err)
	}
	if n, reqs := s.conns.Load(), len(s.requests()); n != 2 || reqs != 5 {
		t.Fatalf("%d connections and %d requests, want 2 and 5", n, reqs)
	}
	if n := s.closed.Load(); n != 1 {
		t.Fatalf("%d connections closed, want the one the server closed", n)
	}
	// An idle connection is closed after the idle timeout, unused.
	d.CloseIdleConnections()
	d.idleTimeout = 50 * time.Millisecond
	if _, _, err := directCall(t, d, context.Background(), "POST", s.url(), `{"n":6}`); err != nil {
		t.Fatal(err)
	}
	poll.Within(t, 5*time.Second, "the idle connection closed after the idle timeout", poll.True(func() bool { return s.closed.Load() == 3 }))
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.idle) != 0 || d.sweeping {
		t.Fatalf("after the sweep: %d addresses idle, sweeping %v", len(d.idle), d.sweeping)
	}
}

// TestDirectNeverResends: a server that reads the call and drops the
// connection without an answer gets it once, and the caller an error.
func TestDirectNeverResends(t *testing.T) {
	s := newRawServer(t, func(c net.Conn, n int, req *http.Request) {
		if n == 1 {
			okAnswer(c, n, req)
			return
		}
		_ = c.Close()
	})
	d := testDirect()
	if _, _, err := directCall(t, d, context.Background(), "POST", s.url(), `{"warm":1}`); err != nil {
		t.Fatal(err)
	}
	_, _, err := directCall(t, d, context.Background(), "POST", s.url(), `{"charge":1}`)
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("got %v, want the server's close as an unexpected EOF", err)
	}
	// Nothing to wait for: the direct path has no goroutine of its own,
	// so a resend would have reached the server before RoundTrip returned.
	if reqs := len(s.requests()); reqs != 2 {
		t.Fatalf("the server got %d requests, want 2: the dropped call was sent again", reqs)
	}
}

// TestDirectConnectionNotReused: a connection is not reused after a
// response that closes it, a body closed before its end, or bytes the
// server sent past its response.
func TestDirectConnectionNotReused(t *testing.T) {
	for name, answer := range map[string]func(c net.Conn, n int, req *http.Request){
		"Connection: close": func(c net.Conn, _ int, _ *http.Request) {
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")
		},
		"bytes past the response": func(c net.Conn, _ int, _ *http.Request) {
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}HTTP/1.1 200 OK\r\n")
		},
	} {
		t.Run(name, func(t *testing.T) {
			s := newRawServer(t, answer)
			d := testDirect()
			for i := range 2 {
				if _, got, err := directCall(t, d, context.Background(), "POST", s.url(), `{}`); err != nil || got != "{}" {
					t.Fatalf("call %d: %q, %v", i, got, err)
				}
			}
			if n := s.conns.Load(); n != 2 {
				t.Fatalf("2 calls took %d connections, want 2", n)
			}
		})
	}
	t.Run("body closed before its end", func(t *testing.T) {
		s := newRawServer(t, func(c net.Conn, _ int, _ *http.Request) {
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789")
		})
		d := testDirect()
		for range 2 {
			req, _ := http.NewRequest("GET", s.url(), nil)
			resp, err := d.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			b := make([]byte, 3)
			if _, err := io.ReadFull(resp.Body, b); err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
		}
		if n := s.conns.Load(); n != 2 {
			t.Fatalf("2 calls took %d connections, want 2", n)
		}
	})
}

// TestDirectCancel: canceling a request ends it with the context's error,
// while the server has not answered and while its body streams.
func TestDirectCancel(t *testing.T) {
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	s := newRawServer(t, func(c net.Conn, _ int, req *http.Request) {
		if req.Method == "GET" {
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n: hi\n\r\n")
		}
		<-release
	})
	d := testDirect()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	start := time.Now()
	_, _, err := directCall(t, d, ctx, "POST", s.url(), `{}`)
	if !errors.Is(err, context.Canceled) || time.Since(start) > 5*time.Second {
		t.Fatalf("a call canceled before its answer: %v after %v, want context.Canceled at once", err, time.Since(start))
	}

	ctx, cancel = context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "GET", s.url(), nil)
	resp, err := d.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 5)
	if _, err := io.ReadFull(resp.Body, b); err != nil || string(b) != ": hi\n" {
		t.Fatalf("%q, %v", b, err)
	}
	time.AfterFunc(100*time.Millisecond, cancel)
	if _, err := resp.Body.Read(b); !errors.Is(err, context.Canceled) {
		t.Fatalf("a stream read when its request was canceled: %v, want context.Canceled", err)
	}
	_ = resp.Body.Close()
}

// TestDirectBoundsTheResponseHeader: a server whose header does not end
// gets an error, not the sidecar's memory, at the Transport's bound.
func TestDirectBoundsTheResponseHeader(t *testing.T) {
	s := newRawServer(t, func(c net.Conn, _ int, _ *http.Request) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\n")
		line := "X-Pad: " + strings.Repeat("a", 1000) + "\r\n"
		for range 2000 {
			if _, err := io.WriteString(c, line); err != nil {
				return
			}
		}
	})
	d := testDirect()
	if d.maxHeader != 10<<20 {
		t.Fatalf("the header bound is %d bytes, want the Transport's default, 10 MiB", d.maxHeader)
	}
	d.maxHeader = 1 << 20
	if _, _, err := directCall(t, d, context.Background(), "POST", s.url(), `{}`); !errors.Is(err, errHeaderTooLarge) {
		t.Fatalf("a 2 MB header over a 1 MiB bound: %v, want %v", err, errHeaderTooLarge)
	}
}

// TestDirectInformationalResponses: 1xx responses before the answer are
// skipped however many come (a Node.js server's 102 Processing while a
// long tool runs), or given to the request's httptrace as the Transport
// gives them; a 101 is the response, its connection not reused.
func TestDirectInformationalResponses(t *testing.T) {
	s := newRawServer(t, func(c net.Conn, _ int, req *http.Request) {
		if req.Method == "GET" {
			_, _ = io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: x\r\n\r\nraw bytes")
			_ = c.Close()
			return
		}
		for range 20 {
			_, _ = io.WriteString(c, "HTTP/1.1 102 Processing\r\n\r\n")
		}
		_, _ = io.WriteString(c, "HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
		okAnswer(c, 0, nil)
	})
	d := testDirect()
	if resp, got, err := directCall(t, d, context.Background(), "POST", s.url(), `{}`); err != nil || resp.StatusCode != 200 || got != "{}" {
		t.Fatalf("twenty 102s and a 103, then the answer: %v, %q, %v", resp, got, err)
	}
	var seen []int
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
			seen = append(seen, code)
			return nil
		},
	})
	if _, got, err := directCall(t, d, ctx, "POST", s.url(), `{}`); err != nil || got != "{}" || len(seen) != 21 || seen[20] != 103 {
		t.Fatalf("traced: %q, %v; the trace saw %v, want twenty 102s and a 103", got, err, seen)
	}
	req, _ := http.NewRequest("GET", s.url(), nil)
	resp, err := d.RoundTrip(req)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("a 101: %v, %v", resp, err)
	}
	b, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if string(b) != "raw bytes" {
		t.Fatalf("a 101's body is what follows it on the connection: %q", b)
	}
	if _, got, err := directCall(t, d, context.Background(), "POST", s.url(), `{}`); err != nil || got != "{}" {
		t.Fatalf("after the 101: %q, %v", got, err)
	}
	if n := s.conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2: the one a 101 took is not reused", n)
	}
}

// TestDirectLeavesTheRestToTheTransport: a large body, an upgrade and an
// https URL go through net/http's Transport, and arrive whole.
func TestDirectLeavesTheRestToTheTransport(t *testing.T) {
	var got atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		got.Store(n)
		_, _ = fmt.Fprint(w, "{}")
	})
	plain := httptest.NewServer(h)
	t.Cleanup(plain.Close)
	tlsSrv := httptest.NewTLSServer(h)
	t.Cleanup(tlsSrv.Close)

	d := testDirect()
	var fellBack atomic.Int64
	d.fallback = roundTripFunc(func(r *http.Request) (*http.Response, error) {
		fellBack.Add(1)
		return noResend{next: tlsSrv.Client().Transport}.RoundTrip(r)
	})
	large := strings.Repeat("x", directMaxBody+1)
	if _, body, err := directCall(t, d, context.Background(), "POST", plain.URL, large); err != nil || body != "{}" || got.Load() != int64(len(large)) {
		t.Fatalf("a large body: %q, %v; the server read %d bytes", body, err, got.Load())
	}
	if _, body, err := directCall(t, d, context.Background(), "POST", tlsSrv.URL, "{}"); err != nil || body != "{}" {
		t.Fatalf("https: %q, %v", body, err)
	}
	if n := fellBack.Load(); n != 2 {
		t.Fatalf("%d requests went to the Transport, want 2", n)
	}
	req, _ := http.NewRequest("GET", plain.URL, nil)
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "websocket")
	resp, err := d.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if n := fellBack.Load(); n != 3 {
		t.Fatalf("an upgrade: %d requests went to the Transport, want 3", n)
	}
	if _, _, err := directCall(t, d, context.Background(), "GET", plain.URL, ""); err != nil || fellBack.Load() != 3 {
		t.Fatalf("a plain GET: %v; %d requests went to the Transport, want it on the direct path", err, fellBack.Load())
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestUpstreamUserinfoIsBasicAuth: an upstream URL with a user and
// password reaches the server as basic auth, as http.Client sent it,
// unless the client sent its own Authorization: on a call forwarded as it
// came (no principal) and on a deduplicated one.
func TestUpstreamUserinfoIsBasicAuth(t *testing.T) {
	s := newRawServer(t, func(c net.Conn, _ int, req *http.Request) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 36\r\n\r\n"+`{"jsonrpc":"2.0","id":1,"result":{}}`)
	})
	proxy := newTestProxy(t, "http://u:p@"+s.ln.Addr().String(), "")
	for _, auth := range []string{"", "Bearer caller-a"} {
		req, _ := http.NewRequest(http.MethodPost, proxy.URL+"/mcp", strings.NewReader(fmt.Sprintf(chargeCall, 1)))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
	}
	reqs := s.requests()
	if len(reqs) != 2 {
		t.Fatalf("the server got %d requests, want 2", len(reqs))
	}
	if !bytes.Contains(reqs[0], []byte("Authorization: Basic dTpw\r\n")) {
		t.Errorf("without the client's Authorization:\n%q\nwant the URL's user and password as basic auth", reqs[0])
	}
	if !bytes.Contains(reqs[1], []byte("Authorization: Bearer caller-a\r\n")) || bytes.Contains(reqs[1], []byte("Basic")) {
		t.Errorf("with the client's Authorization:\n%q\nwant it alone", reqs[1])
	}
}
