package toollist

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strconv"
	"sync/atomic"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// maxPages bounds a listing against a server whose cursors never end.
const maxPages = 1000

// maxListBytes bounds one tools/list response read by the lister.
const maxListBytes = 8 << 20

// UserAgent marks the lister's own requests to the server.
const UserAgent = "idemcp-sidecar (tool listing)"

// listVersion is the protocol revision the lister's own session asks for:
// the newest one with sessions, which stateful and stateless servers both
// speak.
const listVersion = "2025-11-25"

// HTTP lists a Streamable HTTP server's tools. Where it lists is the
// sidecar's configuration, never a client's request: the upstream URL's
// path (or /mcp), with the Host given to NewHTTP (--upstream-host) or the
// upstream URL's. A client that could move the listing to another path or
// virtual host of the server (a sandbox where a tool of the same name is
// idempotent) would change what Auto believes, for every client.
type HTTP struct {
	client   *http.Client
	upstream *url.URL
	path     string
	host     string // "": the upstream URL's

	changed atomic.Pointer[func()]
	seq     atomic.Int64
}

// NewHTTP returns a lister transport for the server at upstream; its
// requests carry host as their Host ("": the upstream URL's). A server
// that allows only its public host names (against DNS rebinding) needs it.
func NewHTTP(client *http.Client, upstream *url.URL, host string) *HTTP {
	path := upstream.Path
	if path == "" || path == "/" {
		path = "/mcp"
	}
	return &HTTP{client: client, upstream: upstream, path: path, host: host}
}

// OnChanged sets what to do when a response through Watch carries a
// notifications/tools/list_changed.
func (h *HTTP) OnChanged(f func()) { h.changed.Store(&f) }

// target is where the lister's requests go: a URL, and the Host they
// carry ("": the URL's); header and value, when set, are a caller's
// credentials, for a listing in its context.
type target struct{ url, host, header, value string }

func (t target) String() string { return t.url }

func (h *HTTP) endpoint() target {
	u := *h.upstream
	u.Path, u.RawPath, u.RawQuery = h.path, "", ""
	return target{url: u.String(), host: h.host}
}

// Watch wraps the proxy's handler: responses are watched for
// notifications/tools/list_changed (on any stream, legacy included). A
// notification only makes the tools be listed again, at the configured
// endpoint.
func (h *HTTP) Watch(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		next.ServeHTTP(&watchWriter{ResponseWriter: w, h: h}, r)
	})
}

var listChanged = []byte(`"notifications/tools/list_changed"`)

// watchWriter looks for list_changed in what it writes, across writes.
type watchWriter struct {
	http.ResponseWriter
	h    *HTTP
	tail []byte
}

func (w *watchWriter) Write(b []byte) (int, error) {
	if len(w.tail) > 0 {
		joined := append(w.tail, b[:min(len(b), len(listChanged))]...)
		if bytes.Contains(joined, listChanged) {
			w.notify()
		}
	}
	if hasListChanged(b) {
		w.notify()
	}
	keep := min(len(b), len(listChanged)-1)
	w.tail = append(w.tail[:0], b[len(b)-keep:]...)
	return w.ResponseWriter.Write(b)
}

// hasListChanged is bytes.Contains(b, listChanged) found from its quotes:
// bytes.Index falls back to comparing at every byte once the first byte
// matches often, which a result full of escaped quotes makes it do, at
// about 1 ms for a 1 MiB replay.
func hasListChanged(b []byte) bool {
	for {
		i := bytes.IndexByte(b, '"')
		if i < 0 {
			return false
		}
		if bytes.HasPrefix(b[i:], listChanged) {
			return true
		}
		b = b[i+1:]
	}
}

func (w *watchWriter) notify() {
	if f := w.h.changed.Load(); f != nil {
		(*f)()
	}
}

