package sidecar

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/test/poll"
)

// TestHostileCallers: one client starts deduplicated calls against a slow
// tool and hangs up on each, as fast as it can, first under one principal
// and then under a new one each time. Each call goes on upstream after its
// client left (design rule 3), so only --max-running-per-principal and
// --max-running keep the sidecar from holding them all. The test shows
// that the calls running upstream, the sidecar's open files and its RSS
// stay within those bounds, that the refusals are counted, that another
// principal's calls are served while the flood is under one principal and
// its replays while the flood takes the sidecar's total, and that every
// call that did run is stored for its retry.
func TestHostileCallers(t *testing.T) {
	if _, err := os.Stat("/proc/self/fd"); err != nil {
		t.Fatal("needs /proc to count the sidecar's open files")
	}
	const perPrincipal, total = 50, 150
	stop := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(stop) }) }
	t.Cleanup(release)
	var slow, peak atomic.Int32
	var mu sync.Mutex
	runs := map[string]int{} // by principal and request
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		runs[r.Header.Get("Authorization")+" "+string(body)]++
		mu.Unlock()
		if strings.HasPrefix(r.Header.Get("Authorization"), "Bearer mallory") {
			n := slow.Add(1)
			for {
				p := peak.Load()
				if n <= p || peak.CompareAndSwap(p, n) {
					break
				}
			}
			<-stop
			slow.Add(-1)
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = fmt.Fprintf(w, `{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"ran %x"}]}}`, len(body))
	}))
	t.Cleanup(up.Close)
	p := startSidecarProcess(t, up.URL,
		"--policy", "apiVersion: idemcp.io/v1alpha1\nkind: IdempotencyPolicy\nmetadata: {name: p, namespace: ns}\nspec: {defaultMode: Deduplicate, keyScope: Principal}\n",
		"--max-running-per-principal", strconv.Itoa(perPrincipal), "--max-running", strconv.Itoa(total))

	call := func(c *http.Client, principal, args string) (int, string, error) {
		req, _ := http.NewRequest(http.MethodPost, "http://"+p.proxy+"/mcp", strings.NewReader(
			`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":`+args+`}}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer "+principal)
		resp, err := c.Do(req)
		if err != nil {
			return 0, "", err
		}
		b, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode, string(b), err
	}
	metric := func(name string) int {
		t.Helper()
		resp, err := otherClient.Get("http://" + p.admin + "/metrics")
		if err != nil {
			t.Fatalf("/metrics: %v", err)
		}
		b, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\d+)`).FindSubmatch(b)
		if m == nil {
			return 0
		}
		n, _ := strconv.Atoi(string(m[1]))
		return n
	}
	// Alice's first call, before the flood: its retries are replays.
	if status, body, err := call(otherClient, "alice", `{"order":0}`); err != nil || status != 200 || !strings.Contains(body, "ran") {
		t.Fatalf("alice's call before the flood: %d %s %v", status, body, err)
	}
	base, baseRSS := p.openFiles(t), p.rssMiB(t)

	// The flood: each call is given up on after 500ms, by which time it
	// runs upstream or was refused.
	hangUp := &http.Client{Timeout: 500 * time.Millisecond}
	var refused, left atomic.Int32
	flood := func(n int, principal func(i int) string) {
		var wg sync.WaitGroup
		next := make(chan int)
		for range 32 {
			wg.Go(func() {
				for i := range next {
					_, body, err := call(hangUp, principal(i), fmt.Sprintf(`{"spam":%d}`, i))
					switch {
					case err != nil:
						left.Add(1)
					case strings.Contains(body, "-32017"):
						refused.Add(1)
					}
				}
			})
		}
		for i := range n {
			next <- i
		}
		close(next)
		wg.Wait()
	}
	check := func(phase string, bound int) {
		t.Helper()
		running := metric("idemcp_calls_running")
		files, rss := p.openFiles(t), p.rssMiB(t)
		t.Logf("%s: %d calls left running upstream (peak %d), %d refused with -32017, %d given up; sidecar reports %d running; open files %d (before %d), RSS %d MiB (before %d)",
			phase, slow.Load(), peak.Load(), refused.Load(), left.Load(), running, files, base, rss, baseRSS)
		if n := int(peak.Load()); n > bound {
			t.Errorf("%s: %d of the flood's calls ran upstream at once, want at most %d", phase, n, bound)
		}
		if running > bound {
			t.Errorf("%s: the sidecar has %d calls running, want at most %d", phase, running, bound)
		}
		// A connection to the MCP server per running call, and the
		// flood's own 32 connections.
		if limit := base + bound + 32 + 32; files > limit {
			t.Errorf("%s: the sidecar holds %d open files, want at most %d", phase, files, limit)
		}
		if limit := baseRSS + 16 + bound*runningCallKiB/1024; rss > limit {
			t.Errorf("%s: the sidecar's RSS grew from %d MiB to %d MiB, want at most %d MiB (%d KiB per running call)", phase, baseRSS, rss, limit, runningCallKiB)
		}
	}

	flood(1000, func(int) string { return "mallory" })
	check("one principal", perPrincipal)
	if refused.Load() == 0 {
		t.Error("no call of the flood was refused")
	}
	if n := metric(`idemcp_over_limit_total{limit="running_per_principal"}`); n == 0 {
		t.Error(`idemcp_over_limit_total{limit="running_per_principal"} is 0`)
	}
	// Another principal is served meanwhile: a new call runs.
	if status, body, err := call(otherClient, "alice", `{"order":1}`); err != nil || status != 200 || !strings.Contains(body, "ran") || strings.Contains(body, "replayed") {
		t.Fatalf("alice's new call during the flood: %d %s %v", status, body, err)
	}

	// A new principal for each call: the sidecar's total holds.
	refused.Store(0)
	left.Store(0)
	flood(1000, func(i int) string { return "mallory-" + strconv.Itoa(i) })
	check("a principal per call", total)
	if n := metric(`idemcp_over_limit_total{limit="running_total"}`); n == 0 {
		t.Error(`idemcp_over_limit_total{limit="running_total"} is 0`)
	}
	// With the total taken, new calls are refused for everyone; a retry
	// of a stored call still gets its result.
	if status, body, err := call(otherClient, "alice", `{"order":0}`); err != nil || status != 200 || !strings.Contains(body, `"idemcp.io/replayed":true`) {
		t.Fatalf("alice's retry during the flood: %d %s %v", status, body, err)
	}

	// The calls end upstream and are stored: a retry of one of
	// mallory's is a replay, and nothing ran twice.
	release()
	poll.Within(t, 20*time.Second, "no call running after the tool answered", func() error {
		if n := metric("idemcp_calls_running"); n != 0 {
			return fmt.Errorf("%v calls still running", n)
		}
		return nil
	})
	replays := 0
	for i := range 1000 {
		status, body, err := call(otherClient, "mallory", fmt.Sprintf(`{"spam":%d}`, i))
		if err != nil || status != 200 || !strings.Contains(body, "ran") {
			t.Fatalf("mallory's retry %d after the flood: %d %s %v", i, status, body, err)
		}
		if strings.Contains(body, `"idemcp.io/replayed":true`) {
			replays++
		}
	}
	if replays != perPrincipal {
		t.Errorf("%d of mallory's retries were replays, want the %d calls that ran during the flood", replays, perPrincipal)
	}
	mu.Lock()
	defer mu.Unlock()
	for req, n := range runs {
		if n > 1 {
			t.Errorf("ran %d times: %s", n, req)
		}
	}
}
