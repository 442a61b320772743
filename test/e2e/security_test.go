package e2e_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	goredis "github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/test/procs"
)

// Distinctive strings a caller sends that must never be kept or shown:
// in an argument, as an explicit key, in Authorization.
const (
	argMarker  = "ARGMARK-4f1d93c2"
	keyMarker  = "KEYMARK-8b07e611"
	authMarker = "AUTHMARK-d2a95c7e"
)

// sidecarProc is `idemcp sidecar` run as a process, its stderr kept.
type sidecarProc struct {
	url, admin string
	stderr     *lockedBuffer
	pid        int
}

func startSidecarProc(t *testing.T, upstream string, args ...string) *sidecarProc {
	t.Helper()
	bins := buildWrapBins(t)
	addr, admin := freeAddr(t), freeAddr(t)
	p := &sidecarProc{url: "http://" + addr, admin: admin, stderr: &lockedBuffer{}}
	proc := procs.New(procs.Spec{
		Name: "the sidecar", Path: bins.idemcp,
		Args: append([]string{"sidecar", "--listen", addr, "--admin-listen", admin,
			"--upstream", upstream, "--log-level", "debug"}, args...),
		Env:    append(os.Environ(), "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0")),
		Stderr: p.stderr,
		Ready: func() error {
			resp, err := http.Get("http://" + admin + "/healthz")
			if err == nil {
				_ = resp.Body.Close()
			}
			return err
		},
		ReadyTimeout: 20 * time.Second,
		StopSignal:   syscall.SIGINT,
	})
	if err := proc.Start(); err != nil {
		t.Fatalf("the sidecar never answered /healthz on %s: %v\n%s", admin, err, p.stderr.String())
	}
	p.pid = proc.PID()
	t.Cleanup(func() {
		proc.Stop()
		if t.Failed() {
			t.Logf("idemcp sidecar stderr:\n%s", p.stderr.String())
		}
	})
	return p
}

