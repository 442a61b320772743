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
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
)

const chargeCall = `{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"charge_card","arguments":{"amount":5}}}`

// dedupProxy puts a proxy with the memory store in front of upstream, under
// policyYAML (the defaults if empty).
func dedupProxy(t testing.TB, upstream http.Handler, policyYAML string, o Options) (*httptest.Server, *engine.Engine) {
	t.Helper()
	up := httptest.NewServer(upstream)
	t.Cleanup(up.Close)
	pol := policy.Default()
	if policyYAML != "" {
		var err error
		if pol, err = policy.Parse([]byte(policyYAML)); err != nil {
			t.Fatal(err)
		}
	}
	e := engine.New(engine.Options{Store: store.NewMemory(100), Policy: pol})
	o.Upstream, _ = url.Parse(up.URL)
	o.Engine = e
	proxy := httptest.NewServer(New(o))
	t.Cleanup(proxy.Close)
	return proxy, e
}

// postCall sends charge_card with id as a caller with a principal, and
// returns the response, its whole body and the error reading it.
func postCall(t *testing.T, base string, id int) (*http.Response, string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base, strings.NewReader(fmt.Sprintf(chargeCall, id)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Authorization", "Bearer caller-a")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	defer func() { _ = resp.Body.Close() }()
	data, err := io.ReadAll(resp.Body)
	return resp, string(data), err
}

func drain(t *testing.T, e *engine.Engine) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.Drain(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestJSONResponseToAnotherIDIsNotStored: a JSON response whose id is not
// the request's is relayed as is, and is not that call's outcome: the
// retry runs again instead of getting it replayed as its own.
func TestJSONResponseToAnotherIDIsNotStored(t *testing.T) {
	var hits atomic.Int32
	proxy, e := dedupProxy(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"jsonrpc":"2.0","id":12345,"result":{"content":[{"type":"text","text":"someone else's"}]}}`)
	}), "", Options{})
	for i := range 2 {
		resp, body, err := postCall(t, proxy.URL, 1)
		if err != nil || resp.Header.Get(HeaderReplayed) != "" || !strings.Contains(body, `"id":12345`) {
			t.Fatalf("call %d: %v, replayed=%q, body %s; want the server's response relayed as is", i+1, err, resp.Header.Get(HeaderReplayed), body)
		}
		drain(t, e)
	}
	if n := hits.Load(); n != 2 {
		t.Fatalf("the server was called %d times, want 2: a response to id 12345 is not the outcome of call 1", n)
	}
}

// TestUpstreamAbortReachesTheClient: when the server's response breaks off
// mid-message, the client's does too, instead of ending cleanly with a
// truncated body; and the call is not stored.
func TestUpstreamAbortReachesTheClient(t *testing.T) {
	for _, tc := range []struct{ name, contentType, partial string }{
		{"sse", "text/event-stream", "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"res"},
		{"json", "application/json", `{"jsonrpc":"2.0","id":1,"res`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var hits atomic.Int32
			proxy, e := dedupProxy(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				hits.Add(1)
				w.Header().Set("Content-Type", tc.contentType)
				w.WriteHeader(http.StatusOK)
				_, _ = io.WriteString(w, tc.partial)
				_ = http.NewResponseController(w).Flush()
				panic(http.ErrAbortHandler)
			}), "", Options{})
			for i := range 2 {
				resp, body, err := postCall(t, proxy.URL, 1)
				if err == nil {
					t.Fatalf("call %d: status %d and a clean end after %q; want the abort the server made", i+1, resp.StatusCode, body)
				}
				// Whole events arrive as they are; what the SSE reader drops of
				// a torn event is up to it (mcpmsg.EventReader).
				if body != tc.partial && (tc.name == "json" || !strings.HasPrefix(tc.partial, body)) {
					t.Errorf("call %d: the client got %q before the abort, want the server's %q", i+1, body, tc.partial)
				}
				drain(t, e)
			}
			if n := hits.Load(); n != 2 {
				t.Fatalf("the server was called %d times, want 2: an aborted call is not stored", n)
			}
		})
	}
}

