package e2e_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/idemcp/idemcp/internal/freeport"
)

const initializeBody = `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2026-07-28","capabilities":{},"clientInfo":{"name":"raw","version":"1"}}}`

// failingUpstream is an MCP server that fails a client in one way; want is
// what the client's error says.
type failingUpstream struct {
	name   string
	url    string
	status int    // the HTTP status the client gets
	want   string // in the JSON-RPC error message the client gets
	keyed  func(key string) int64
}

// tcpUpstream accepts connections on a free port and hands each to serve
// once it has read a request head. It counts the heads that carry each
// Idempotency-Key.
func tcpUpstream(t *testing.T, serve func(c net.Conn, br *bufio.Reader)) (string, func(string) int64) {
	t.Helper()
	addr := freeport.Loopback(t)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	var mu sync.Mutex
	keys := map[string]int64{}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = c.Close() }()
				_ = c.SetDeadline(time.Now().Add(20 * time.Second))
				br := bufio.NewReader(c)
				for {
					line, err := br.ReadString('\n')
					if err != nil {
						return
					}
					if k, ok := strings.CutPrefix(strings.TrimSpace(line), "Idempotency-Key: "); ok {
						mu.Lock()
						keys[k]++
						mu.Unlock()
					}
					if line == "\r\n" {
						break
					}
				}
				serve(c, br)
			}()
		}
	}()
	return "http://" + addr, func(k string) int64 {
		mu.Lock()
		defer mu.Unlock()
		return keys[k]
	}
}

func failingUpstreams(t *testing.T) []failingUpstream {
	closing, closingKeys := tcpUpstream(t, func(net.Conn, *bufio.Reader) {})
	refusal := `{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"refused before reading the body"}}`
	early, earlyKeys := tcpUpstream(t, func(c net.Conn, br *bufio.Reader) {
		_, _ = fmt.Fprintf(c, "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(refusal), refusal)
		_, _ = io.Copy(io.Discard, br) // until the sidecar hangs up
	})
	return []failingUpstream{
		{name: "unreachable", url: "http://" + freeport.Loopback(t), status: http.StatusBadGateway,
			want: "could not be reached", keyed: func(string) int64 { return 0 }},
		{name: "closes-mid-request", url: closing, status: http.StatusBadGateway, want: "could not be reached", keyed: closingKeys},
		{name: "answers-before-reading", url: early, status: http.StatusBadRequest, want: "refused before reading the body", keyed: earlyKeys},
	}
}

// TestFailingUpstreamGetsEveryRequestAClearError: whatever way the MCP
// server fails (nobody listens, it hangs up mid-request, it answers before
// reading the body) every request through the sidecar gets a JSON-RPC
// error saying so, the next request on a kept-alive connection too, and
// the sidecar neither panics nor races. Go's HTTP/1 server used to panic
// ("invalid concurrent Body.Read call") once a handler in full duplex mode
// left a request body unread, cutting the client's connection, or took the
// rest of a half-read body for the next request.
func TestFailingUpstreamGetsEveryRequestAClearError(t *testing.T) {
	for _, up := range failingUpstreams(t) {
		t.Run(up.name, func(t *testing.T) {
			base, _, stderr := startSidecarBinary(t, up.url)
			t.Run("go-sdk", func(t *testing.T) { goSDKConnectFails(t, base, up) })
			t.Run("http1-body-still-sending", func(t *testing.T) { bodyStillSending(t, base, up) })
			t.Run("http1-get-delete", func(t *testing.T) { getAndDeleteFail(t, base, up) })
			t.Run("deduplicated-call", func(t *testing.T) { deduplicatedCallFails(t, base, up) })
			for _, bad := range []string{"panic", "DATA RACE"} {
				if strings.Contains(stderr.String(), bad) {
					t.Errorf("the sidecar's stderr has %q:\n%s", bad, stderr.String())
				}
			}
		})
	}
}

// goSDKConnectFails: the Go SDK client, on both revisions, over one HTTP
// client (its connections kept alive), is told why it cannot connect.
func goSDKConnectFails(t *testing.T, base string, up failingUpstream) {
	hc := &http.Client{Transport: &http.Transport{}}
	defer hc.CloseIdleConnections()
	for _, version := range []string{"", "2025-11-25"} {
		for i := range 2 {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			client := mcp.NewClient(&mcp.Implementation{Name: "e2e-client", Version: "1.0.0"}, nil)
			cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: base + "/mcp", HTTPClient: hc, MaxRetries: -1},
				&mcp.ClientSessionOptions{ProtocolVersion: version})
			cancel()
			if err == nil {
				_ = cs.Close()
				t.Fatalf("revision %q, connect %d: connected to a server that %s", version, i+1, up.name)
			}
			want := http.StatusText(up.status) // what the SDK says of an HTTP error
			if !strings.Contains(err.Error(), want) {
				t.Fatalf("revision %q, connect %d: %v; want an error saying %q", version, i+1, err, want)
			}
		}
	}
}

