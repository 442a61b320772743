package httpproxy

import (
	"bytes"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strings"

	"github.com/idemcp/idemcp/sidecar/mcpmsg"
)

// maxToolsListBytes bounds how much of a tools/list response is kept to
// learn readOnlyHint from; a larger list is still forwarded whole.
const maxToolsListBytes = 8 << 20

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
		observe: p.observeToolsList}
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
}

func (t *tap) Read(b []byte) (int, error) {
	n, err := t.ReadCloser.Read(b)
	if !t.overflow {
		if t.buf.Len()+n > maxToolsListBytes {
			t.overflow = true
			t.buf = bytes.Buffer{}
		} else {
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

func (t *tap) finish() {
	if t.finished || t.overflow {
		return
	}
	t.finished = true
	// Learn off the response's path: the client is not kept waiting.
	buf, sse, encoding, observe := t.buf.Bytes(), t.sse, t.encoding, t.observe
	go func() {
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