// TestStreamIsRelayedWhole: the client gets every byte the server sent,
// events after the response included, whether the server frames its
// response with chunks or with a Content-Length; and the call is stored.
func TestStreamIsRelayedWhole(t *testing.T) {
	stream := "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progressToken\":1,\"progress\":1}}\n\n" +
		"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"content\":[{\"type\":\"text\",\"text\":\"charged\"}]}}\n\n" +
		"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{\"level\":\"info\",\"data\":\"after the response\"}}\n\n" +
		": bye\n\n"
	for _, framing := range []string{"chunked", "content-length"} {
		t.Run(framing, func(t *testing.T) {
			var hits atomic.Int32
			proxy, e := dedupProxy(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				hits.Add(1)
				w.Header().Set("Content-Type", "text/event-stream")
				if framing == "content-length" {
					w.Header().Set("Content-Length", strconv.Itoa(len(stream)))
				}
				w.WriteHeader(http.StatusOK)
				for _, part := range strings.SplitAfter(stream, "\n\n") {
					_, _ = io.WriteString(w, part)
					_ = http.NewResponseController(w).Flush()
					time.Sleep(5 * time.Millisecond)
				}
			}), "", Options{})
			resp, body, err := postCall(t, proxy.URL, 1)
			if err != nil || resp.StatusCode != http.StatusOK || body != stream {
				t.Fatalf("status %d, read error %v, body:\n%q\nwant the server's stream exactly:\n%q", resp.StatusCode, err, body, stream)
			}
			drain(t, e)
			resp, body, err = postCall(t, proxy.URL, 2)
			if err != nil || resp.Header.Get(HeaderReplayed) != "true" || !strings.Contains(body, `"id":2`) {
				t.Fatalf("retry: %v, replayed=%q, body %s; want a replay", err, resp.Header.Get(HeaderReplayed), body)
			}
			if n := hits.Load(); n != 1 {
				t.Fatalf("the server was called %d times, want 1", n)
			}
		})
	}
}