// bodyStillSending: a client whose body is still on its way when the
// answer comes gets the error; once it has sent the rest, its next request
// (on the same connection unless the answer closed it) gets one too.
func bodyStillSending(t *testing.T, base string, up failingUpstream) {
	addr := strings.TrimPrefix(base, "http://")
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	// The whole message, in a chunked body that is not finished yet.
	_, err = fmt.Fprintf(c, "POST /mcp HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"+
		"Mcp-Method: initialize\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n", addr, len(initializeBody), initializeBody)
	if err != nil {
		t.Fatal(err)
	}
	// The client sends the end of its body once it has the answer, or
	// after a moment: a server that hung up is answered for once Go's
	// Transport has stopped writing the body, which takes the whole body.
	answered := make(chan struct{})
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		select {
		case <-answered:
		case <-time.After(200 * time.Millisecond):
		}
		_, _ = io.WriteString(c, "0\r\n\r\n")
	}()
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	close(answered)
	if err != nil {
		t.Fatalf("first request: %v", err)
	}
	checkRPCError(t, "first request", resp, up)
	<-sent
	if resp.Close {
		_ = c.Close()
		if c, err = net.Dial("tcp", addr); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = c.Close() }()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		br = bufio.NewReader(c)
	}
	_, err = fmt.Fprintf(c, "POST /mcp HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"+
		"Mcp-Method: initialize\r\nContent-Length: %d\r\n\r\n%s", addr, len(initializeBody), initializeBody)
	if err != nil {
		t.Fatal(err)
	}
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("second request, on the connection the first left open: %v", err)
	}
	checkRPCError(t, "second request", resp, up)
}

// getAndDeleteFail: a session's GET stream and its DELETE, twice over one
// kept-alive connection, get the error.
func getAndDeleteFail(t *testing.T, base string, up failingUpstream) {
	hc := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 1}}
	defer hc.CloseIdleConnections()
	for i := range 2 {
		for _, method := range []string{http.MethodGet, http.MethodDelete} {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			req, _ := http.NewRequestWithContext(ctx, method, base+"/mcp", nil)
			req.Header.Set("Accept", "text/event-stream")
			req.Header.Set("Mcp-Session-Id", "unread-body-session")
			resp, err := hc.Do(req)
			if err != nil {
				cancel()
				t.Fatalf("%s %d: %v", method, i+1, err)
			}
			checkRPCError(t, fmt.Sprintf("%s %d", method, i+1), resp, up)
			cancel()
		}
	}
}

// deduplicatedCallFails: a deduplicated tools/call gets the error, and so
// does its retry, which runs again: each reached the server once, none was
// sent twice.
func deduplicatedCallFails(t *testing.T, base string, up failingUpstream) {
	key := "unread-body-" + up.name
	call := `{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge","arguments":{"amount":5}}}`
	for i := range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/mcp", strings.NewReader(call))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer unread-body")
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			cancel()
			t.Fatalf("call %d: %v", i+1, err)
		}
		checkRPCError(t, fmt.Sprintf("call %d", i+1), resp, up)
		cancel()
	}
	want := int64(2)
	if up.name == "unreachable" {
		want = 0
	}
	if n := up.keyed(key); n != want {
		t.Fatalf("the server got the call %d times, want %d: once per call, never resent", n, want)
	}
}

// checkRPCError reads resp and fails t unless it is up's status with a
// JSON-RPC error (as JSON or one SSE event) whose message says up.want.
func checkRPCError(t *testing.T, what string, resp *http.Response, up failingUpstream) {
	t.Helper()
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s: reading the answer: %v", what, err)
	}
	data := body
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		for line := range strings.SplitSeq(string(body), "\n") {
			if d, ok := strings.CutPrefix(strings.TrimRight(line, "\r"), "data: "); ok {
				data = []byte(d)
			}
		}
	}
	var msg struct {
		Error *struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if resp.StatusCode != up.status || json.Unmarshal(data, &msg) != nil || msg.Error == nil || !strings.Contains(msg.Error.Message, up.want) {
		t.Fatalf("%s: HTTP %d %s; want HTTP %d with a JSON-RPC error saying %q", what, resp.StatusCode, body, up.status, up.want)
	}
}
