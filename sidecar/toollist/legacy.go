package toollist

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// legacyVersion is the revision of the legacy HTTP+SSE transport.
const legacyVersion = "2024-11-05"

// errNotStreamable says the server refused the Streamable HTTP listing
// in a way a legacy HTTP+SSE server does (it takes POSTs only at the
// endpoint its stream names).
var errNotStreamable = errors.New("not a Streamable HTTP endpoint")

// legacyPath is where the lister opens a legacy event stream: the
// upstream URL's path, or /sse, the path servers of that revision use.
func (h *HTTP) legacyPath() string {
	if p := h.upstream.Path; p != "" && p != "/" {
		return p
	}
	return "/sse"
}

// listLegacy does one listing over legacy HTTP+SSE (2024-11-05): a GET
// event stream at the configured path, whose "endpoint" event names
// where to POST; initialize, then tools/list page by page, each response
// read from the stream. The endpoint must be on the upstream's own
// scheme and host: a server cannot send the lister elsewhere.
func (h *HTTP) listLegacy(ctx context.Context, hints *engine.ToolHints) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends the stream, and so the server's session
	u := *h.upstream
	u.Path, u.RawPath, u.RawQuery = h.legacyPath(), "", ""
	stream := target{url: u.String(), host: h.host}
	req, err := h.newRequest(ctx, http.MethodGet, stream, nil, "", "")
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Del("Content-Type")
	resp, err := h.client.Do(req)
	if err != nil {
		return fmt.Errorf("opening a legacy event stream at %s: %w", stream, err)
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		return fmt.Errorf("opening a legacy event stream at %s: HTTP %d %s", stream, resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	er := mcpmsg.NewEventReader(resp.Body, maxListBytes)
	defer er.Release()
	var endpoint target
	for endpoint.url == "" {
		ev, err := er.Next()
		if err != nil {
			return fmt.Errorf("the legacy event stream at %s ended before its endpoint event: %w", stream, err)
		}
		if ev.Name != "endpoint" {
			continue
		}
		ref, err := url.Parse(strings.TrimSpace(string(ev.Data)))
		if err != nil {
			return fmt.Errorf("the legacy event stream at %s names an endpoint that does not parse: %w", stream, err)
		}
		to := (&u).ResolveReference(ref)
		if to.Scheme != u.Scheme || to.Host != u.Host {
			return fmt.Errorf("the legacy event stream at %s names an endpoint on another host (%s); the lister posts only to the upstream", stream, to.Redacted())
		}
		endpoint = target{url: to.String(), host: h.host}
	}
	call := func(method string, params json.RawMessage) (json.RawMessage, error) {
		id := json.RawMessage(strconv.Quote("idemcp-list-" + strconv.FormatInt(h.seq.Add(1), 10)))
		body, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": id, "method": method, "params": params})
		if err := h.post(ctx, endpoint, body); err != nil {
			return nil, fmt.Errorf("%s: %w", method, err)
		}
		for {
			ev, err := er.Next()
			if err != nil {
				return nil, fmt.Errorf("%s: the legacy event stream ended without the response: %w", method, err)
			}
			if !mcpmsg.IsResponseTo(ev.Data, id) {
				continue
			}
			m, err := mcpmsg.Parse(ev.Data)
			if err != nil {
				return nil, err
			}
			if len(m.Error) > 0 && string(m.Error) != "null" {
				return nil, fmt.Errorf("%s: JSON-RPC error %s", method, m.Error)
			}
			return m.Result, nil
		}
	}
	init := fmt.Sprintf(`{"protocolVersion":%q,"capabilities":{},"clientInfo":{"name":"idemcp","version":"1"}}`, legacyVersion)
	if _, err := call("initialize", json.RawMessage(init)); err != nil {
		return fmt.Errorf("initializing a legacy session at %s: %w", stream, err)
	}
	if err := h.post(ctx, endpoint, []byte(`{"jsonrpc":"2.0","method":"notifications/initialized"}`)); err != nil {
		return fmt.Errorf("notifications/initialized at %s: %w", stream, err)
	}
	cursor := ""
	for range maxPages {
		params := json.RawMessage(`{}`)
		if cursor != "" {
			params, _ = json.Marshal(map[string]string{"cursor": cursor})
		}
		res, err := call("tools/list", params)
		if err != nil {
			return fmt.Errorf("tools/list over legacy SSE at %s: %w", stream, err)
		}
		if cursor = hints.ObserveListResult(res); cursor == "" {
			return nil
		}
	}
	return fmt.Errorf("tools/list over legacy SSE at %s: more than %d pages", stream, maxPages)
}

// post sends one message to a legacy endpoint; its answer comes on the
// stream.
func (h *HTTP) post(ctx context.Context, endpoint target, body []byte) error {
	req, err := h.newRequest(ctx, http.MethodPost, endpoint, body, "", "")
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := h.client.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	return nil
}
