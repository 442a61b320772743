package sidecar

// Hostile requests against a real sidecar process, run twice: in front of
// a server in its pod (plain HTTP, the client's Host: what the webhook
// injects) and in front of a remote HTTPS server with its own CA (the
// upstream's Host, a server name override: what an IdempotentProxy runs).
// Whatever a client sends, the proxy connects only to its upstream,
// passes redirects and OAuth challenges back as they are, runs a call
// once, and refuses messages the server could read another way.

import (
	"bufio"
	"bytes"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/test/mcpserver"
)

// seen is one request the upstream received.
type seen struct {
	method, uri, host string
	header            http.Header
	body              string
}

// remoteUpstream is a counting MCP server with an OAuth-protected /mcp,
// its protected resource metadata, a redirect, and a tool that runs and
// then drops the connection without answering.
type remoteUpstream struct {
	url     string // as the proxy is configured
	host    string // the Host a request for the upstream itself carries
	args    []string
	server  *mcpserver.Server
	drops   atomic.Int32
	mu      sync.Mutex
	seen    []seen
	metaDoc string
}

// requests are those the upstream got for clients: not the proxy's own
// tool listings.
func (u *remoteUpstream) requests() []seen {
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []seen
	for _, s := range u.seen {
		if !strings.HasPrefix(s.header.Get("User-Agent"), "idemcp-sidecar") {
			out = append(out, s)
		}
	}
	return out
}

func (u *remoteUpstream) handler() http.Handler {
	mcpH := u.server.Handler(true)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.seen = append(u.seen, seen{method: r.Method, uri: r.RequestURI, host: r.Host, header: r.Header.Clone(), body: string(body)})
		u.mu.Unlock()
		r.Body = io.NopCloser(bytes.NewReader(body))
		switch {
		case r.URL.Path == "/.well-known/oauth-protected-resource":
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, u.metaDoc)
		case r.URL.Path == "/moved":
			w.Header().Set("Location", r.URL.Query().Get("to"))
			w.WriteHeader(http.StatusTemporaryRedirect)
		case r.Header.Get("Authorization") == "":
			w.Header().Set("WWW-Authenticate", `Bearer resource_metadata="`+u.url+`/.well-known/oauth-protected-resource", scope="charges"`)
			w.WriteHeader(http.StatusUnauthorized)
		case bytes.Contains(body, []byte(`"drop_me"`)):
			// Ran the side effect, then died before answering.
			u.drops.Add(1)
			if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
				_ = c.Close()
			}
		default:
			mcpH.ServeHTTP(w, r)
		}
	})
}

// upstreamKinds are the two shapes of the data plane.
var upstreamKinds = []struct {
	name  string
	start func(t *testing.T, u *remoteUpstream)
}{
	{"pod server over HTTP", func(t *testing.T, u *remoteUpstream) {
		srv := httptest.NewServer(u.handler())
		t.Cleanup(srv.Close)
		u.url, u.host = srv.URL, strings.TrimPrefix(srv.URL, "http://")
	}},
	{"remote server over HTTPS", func(t *testing.T, u *remoteUpstream) {
		srv := httptest.NewUnstartedServer(u.handler())
		srv.StartTLS()
		t.Cleanup(srv.Close)
		ca := filepath.Join(t.TempDir(), "ca.crt")
		if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
			t.Fatal(err)
		}
		// By the name "localhost", which the server's certificate does
		// not hold: the server name override makes it verify.
		u.host = "localhost:" + strings.Split(srv.Listener.Addr().String(), ":")[1]
		u.url = "https://" + u.host
		u.args = []string{"--upstream-ca-file", ca, "--upstream-server-name", "example.com", "--upstream-host-header", "upstream"}
	}},
}

// canary is a listener nothing may ever connect to.
type canary struct {
	ln    net.Listener
	conns atomic.Int32
}

func newCanary(t *testing.T) *canary {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &canary{ln: ln}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			c.conns.Add(1)
			_ = conn.Close()
		}
	}()
	return c
}

func (c *canary) addr() string { return c.ln.Addr().String() }

const remotePolicy = `spec:
  keyScope: Principal
  defaultMode: Passthrough
  tools:
  - name: charge_card
    mode: Deduplicate
  - name: drop_me
    mode: Deduplicate
`

func startRemote(t *testing.T, start func(*testing.T, *remoteUpstream)) (*remoteUpstream, *sidecarProcess) {
	t.Helper()
	u := &remoteUpstream{server: mcpserver.New()}
	start(t, u)
	u.metaDoc = `{"resource":"` + u.url + `/mcp","authorization_servers":["https://auth.example"],"scopes_supported":["charges"]}`
	pol := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(pol, []byte(remotePolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	return u, startSidecarProcess(t, u.url, append([]string{"--policy-file", pol}, u.args...)...)
}

// rawExchange writes head (and body) on a fresh connection and reads one
// response, as a client that is not Go's would.
func rawExchange(t *testing.T, addr, head string) (*http.Response, string) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(15 * time.Second))
	if _, err := io.WriteString(conn, head); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("reading the answer to %q: %v", strings.SplitN(head, "\r\n", 2)[0], err)
	}
	b, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	return resp, string(b)
}

