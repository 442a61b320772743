package httpproxy

import (
	"bytes"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strings"
	"sync"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// maxToolsListBytes bounds how much of a tools/list response is kept to
// learn readOnlyHint from; a larger list is still forwarded whole.
const maxToolsListBytes = 8 << 20

// Bounds on what the taps hold together. Each tools/list response that
// passes through is copied while it streams by, and every client may ask
// for one as often as it likes: without a bound, a client sending
// thousands of tools/list requests at once (and reading their answers
// slowly) would make the sidecar hold thousands of copies of the list. A
// tap over a bound stops copying and its response is forwarded whole, as
// one over maxToolsListBytes is; it only teaches Auto nothing, which the
// sidecar's own listing does anyway. Counted in
// idemcp_over_limit_total{limit="tools_list_buffers"}.
const (
	maxTapBytes             = 32 << 20 // copied, for all clients together
	maxTapBytesPerPrincipal = 8 << 20  // copied, for one principal (callers with no principal count as one)
	maxTapLearners          = 4        // copies decoded and learned from at once
	maxTapLearnersPerTenant = 1        // of those, for one principal
)

// tapBudget counts what the taps hold.
type tapBudget struct {
	mu       sync.Mutex
	byTenant map[string]int64
	total    int64
	learners int
	learning map[string]int // learners by tenant
}

// take reserves n more bytes for tenant's tap, or reports that a bound is
// reached.
func (b *tapBudget) take(tenant string, n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.total+n > maxTapBytes || b.byTenant[tenant]+n > maxTapBytesPerPrincipal {
		return false
	}
	if b.byTenant == nil {
		b.byTenant = make(map[string]int64)
	}
	b.byTenant[tenant] += n
	b.total += n
	return true
}

func (b *tapBudget) give(tenant string, n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.byTenant[tenant] -= n; b.byTenant[tenant] <= 0 {
		delete(b.byTenant, tenant)
	}
	b.total -= n
}

func (b *tapBudget) learner(tenant string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.learners >= maxTapLearners || b.learning[tenant] >= maxTapLearnersPerTenant {
		return false
	}
	if b.learning == nil {
		b.learning = make(map[string]int)
	}
	b.learners++
	b.learning[tenant]++
	return true
}

func (b *tapBudget) learned(tenant string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.learners--
	if b.learning[tenant]--; b.learning[tenant] <= 0 {
		delete(b.learning, tenant)
	}
}

// Held reports the bytes the taps hold, for tests.
func (p *Proxy) tapHeld() int64 {
	p.taps.mu.Lock()
	defer p.taps.mu.Unlock()
	return p.taps.total
}

// modifyResponse is the passthrough path's ReverseProxy.ModifyResponse.
func (p *Proxy) modifyResponse(resp *http.Response) error {
	closeIfBodyUnread(resp.Request.Context(), resp.StatusCode, resp.Header)
	p.rememberClient(resp)
	return p.tapToolsList(resp)
}

// tapToolsList lets tools/list responses teach the engine each tool's
// annotations as they stream by, for defaultMode: Auto, when their request
// went to the MCP endpoint the sidecar is configured with.
func (p *Proxy) tapToolsList(resp *http.Response) error {
	if v, _ := resp.Request.Context().Value(toolsListKey).(bool); !v || resp.StatusCode != http.StatusOK || !p.atToolsListEndpoint(resp.Request) {
		return nil
	}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	resp.Body = &tap{ReadCloser: resp.Body, sse: mt == "text/event-stream", encoding: resp.Header.Values("Content-Encoding"),
		observe: p.observeToolsList, budget: &p.taps, tenant: engine.Tenant(resp.Request.Header.Get(p.engine.Policy().PrincipalHeader)),
		over: func() { p.engine.Metrics().OverLimit.WithLabelValues(engine.LimitToolsListBuffers).Inc() }}
	return nil
}

// atToolsListEndpoint reports whether out, a request to the upstream, went
// where the sidecar's own listing goes: the configured path (a trailing
// slash aside), no query of the client's, and the configured Host when
// there is one. Hints are one map for the whole server, so a listing of
// another path or virtual host of it (a sandbox, another tenant, where a
// tool of the same name may be marked idempotent) must not teach Auto:
// it would turn dedup off for everyone's calls.
func (p *Proxy) atToolsListEndpoint(out *http.Request) bool {
	want := (&url.URL{Path: p.opts.ToolsListPath}).EscapedPath()
	if strings.TrimSuffix(out.URL.EscapedPath(), "/") != strings.TrimSuffix(want, "/") {
		return false
	}
	if out.URL.RawQuery != p.opts.Upstream.RawQuery {
		return false
	}
	return p.opts.ToolsListHost == "" || strings.EqualFold(out.Host, p.opts.ToolsListHost)
}

func (p *Proxy) observeToolsList(msg []byte) {
	if m, err := mcpmsg.Parse(msg); err == nil && len(m.Result) > 0 {
		p.engine.Hints().ObserveListResult(m.Result)
	}
}

type tap struct {
	io.ReadCloser
	sse      bool
	encoding []string // the response's Content-Encoding: the client gets it as sent, the tap reads it decoded
	buf      bytes.Buffer
	overflow bool
	finished bool
	observe  func([]byte)

	budget *tapBudget
	tenant string
	held   int64 // bytes taken from budget
	over   func()
}

func (t *tap) Read(b []byte) (int, error) {
	n, err := t.ReadCloser.Read(b)
	if !t.overflow && n > 0 {
		switch {
		case t.buf.Len()+n > maxToolsListBytes:
			t.stopCopying()
		case !t.budget.take(t.tenant, int64(n)):
			t.stopCopying()
			t.over()
		default:
			t.held += int64(n)
			t.buf.Write(b[:n])
		}
	}
	if err != nil {
		t.finish()
	}
	return n, err
}

func (t *tap) Close() error {
	t.finish()
	return t.ReadCloser.Close()
}

// stopCopying drops the copy: the response is forwarded whole, and
// teaches nothing.
func (t *tap) stopCopying() {
	t.overflow = true
	t.buf = bytes.Buffer{}
	t.budget.give(t.tenant, t.held)
	t.held = 0
}

func (t *tap) finish() {
	if t.finished || t.overflow {
		return
	}
	t.finished = true
	if !t.budget.learner(t.tenant) {
		t.stopCopying()
		t.over()
		return
	}
	// Learn off the response's path: the client is not kept waiting.
	buf, sse, encoding, observe := t.buf.Bytes(), t.sse, t.encoding, t.observe
	budget, tenant, held := t.budget, t.tenant, t.held
	t.buf, t.held = bytes.Buffer{}, 0
	go func() {
		defer budget.learned(tenant)
		defer budget.give(tenant, held)
		if len(encoding) > 0 {
			var over bool
			if buf, over = decodeAll(buf, encoding, maxToolsListBytes); over {
				return
			}
		}
		if !sse {
			observe(buf)
			return
		}
		er := mcpmsg.NewEventReader(bytes.NewReader(buf), maxToolsListBytes)
		defer er.Release()
		for {
			ev, err := er.Next()
			if err == nil && ev.HasData {
				observe(ev.Data)
			}
			if err != nil {
				return // io.EOF, or a torn stream: learn from what arrived
			}
		}
	}()
}
