package httpproxy

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// nextRaw returns the next message on the stream, undecoded.
func (c *legacyTestClient) nextRaw() (*mcpmsg.Message, string) {
	c.t.Helper()
	select {
	case ev, ok := <-c.events:
		if !ok {
			c.t.Fatal("the stream ended")
		}
		m, err := mcpmsg.Parse(ev.Data)
		if err != nil {
			c.t.Fatalf("event %q: %v", ev.Raw, err)
		}
		return m, string(ev.Data)
	case <-time.After(5 * time.Second):
		c.t.Fatal("no event within 5s")
		return nil, ""
	}
}

// TestLegacyIDsBeyondDoublesStayApart: on legacy SSE, responses are routed
// to their calls by id. Two calls in flight whose ids differ only past 2^53
// must each store their own response, so that each retry replays its own.
func TestLegacyIDsBeyondDoublesStayApart(t *testing.T) {
	f, proxy := newLegacyTestProxy(t)
	c := openLegacy(t, proxy.URL)
	call := `{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"charge","arguments":{"card":%q,"delayMs":%d}}}`
	// The first call answers last, so the two are in flight together.
	c.post(fmt.Sprintf(call, "9007199254740992", "a", 300))
	c.post(fmt.Sprintf(call, "9007199254740993", "b", 50))
	got := map[string]string{}
	for range 2 {
		m, raw := c.nextRaw()
		got[string(m.ID)] = raw
	}
	run := func(raw string) string {
		i := strings.Index(raw, "run ")
		if i < 0 {
			return ""
		}
		return raw[i : i+5]
	}
	first, second := run(got["9007199254740992"]), run(got["9007199254740993"])
	if first == "" || second == "" || first == second {
		t.Fatalf("responses %v, want one run each", got)
	}
	for i, want := range []string{first, second} {
		c.post(fmt.Sprintf(call, fmt.Sprint(100+i), []string{"a", "b"}[i], []int{300, 50}[i]))
		m, raw := c.nextRaw()
		if string(m.ID) != fmt.Sprint(100+i) || run(raw) != want || !strings.Contains(raw, "idemcp.io/replayed") {
			t.Errorf("retry %d: %s, want the replay of %s", i, raw, want)
		}
	}
	if n := f.calls.Load(); n != 2 {
		t.Errorf("the server ran %d calls, want 2", n)
	}
}

// TestLegacyRefusesAmbiguousMessages: on legacy SSE a message the server
// could read another way is answered on the stream and never forwarded.
func TestLegacyRefusesAmbiguousMessages(t *testing.T) {
	f, proxy := newLegacyTestProxy(t)
	c := openLegacy(t, proxy.URL)
	for _, tc := range []struct {
		body string
		code int
	}{
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","arguments":{"card":"a"},"ARGUMENTS":{"card":"b"}}}`, mcpmsg.CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","name":"refund"}}`, mcpmsg.CodeInvalidParams},
		{`{"jsonrpc":"2.0","id":1,"method":"tools/call","Params":{"name":"refund"},"params":{"name":"charge"}}`, mcpmsg.CodeInvalidRequest},
	} {
		c.post(tc.body)
		m, raw := c.nextRaw()
		if len(m.Error) == 0 || !strings.Contains(raw, fmt.Sprintf(`"code":%d`, tc.code)) {
			t.Errorf("%s: got %s, want error %d", tc.body, raw, tc.code)
		}
	}
	if n := f.calls.Load(); n != 0 {
		t.Errorf("the server ran %d ambiguous calls", n)
	}
}