// Principal isolation over Streamable HTTP, JSON and SSE responses, through
// sidecars sharing a real Redis: caller B, with the same arguments and the
// same explicit key as caller A, never gets A's result. Then nothing A or
// B sent in an argument, an explicit key or Authorization is found in
// Redis (key names or values), on /metrics, or in the sidecar's debug log.
func TestSecretsNeitherSharedNorKept(t *testing.T) {
	srv := redistest.Start(t)
	policy := writePolicy(t, "spec: {keyScope: Principal, defaultMode: Deduplicate}")
	var logs []*sidecarProc
	for _, sse := range []bool{false, true} {
		name := map[bool]string{false: "json", true: "sse"}[sse]
		t.Run(name, func(t *testing.T) {
			up := newRawUpstream(t, `{"content":[{"type":"text","text":"charged"}]}`, sse, 0)
			sc := startSidecarProc(t, up.URL, "--store", "redis", "--redis-addr", srv.Addr, "--policy-file", policy)
			logs = append(logs, sc)
			alice := http.Header{"Authorization": {"Bearer " + authMarker + "-alice"}}
			bob := http.Header{"Authorization": {"Bearer " + authMarker + "-bob"}}
			withKey := func(h http.Header) http.Header {
				h = h.Clone()
				h.Set("Idempotency-Key", keyMarker+"-"+name)
				return h
			}
			callBody := func(id int) string {
				return fmt.Sprintf(`{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"charge_card","arguments":{"memo":%q,"amount":5}}}`, id, argMarker+"-"+name)
			}
			keyBody := func(id int) string {
				return fmt.Sprintf(`{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"refund","arguments":{"memo":%q},"_meta":{"idempotency-key":%q}}}`, id, argMarker+"-"+name, keyMarker+"-meta-"+name)
			}
			type call struct {
				caller http.Header
				body   string
				replay bool
			}
			for i, c := range []call{
				{alice, callBody(1), false},
				{alice, callBody(2), true}, // alice's retry: replayed
				{bob, callBody(3), false},  // bob, same arguments: his own call
				{withKey(alice), callBody(4), false},
				{withKey(bob), callBody(5), false}, // same Idempotency-Key: his own
				{alice, keyBody(6), false},
				{bob, keyBody(7), false}, // same _meta key: his own
				{alice, keyBody(8), true},
			} {
				resp, r := post(t, sc.url, c.body, c.caller)
				if r.Error != nil || len(r.Result) == 0 {
					t.Fatalf("call %d: HTTP %d, error %+v", i, resp.StatusCode, r.Error)
				}
				if got := resp.Header.Get("Idempotent-Replayed") == "true"; got != c.replay {
					t.Errorf("call %d (%s): replayed = %v, want %v", i, c.caller.Get("Authorization"), got, c.replay)
				}
			}
			if n := up.calls.Load(); n != 6 {
				t.Errorf("the server ran %d calls, want 6: one per caller and key", n)
			}
			scrape, err := http.Get("http://" + sc.admin + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			metrics, _ := io.ReadAll(scrape.Body)
			_ = scrape.Body.Close()
			if !strings.Contains(string(metrics), `idemcp_tool_calls_total{outcome="replayed"} 2`) {
				t.Errorf("/metrics does not count the 2 replays:\n%s", grepLines(string(metrics), "idemcp_tool_calls_total"))
			}
			assertNoMarkers(t, "/metrics", string(metrics))
		})
	}
	// Everything in Redis: key names and every value, whatever its type.
	rdb := goredis.NewClient(&goredis.Options{Addr: srv.Addr})
	defer func() { _ = rdb.Close() }()
	ctx := context.Background()
	keys, err := rdb.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) < 6 {
		t.Fatalf("Redis holds %d keys, want at least the 6 results", len(keys))
	}
	var dump strings.Builder
	for _, k := range keys {
		dump.WriteString(k + "\n")
		switch typ := rdb.Type(ctx, k).Val(); typ {
		case "string":
			dump.WriteString(rdb.Get(ctx, k).Val())
		case "hash":
			for f, v := range rdb.HGetAll(ctx, k).Val() {
				dump.WriteString(f + "=" + v + "\n")
			}
		default:
			t.Errorf("key %s is a %s; the scan does not read it", k, typ)
		}
		// The key name is the prefix and a sha256 hex digest.
		if i := strings.LastIndexByte(k, ':'); i < 0 || len(k)-i-1 != 64 {
			t.Errorf("key %q does not end in a 64-digit hash", k)
		}
	}
	if !strings.Contains(dump.String(), "charged") {
		t.Fatalf("the Redis scan read no stored result (%d keys): the scan is broken", len(keys))
	}
	assertNoMarkers(t, "Redis", dump.String())
	for _, sc := range logs {
		if !strings.Contains(sc.stderr.String(), `"level":"DEBUG"`) && !strings.Contains(sc.stderr.String(), `"level":"INFO"`) {
			t.Errorf("the sidecar logged nothing: the log scan is broken")
		}
		assertNoMarkers(t, "the sidecar's log", sc.stderr.String())
	}
}

func assertNoMarkers(t *testing.T, where, s string) {
	t.Helper()
	for _, m := range []string{argMarker, keyMarker, authMarker} {
		if i := strings.Index(s, m); i >= 0 {
			t.Errorf("%s holds %q: ...%s...", where, m, s[max(0, i-80):min(len(s), i+80)])
		}
	}
}

func grepLines(s, substr string) string {
	var out []string
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		if strings.Contains(sc.Text(), substr) {
			out = append(out, sc.Text())
		}
	}
	return strings.Join(out, "\n")
}