// TestClientThatStopsReadingIsDetached: a client that keeps its connection
// open but reads nothing does not hold the call: once a write to it stalls
// past ClientWriteTimeout it is detached, the call goes on, its response is
// stored and a retry gets it.
func TestClientThatStopsReadingIsDetached(t *testing.T) {
	var hits atomic.Int32
	finished := make(chan struct{})
	note := fmt.Sprintf(`{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","data":%q}}`, strings.Repeat("x", 4000))
	proxy, e := dedupProxy(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits.Add(1) > 1 {
			http.Error(w, "ran twice", http.StatusInternalServerError)
			return
		}
		defer close(finished)
		w.Header().Set("Content-Type", "text/event-stream")
		bw := bufio.NewWriter(w)
		for range 2500 { // 10 MB: more than the socket buffers hold
			_, _ = bw.Write(mcpmsg.AppendEvent(nil, []byte(note)))
		}
		_, _ = bw.Write(mcpmsg.AppendEvent(nil, []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"charged"}]}}`)))
		_ = bw.Flush()
	}), "", Options{ClientWriteTimeout: 300 * time.Millisecond})

	conn, err := net.Dial("tcp", strings.TrimPrefix(proxy.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_ = conn.(*net.TCPConn).SetReadBuffer(4096)
	body := fmt.Sprintf(chargeCall, 1)
	_, err = fmt.Fprintf(conn, "POST / HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"+
		"Authorization: Bearer caller-a\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-finished:
	case <-time.After(20 * time.Second):
		t.Fatal("the server could not finish its response: the client that stopped reading holds the call")
	}
	resp, data, err := postCall(t, proxy.URL, 2)
	if err != nil || resp.Header.Get(HeaderReplayed) != "true" || !strings.Contains(data, `"charged"`) {
		t.Fatalf("retry: %v, status %d, replayed=%q, body %.200s; want the stored result", err, resp.StatusCode, resp.Header.Get(HeaderReplayed), data)
	}
	if n := hits.Load(); n != 1 {
		t.Fatalf("the server was called %d times, want 1", n)
	}
	drain(t, e)
}

// pollingUpstream answers a call with a priming event and closes the
// stream (SEP-1699); a GET resuming from that event gets resumeStatus, and
// with 200 the response.
type pollingUpstream struct {
	hits, gets   atomic.Int32
	resumeStatus int
}

func (u *pollingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodPost:
		var m struct {
			ID json.RawMessage `json:"id"`
		}
		_ = json.NewDecoder(r.Body).Decode(&m)
		n := u.hits.Add(1)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = fmt.Fprintf(w, "id: call-%d-%s\nretry: 50\ndata: \n\n", n, m.ID)
	case http.MethodGet:
		u.gets.Add(1)
		if u.resumeStatus != http.StatusOK {
			http.Error(w, "no such stream", u.resumeStatus)
			return
		}
		id := strings.TrimPrefix(r.Header.Get("Last-Event-ID"), "call-")
		_, id, _ = strings.Cut(id, "-")
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = fmt.Fprintf(w, "id: next\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":%s,\"result\":{\"content\":[{\"type\":\"text\",\"text\":\"charged\"}]}}\n\n", id)
	}
}

// TestPendingCallIsResumedBySidecar: a client that does not resume a
// polled stream still gets the call stored: the sidecar resumes it with
// Last-Event-ID and keeps the response for the retry.
func TestPendingCallIsResumedBySidecar(t *testing.T) {
	u := &pollingUpstream{resumeStatus: http.StatusOK}
	proxy, e := dedupProxy(t, u, "", Options{ResumeGrace: 100 * time.Millisecond})
	if _, body, err := postCall(t, proxy.URL, 1); err != nil || !strings.Contains(body, "id: call-1-1") {
		t.Fatalf("first call: %v, body %q; want the priming event", err, body)
	}
	resp, body, err := postCall(t, proxy.URL, 2)
	if err != nil || resp.Header.Get(HeaderReplayed) != "true" || !strings.Contains(body, `"charged"`) || !strings.Contains(body, `"id":2`) {
		t.Fatalf("retry: %v, replayed=%q, body %s; want the response the sidecar resumed, replayed", err, resp.Header.Get(HeaderReplayed), body)
	}
	if h, g := u.hits.Load(), u.gets.Load(); h != 1 || g != 1 {
		t.Fatalf("the server ran the call %d times and was resumed %d times, want 1 and 1", h, g)
	}
	drain(t, e)
}

// TestPendingCallThatCannotBeResumedIsAbandoned: when the server refuses
// to resume the stream, the outcome is unknown: the key is not released (a
// retry would run the call again at once), the claim lapses with its
// lease, and onAbandoned decides.
func TestPendingCallThatCannotBeResumedIsAbandoned(t *testing.T) {
	for _, tc := range []struct {
		onAbandoned string
		wantHits    int32
	}{{"Error", 1}, {"Retry", 2}} {
		t.Run(tc.onAbandoned, func(t *testing.T) {
			u := &pollingUpstream{resumeStatus: http.StatusNotFound}
			proxy, e := dedupProxy(t, u, "spec: {leaseDuration: 1s, waitTimeout: 5s, onAbandoned: "+tc.onAbandoned+"}",
				Options{ResumeGrace: 50 * time.Millisecond})
			if _, _, err := postCall(t, proxy.URL, 1); err != nil {
				t.Fatal(err)
			}
			_, body, err := postCall(t, proxy.URL, 2)
			if err != nil {
				t.Fatal(err)
			}
			if tc.onAbandoned == "Error" && !strings.Contains(body, strconv.Itoa(mcpmsg.CodeOutcomeUnknown)) {
				t.Errorf("retry got %s; want outcome unknown (%d)", body, mcpmsg.CodeOutcomeUnknown)
			}
			if n := u.hits.Load(); n != tc.wantHits {
				t.Errorf("the server ran the call %d times, want %d", n, tc.wantHits)
			}
			drain(t, e)
		})
	}
}

func TestEventFields(t *testing.T) {
	for _, tc := range []struct {
		raw      string
		id       string
		hasID    bool
		retry    time.Duration
		hasRetry bool
	}{
		{"id: 7\ndata: x\n\n", "7", true, 0, false},
		{"id:7\r\nretry: 300\r\n\r\n", "7", true, 300 * time.Millisecond, true},
		{"id\ndata: x\n\n", "", true, 0, false},
		{"id: a\x00b\nretry: 1x\n\n", "", false, 0, false},
		{": id: 9\ndata: x\n\n", "", false, 0, false},
		{"data: id: 9\n\n", "", false, 0, false},
	} {
		id, hasID, retry, hasRetry := eventFields([]byte(tc.raw))
		if id != tc.id || hasID != tc.hasID || retry != tc.retry || hasRetry != tc.hasRetry {
			t.Errorf("eventFields(%q) = %q %v %v %v, want %q %v %v %v", tc.raw, id, hasID, retry, hasRetry, tc.id, tc.hasID, tc.retry, tc.hasRetry)
		}
	}
}