func (w *watchWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the real writer.
func (w *watchWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// List does one listing on a session of its own: over Streamable HTTP,
// or, when the server refuses that as a legacy HTTP+SSE (2024-11-05)
// server does, over legacy SSE (legacy.go).
func (h *HTTP) List(ctx context.Context, hints *engine.ToolHints) error {
	err := h.listStreamable(ctx, hints, nil)
	if !errors.Is(err, errNotStreamable) {
		return err
	}
	if lerr := h.listLegacy(ctx, hints); lerr != nil {
		return fmt.Errorf("%w; over legacy SSE: %w", err, lerr)
	}
	return nil
}

// ListIn does one Streamable HTTP listing in a caller's context: its
// session is initialized with the capabilities the caller's client
// declared, and every request carries the caller's credentials, to the
// configured endpoint only (where the caller's own call goes). It runs
// nothing: initialize, tools/list, DELETE.
func (h *HTTP) ListIn(ctx context.Context, hints *engine.ToolHints, lc engine.ListingContext) error {
	return h.listStreamable(ctx, hints, &lc)
}

// listStreamable does one Streamable HTTP listing: initialize, then
// tools/list page by page with the session's id, then DELETE the session.
func (h *HTTP) listStreamable(ctx context.Context, hints *engine.ToolHints, lc *engine.ListingContext) error {
	endpoint := h.endpoint()
	caps := json.RawMessage(`{}`)
	if lc != nil {
		if len(lc.Capabilities) > 0 && lc.Capabilities[0] == '{' && json.Valid(lc.Capabilities) {
			caps = lc.Capabilities
		}
		if lc.Header != "" && lc.Value != "" {
			endpoint.header, endpoint.value = lc.Header, lc.Value
		}
	}
	init := fmt.Sprintf(`{"protocolVersion":%q,"capabilities":%s,"clientInfo":{"name":"idemcp","version":"1"}}`, listVersion, caps)
	res, hdr, err := h.call(ctx, endpoint, "initialize", json.RawMessage(init), "", "")
	var status *statusError
	if errors.As(err, &status) && (status.code == http.StatusBadRequest || status.code == http.StatusNotFound || status.code == http.StatusMethodNotAllowed) {
		return fmt.Errorf("initializing a session with %s: %w (HTTP %d)", endpoint, errNotStreamable, status.code)
	}
	if err != nil {
		return fmt.Errorf("initializing a session with %s: %w", endpoint, err)
	}
	session := hdr.Get("Mcp-Session-Id")
	version := listVersion
	var ir struct {
		ProtocolVersion string `json:"protocolVersion"`
	}
	if json.Unmarshal(res, &ir) == nil && ir.ProtocolVersion != "" {
		version = ir.ProtocolVersion
	}
	if session != "" {
		defer h.deleteSession(endpoint, session, version)
	}
	if err := h.notify(ctx, endpoint, "notifications/initialized", session, version); err != nil {
		return err
	}
	cursor := ""
	for range maxPages {
		params := json.RawMessage(`{}`)
		if cursor != "" {
			params, _ = json.Marshal(map[string]string{"cursor": cursor})
		}
		res, _, err := h.call(ctx, endpoint, "tools/list", params, session, version)
		if err != nil {
			return fmt.Errorf("tools/list at %s: %w", endpoint, err)
		}
		if cursor = hints.ObserveListResult(res); cursor == "" {
			return nil
		}
	}
	return fmt.Errorf("tools/list at %s: more than %d pages", endpoint, maxPages)
}

func (h *HTTP) newRequest(ctx context.Context, method string, endpoint target, body []byte, session, version string) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, method, endpoint.url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	if endpoint.host != "" {
		req.Host = endpoint.host
	}
	if endpoint.header != "" {
		req.Header.Set(endpoint.header, endpoint.value)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("User-Agent", UserAgent)
	if session != "" {
		req.Header.Set("Mcp-Session-Id", session)
	}
	if version != "" {
		req.Header.Set("Mcp-Protocol-Version", version)
	}
	return req, nil
}

// call sends one request and returns its result.
func (h *HTTP) call(ctx context.Context, endpoint target, method string, params json.RawMessage, session, version string) (json.RawMessage, http.Header, error) {
	id := json.RawMessage(strconv.Quote("idemcp-list-" + strconv.FormatInt(h.seq.Add(1), 10)))
	body, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": id, "method": method, "params": params})
	req, err := h.newRequest(ctx, http.MethodPost, endpoint, body, session, version)
	if err != nil {
		return nil, nil, err
	}
	req.Header.Set("Mcp-Method", method)
	resp, err := h.client.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return nil, nil, &statusError{code: resp.StatusCode}
	}
	msg, err := readResponse(resp, id)
	if err != nil {
		return nil, nil, err
	}
	m, err := mcpmsg.Parse(msg)
	if err != nil {
		return nil, nil, err
	}
	if len(m.Error) > 0 && string(m.Error) != "null" {
		return nil, nil, fmt.Errorf("JSON-RPC error %s", m.Error)
	}
	return m.Result, resp.Header, nil
}

func readResponse(resp *http.Response, id json.RawMessage) ([]byte, error) {
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if mt != "text/event-stream" {
		b, err := io.ReadAll(io.LimitReader(resp.Body, maxListBytes+1))
		if err != nil {
			return nil, err
		}
		if len(b) > maxListBytes {
			return nil, fmt.Errorf("response over %d bytes", maxListBytes)
		}
		if !mcpmsg.IsResponseTo(b, id) {
			return nil, errors.New("the response is not a JSON-RPC response to the request")
		}
		return b, nil
	}
	er := mcpmsg.NewEventReader(resp.Body, maxListBytes)
	defer er.Release()
	for {
		ev, err := er.Next()
		if err != nil {
			return nil, fmt.Errorf("the event stream ended without the response: %w", err)
		}
		if mcpmsg.IsResponseTo(ev.Data, id) {
			return ev.Data, nil
		}
	}
}

func (h *HTTP) notify(ctx context.Context, endpoint target, method, session, version string) error {
	body, _ := json.Marshal(map[string]string{"jsonrpc": "2.0", "method": method})
	req, err := h.newRequest(ctx, http.MethodPost, endpoint, body, session, version)
	if err != nil {
		return err
	}
	req.Header.Set("Mcp-Method", method)
	resp, err := h.client.Do(req)
	if err != nil {
		return fmt.Errorf("%s: %w", method, err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s: HTTP %d", method, resp.StatusCode)
	}
	return nil
}

// deleteSession ends the lister's session, so the server does not keep it.
func (h *HTTP) deleteSession(endpoint target, session, version string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5e9)
	defer cancel()
	req, err := h.newRequest(ctx, http.MethodDelete, endpoint, nil, session, version)
	if err != nil {
		return
	}
	if resp, err := h.client.Do(req); err == nil {
		_ = resp.Body.Close()
	}
}

// statusError is a listing request answered with another status than 200.
type statusError struct{ code int }

func (e *statusError) Error() string { return fmt.Sprintf("HTTP %d", e.code) }