func post(head, body string) string {
	return head + fmt.Sprintf("Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(body), body)
}

const pingBody = `{"jsonrpc":"2.0","id":1,"method":"ping"}`

func TestProxyConnectsOnlyToItsUpstream(t *testing.T) {
	for _, kind := range upstreamKinds {
		t.Run(kind.name, func(t *testing.T) {
			u, p := startRemote(t, kind.start)
			evil := newCanary(t)

			// An absolute URI naming another host goes to the upstream, at
			// its path only.
			resp, _ := rawExchange(t, p.proxy, post("POST http://"+evil.addr()+"/mcp?x=1 HTTP/1.1\r\nHost: "+evil.addr()+"\r\nAuthorization: Bearer a\r\n", pingBody))
			if resp.StatusCode != http.StatusOK {
				t.Errorf("absolute-URI ping: status %d, want the upstream's 200", resp.StatusCode)
			}
			// A Host naming another address changes nothing about where
			// the request goes.
			resp, _ = rawExchange(t, p.proxy, post("POST /mcp HTTP/1.1\r\nHost: "+evil.addr()+"\r\nAuthorization: Bearer a\r\n", pingBody))
			if resp.StatusCode != http.StatusOK {
				t.Errorf("ping with a foreign Host: status %d, want the upstream's 200", resp.StatusCode)
			}
			// CONNECT is refused by the proxy itself.
			resp, _ = rawExchange(t, p.proxy, "CONNECT "+evil.addr()+" HTTP/1.1\r\nHost: "+evil.addr()+"\r\n\r\n")
			if resp.StatusCode != http.StatusMethodNotAllowed {
				t.Errorf("CONNECT: status %d, want 405", resp.StatusCode)
			}
			// A redirect is the client's to follow, never the proxy's.
			resp, _ = rawExchange(t, p.proxy, "GET /moved?to=http://"+evil.addr()+"/stolen HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nConnection: close\r\n\r\n")
			if resp.StatusCode != http.StatusTemporaryRedirect || resp.Header.Get("Location") != "http://"+evil.addr()+"/stolen" {
				t.Errorf("redirect: %d Location %q, want the upstream's 307 with its Location as it was", resp.StatusCode, resp.Header.Get("Location"))
			}
			time.Sleep(100 * time.Millisecond)
			if n := evil.conns.Load(); n != 0 {
				t.Errorf("the proxy connected %d times to an address a client named", n)
			}
			reqs := u.requests()
			if len(reqs) < 3 {
				t.Fatalf("the upstream got %d requests, want the absolute-URI ping, the foreign-Host ping and the redirect", len(reqs))
			}
			if reqs[0].uri != "/mcp?x=1" {
				t.Errorf("the absolute-URI request reached the upstream as %q, want its path and query alone: %+v", reqs[0].uri, reqs)
			}
			wantHost := u.host // the upstream's own, for a remote server
			if len(u.args) == 0 {
				wantHost = evil.addr() // the client's, for a server in the pod
			}
			if reqs[1].host != wantHost {
				t.Errorf("Host upstream %q, want %q", reqs[1].host, wantHost)
			}
		})
	}
}

func TestProxyPassesOAuthAndMCPHeadersUnchanged(t *testing.T) {
	for _, kind := range upstreamKinds {
		t.Run(kind.name, func(t *testing.T) {
			u, p := startRemote(t, kind.start)
			// No token: the upstream's challenge, as it wrote it.
			resp, _ := rawExchange(t, p.proxy, post("POST /mcp HTTP/1.1\r\nHost: proxy.shop.svc:8080\r\n", pingBody))
			want := `Bearer resource_metadata="` + u.url + `/.well-known/oauth-protected-resource", scope="charges"`
			if resp.StatusCode != http.StatusUnauthorized || resp.Header.Get("WWW-Authenticate") != want {
				t.Errorf("no token: %d WWW-Authenticate %q, want 401 %q", resp.StatusCode, resp.Header.Get("WWW-Authenticate"), want)
			}
			// The protected resource metadata, byte for byte.
			resp, body := rawExchange(t, p.proxy, "GET /.well-known/oauth-protected-resource HTTP/1.1\r\nHost: proxy.shop.svc:8080\r\nConnection: close\r\n\r\n")
			if resp.StatusCode != http.StatusOK || body != u.metaDoc {
				t.Errorf("metadata: %d %q, want 200 %q", resp.StatusCode, body, u.metaDoc)
			}
			// The caller's credentials and MCP headers reach the server
			// as they were sent.
			rawExchange(t, p.proxy, post("POST /mcp HTTP/1.1\r\nHost: proxy.shop.svc:8080\r\nAuthorization: Bearer tok-Ä1\r\nMcp-Session-Id: s-1\r\nMCP-Protocol-Version: 2025-11-25\r\nMcp-Method: ping\r\nIdempotency-Key: k-1\r\n", pingBody))
			reqs := u.requests()
			last := reqs[len(reqs)-1]
			for name, v := range map[string]string{"Authorization": "Bearer tok-Ä1", "Mcp-Session-Id": "s-1", "Mcp-Protocol-Version": "2025-11-25", "Mcp-Method": "ping", "Idempotency-Key": "k-1"} {
				if got := last.header.Get(name); got != v {
					t.Errorf("%s upstream %q, want %q", name, got, v)
				}
			}
		})
	}
}

func callCharge(t *testing.T, addr, token string) (*http.Response, string) {
	t.Helper()
	return rawExchange(t, addr, post("POST /mcp HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer "+token+"\r\nMCP-Protocol-Version: 2025-11-25\r\n",
		`{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"charge_card","arguments":{"card":"4242","amount":10}}}`))
}

func TestProxyScopesRetriesByTheCallersToken(t *testing.T) {
	for _, kind := range upstreamKinds {
		t.Run(kind.name, func(t *testing.T) {
			u, p := startRemote(t, kind.start)
			first, body := callCharge(t, p.proxy, "alice")
			if first.StatusCode != http.StatusOK || !strings.Contains(body, "charge #1") {
				t.Fatalf("first call: %d %s", first.StatusCode, body)
			}
			retry, body := callCharge(t, p.proxy, "alice")
			if retry.Header.Get("Idempotent-Replayed") != "true" || !strings.Contains(body, "charge #1") {
				t.Errorf("alice's retry: Idempotent-Replayed %q, %s; want the first result replayed", retry.Header.Get("Idempotent-Replayed"), body)
			}
			_, body = callCharge(t, p.proxy, "bob")
			if !strings.Contains(body, "charge #2") {
				t.Errorf("bob's identical call: %s; want a charge of its own", body)
			}
			if n := u.server.Counts.Get("charge_card"); n != 2 {
				t.Errorf("the server charged %d times, want 2 (alice once, bob once)", n)
			}
		})
	}
}

func TestProxyNeverResendsACall(t *testing.T) {
	for _, kind := range upstreamKinds {
		t.Run(kind.name, func(t *testing.T) {
			u, p := startRemote(t, kind.start)
			// Pooled connections to the upstream, which the transport would
			// retry on.
			var wg sync.WaitGroup
			for range 6 {
				wg.Go(func() {
					rawExchange(t, p.proxy, post("POST /mcp HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer a\r\n", pingBody))
				})
			}
			wg.Wait()
			for _, header := range []string{"Idempotency-Key: k-drop\r\n", ""} {
				before := u.drops.Load()
				resp, _ := rawExchange(t, p.proxy, post("POST /mcp HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer a\r\n"+header,
					`{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"drop_me","arguments":{}}}`))
				time.Sleep(300 * time.Millisecond) // time for a resend to arrive
				if n := u.drops.Load() - before; n != 1 {
					t.Errorf("with %q the upstream ran the call %d times, want 1 (answered %d)", strings.TrimSpace(header), n, resp.StatusCode)
				}
			}
		})
	}
}

func TestProxyRefusesAmbiguousFraming(t *testing.T) {
	for _, kind := range upstreamKinds {
		t.Run(kind.name, func(t *testing.T) {
			u, p := startRemote(t, kind.start)
			for _, tc := range []struct{ name, raw string }{
				{"two methods", post("POST /mcp HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer a\r\n",
					`{"jsonrpc":"2.0","id":1,"method":"ping","method":"tools/call","params":{"name":"charge_card","arguments":{}}}`)},
				{"two messages in one body", post("POST /mcp HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer a\r\n",
					`{"jsonrpc":"2.0","id":1,"method":"ping"}{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"charge_card","arguments":{}}}`)},
				{"two lengths", "POST /mcp HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer a\r\nContent-Type: application/json\r\nContent-Length: 40\r\nContent-Length: 41\r\nConnection: close\r\n\r\n" + pingBody},
			} {
				before := len(u.requests())
				resp, body := rawExchange(t, p.proxy, tc.raw)
				if resp.StatusCode != http.StatusBadRequest {
					t.Errorf("%s: status %d (%s), want 400", tc.name, resp.StatusCode, body)
				}
				if n := len(u.requests()) - before; n != 0 {
					t.Errorf("%s: %d requests reached the upstream, want none: %+v", tc.name, n, u.requests()[before:])
				}
			}
			if n := u.server.Counts.Get("charge_card"); n != 0 {
				t.Errorf("the server charged %d times", n)
			}
			// Content-Length beside chunked is read as chunked (RFC 9112
			// 6.3) and leaves with one framing of the proxy's own: the
			// server reads the whole message, never the first 4 bytes of it
			// with the rest as a request of its own.
			before := len(u.requests())
			rawExchange(t, p.proxy, "POST /mcp HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer a\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"+
				fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(pingBody), pingBody))
			if got := u.requests()[before:]; len(got) != 1 || got[0].body != pingBody {
				t.Errorf("length and chunked: the upstream got %+v, want one request with the whole message", got)
			}
		})
	}
}
