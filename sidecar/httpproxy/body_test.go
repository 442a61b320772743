package httpproxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
)

// lockedLog collects an http.Server's ErrorLog.
type lockedLog struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// earlyUpstream answers every request with a JSON-RPC error as soon as it
// has its head, before reading any of its body.
func earlyUpstream(t *testing.T) string {
	t.Helper()
	addr := freeport.Loopback(t)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	refusal := `{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"refused before reading the body"}}`
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
					if line == "\r\n" {
						break
					}
				}
				_, _ = fmt.Fprintf(c, "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(refusal), refusal)
				_, _ = io.Copy(io.Discard, br)
			}()
		}
	}()
	return "http://" + addr
}

// A client still sending its body when the MCP server fails (nobody
// listens, or it answers before reading the body) gets the error, and so
// does its next request, over HTTP/1.1 and HTTP/2; the server logs no
// panic.
func TestBodyStillSendingWhenTheServerFails(t *testing.T) {
	msg := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}`
	for _, up := range []struct {
		name, url string
		status    int
		want      string
	}{
		{"unreachable", "http://" + freeport.Loopback(t), http.StatusBadGateway, "could not be reached"},
		{"answers-before-reading", earlyUpstream(t), http.StatusBadRequest, "refused before reading the body"},
	} {
		for _, proto := range []string{"HTTP/1.1", "HTTP/2.0"} {
			t.Run(up.name+"/"+proto, func(t *testing.T) {
				u, _ := url.Parse(up.url)
				e := engine.New(engine.Options{Store: store.NewMemory(100), Policy: policy.Default()})
				var errLog lockedLog
				srv := httptest.NewUnstartedServer(New(Options{Upstream: u, Engine: e}))
				srv.Config.ErrorLog = log.New(&errLog, "", 0)
				if proto == "HTTP/2.0" {
					srv.EnableHTTP2 = true
					srv.StartTLS()
				} else {
					srv.Start()
				}
				t.Cleanup(srv.Close)
				client := srv.Client()
				for i := range 3 {
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					pr, pw := io.Pipe()
					answered := make(chan struct{})
					go func() {
						// The message, then the end of the body once the
						// answer is in, or after a moment.
						_, _ = io.WriteString(pw, msg)
						select {
						case <-answered:
						case <-time.After(200 * time.Millisecond):
						}
						_ = pw.Close()
					}()
					req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/mcp", pr)
					req.Header.Set("Content-Type", "application/json")
					req.Header.Set("Accept", "application/json, text/event-stream")
					req.Header.Set("Mcp-Method", "initialize")
					resp, err := client.Do(req)
					close(answered)
					if err != nil {
						cancel()
						t.Fatalf("request %d: %v", i+1, err)
					}
					body, err := io.ReadAll(resp.Body)
					_ = resp.Body.Close()
					cancel()
					var rpc struct {
						Error *struct{ Message string } `json:"error"`
					}
					if err != nil || resp.Proto != proto || resp.StatusCode != up.status || json.Unmarshal(body, &rpc) != nil ||
						rpc.Error == nil || !strings.Contains(rpc.Error.Message, up.want) {
						t.Fatalf("request %d: %s %d %s (%v); want %s %d with a JSON-RPC error saying %q",
							i+1, resp.Proto, resp.StatusCode, body, err, proto, up.status, up.want)
					}
				}
				srv.Close() // waits for the handlers, and net/http's work after them
				if l := errLog.String(); strings.Contains(l, "panic") {
					t.Fatalf("the server's error log has a panic:\n%s", l)
				}
			})
		}
	}
}