// The admin listener (/metrics, /healthz) binds only where configured: on
// the loopback address given, not on every interface, and the proxy's own
// port never serves it; with --admin-listen "" nothing but the proxy
// listens.
func TestAdminListenerBindsOnlyWhereConfigured(t *testing.T) {
	up := newRawUpstream(t, `{"content":[]}`, false, 0)
	sc := startSidecarProc(t, up.URL, "--store", "memory")
	socks := listeningSockets(t, sc.pid)
	_, adminPort, _ := net.SplitHostPort(sc.admin)
	_, proxyPort, _ := net.SplitHostPort(strings.TrimPrefix(sc.url, "http://"))
	want := map[string]bool{"127.0.0.1:" + adminPort: true, "127.0.0.1:" + proxyPort: true}
	if len(socks) != 2 || !want[socks[0]] || !want[socks[1]] {
		t.Errorf("the sidecar listens on %v, want exactly the proxy and the admin address on loopback %v", socks, want)
	}
	resp, err := http.Get(sc.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if strings.Contains(string(b), "idemcp_") {
		t.Error("the proxy's port serves the sidecar's metrics")
	}

	off := startSidecarProcNoAdmin(t, up.URL)
	if socks := listeningSockets(t, off); len(socks) != 1 {
		t.Errorf("with --admin-listen \"\" the sidecar listens on %v, want the proxy alone", socks)
	}
}

func startSidecarProcNoAdmin(t *testing.T, upstream string) int {
	t.Helper()
	bins := buildWrapBins(t)
	addr := freeAddr(t)
	proc := procs.New(procs.Spec{
		Name: "the sidecar", Path: bins.idemcp,
		Args:  []string{"sidecar", "--listen", addr, "--admin-listen", "", "--upstream", upstream, "--store", "memory", "--log-level", "error"},
		Env:   append(os.Environ(), "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0")),
		Ready: procs.Listening(addr), ReadyTimeout: 20 * time.Second, StopSignal: syscall.SIGINT,
	})
	if err := proc.Start(); err != nil {
		t.Fatalf("the sidecar never listened on %s: %v", addr, err)
	}
	t.Cleanup(proc.Stop)
	return proc.PID()
}

// listeningSockets lists the TCP addresses process pid listens on, from
// /proc: its socket inodes matched against /proc/net/tcp{,6} in LISTEN.
func listeningSockets(t *testing.T, pid int) []string {
	t.Helper()
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatalf("reading the sidecar's fds: %v", err)
	}
	inodes := map[string]bool{}
	for _, fd := range fds {
		l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if err == nil && strings.HasPrefix(l, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	var out []string
	for _, file := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, file))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			f := strings.Fields(line)
			if len(f) < 10 || f[3] != "0A" || !inodes[f[9]] { // 0A: LISTEN
				continue
			}
			out = append(out, procAddr(t, f[1]))
		}
	}
	return out
}

// procAddr decodes /proc/net/tcp's "0100007F:1F90" (IPv4, little-endian
// words) or its IPv6 form into host:port.
func procAddr(t *testing.T, s string) string {
	host, port, _ := strings.Cut(s, ":")
	p, _ := strconv.ParseUint(port, 16, 16)
	var ip net.IP
	for i := 0; i+8 <= len(host); i += 8 {
		w, err := strconv.ParseUint(host[i:i+8], 16, 32)
		if err != nil {
			t.Fatalf("bad /proc address %q", s)
		}
		ip = append(ip, byte(w), byte(w>>8), byte(w>>16), byte(w>>24))
	}
	if v4 := ip.To4(); v4 != nil {
		ip = v4
	}
	return net.JoinHostPort(ip.String(), strconv.FormatUint(p, 10))
}

// Principal isolation over legacy HTTP+SSE: two principals with the same
// arguments and the same explicit key each run their own call (under
// Principal scope), and neither's stream carries the other's result.
func TestLegacySSEPrincipalIsolation(t *testing.T) {
	h := newLegacyHarness(t, "spec: {keyScope: Principal, defaultMode: Deduplicate}")
	alice := h.connect(t, h.proxy.URL, http.Header{"Authorization": {"Bearer alice"}})
	alice2 := h.connect(t, h.proxy.URL, http.Header{"Authorization": {"Bearer alice"}})
	bob := h.connect(t, h.proxy.URL, http.Header{"Authorization": {"Bearer bob"}})
	args := map[string]any{"card": "4242", "amount": 10}
	key := mcp.Meta{"idempotency-key": "legacy-shared-key"}
	for _, tt := range []struct {
		name string
		meta mcp.Meta
		tool string
	}{{"derived key", nil, "charge_card"}, {"explicit key", key, "refund"}} {
		a := mustCall(t, alice, tt.tool, args, tt.meta)
		if !replayed(mustCall(t, alice2, tt.tool, args, tt.meta)) {
			t.Errorf("%s: alice's retry in another session was not replayed", tt.name)
		}
		b := mustCall(t, bob, tt.tool, args, tt.meta)
		if replayed(b) || body(t, a) == body(t, b) {
			t.Errorf("%s: bob got alice's result (replayed=%v): %s", tt.name, replayed(b), body(t, b))
		}
		if n := h.srv.Counts.Get(tt.tool); n != 2 {
			t.Errorf("%s: %s ran %d times, want 2 (alice once, bob once)", tt.name, tt.tool, n)
		}
	}
}
