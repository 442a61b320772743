package httpproxy

// How the sidecar talks to the MCP server, the same on every path
// (deduplicated, passthrough, legacy): the client's request goes out as it
// came, and is never sent twice.

import (
	"bufio"
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
)

// noResend keeps the transport from sending a request a second time.
// net/http's Transport resends a request on a new connection when a
// pooled one dies after the request was written, if the request looks
// idempotent: a GET, or a body it can rewind (GetBody) together with an
// Idempotency-Key or X-Idempotency-Key header, which MCP clients send on
// tool calls. The server may have run the call the first time. A request
// whose body cannot be rewound is never resent, so every request leaves
// with such a body; the headers stay as the client sent them.
type noResend struct{ next http.RoundTripper }

func (t noResend) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.GetBody == nil && req.Body != nil && req.Body != http.NoBody {
		return t.next.RoundTrip(req)
	}
	out := *req // a RoundTripper must not change the caller's request
	out.GetBody = nil
	if out.Body == nil || out.Body == http.NoBody {
		// For GET, HEAD, DELETE and OPTIONS, net/http sees that the body
		// is empty and sends none, as before. A POST with an empty body
		// goes out with an empty chunked body instead of Content-Length: 0.
		out.Body = emptyBody{}
	}
	return t.next.RoundTrip(&out)
}

type emptyBody struct{}

func (emptyBody) Read([]byte) (int, error) { return 0, io.EOF }
func (emptyBody) Close() error             { return nil }

// onceBody is a request body for the upstream without GetBody, so that it
// is never resent (see noResend).
func onceBody(b []byte) io.ReadCloser {
	return io.NopCloser(strings.NewReader(string(b)))
}

// send sends req (a request the proxy built, its header its own) upstream
// as http.Client would with redirects not followed: once, with
// basicAuthFromURL, and with an error that names the request ("Post
// \"http://...\": ..."). Not http.Client itself, which copies every
// request's header in case of a redirect.
func (p *Proxy) send(req *http.Request) (*http.Response, error) {
	basicAuthFromURL(req)
	resp, err := p.opts.Transport.RoundTrip(req)
	if err == nil && resp == nil {
		err = errors.New("the transport returned neither a response nor an error")
	}
	if err != nil {
		if resp != nil && resp.Body != nil {
			_ = resp.Body.Close()
		}
		op := "Get"
		if m := req.Method; m != "" {
			op = m[:1] + strings.ToLower(m[1:])
		}
		return nil, &url.Error{Op: op, URL: req.URL.Redacted(), Err: err}
	}
	return resp, nil
}

// basicAuthFromURL gives req, a request for the upstream with a header of
// its own, the upstream URL's user and password as basic auth, as
// http.Client does, unless the client sent an Authorization of its own.
func basicAuthFromURL(req *http.Request) {
	if u := req.URL.User; u != nil && req.Header.Get("Authorization") == "" {
		password, _ := u.Password()
		req.SetBasicAuth(u.Username(), password)
	}
}

// outgoingHeader is the header of a request the sidecar sends upstream for
// the client: the client's own, less the hop-by-hop fields. Forwarded,
// X-Forwarded-*, Authorization, Idempotency-Key pass as they came, and no
// User-Agent is added where the client sent none.
func outgoingHeader(in http.Header) http.Header {
	h := in.Clone()
	if h == nil {
		h = make(http.Header)
	}
	trailers := false
	for _, v := range in["Te"] {
		for _, tok := range strings.Split(v, ",") {
			trailers = trailers || strings.EqualFold(strings.TrimSpace(tok), "trailers")
		}
	}
	removeHopHeaders(h)
	if trailers {
		h.Set("Te", "trailers") // as httputil.ReverseProxy does
	}
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = []string{""} // net/http then sends none
	}
	return h
}

// forwardingHeaders are kept from the client's request on the passthrough
// path, where httputil.ReverseProxy (with Rewrite) would strip them.
var forwardingHeaders = []string{"Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto"}

// rewrite is the passthrough path's ReverseProxy.Rewrite: the request goes
// to the upstream as outgoingHeader and target make it on the other paths.
func (p *Proxy) rewrite(pr *httputil.ProxyRequest) {
	pr.Out.URL = p.target(pr.In.URL)
	// MCP servers check Host against DNS rebinding: keep the client's,
	// unless the proxy is configured for the upstream's own (a remote
	// server).
	pr.Out.Host = p.outHost(pr.In.Host)
	basicAuthFromURL(pr.Out)
	hop := connectionTokens(pr.In.Header)
	for _, name := range forwardingHeaders {
		if v, ok := pr.In.Header[name]; ok && !hop[strings.ToLower(name)] {
			pr.Out.Header[name] = v
		}
	}
}

// outHost is the Host of a request sent upstream for a client whose
// request carried host.
func (p *Proxy) outHost(host string) string {
	if p.opts.Host != "" {
		return p.opts.Host
	}
	return host
}

// connectionTokens are the header names a request's Connection header
// makes hop-by-hop.
func connectionTokens(h http.Header) map[string]bool {
	m := map[string]bool{}
	for _, f := range h["Connection"] {
		for _, name := range strings.Split(f, ",") {
			m[strings.ToLower(strings.TrimSpace(name))] = true
		}
	}
	return m
}

// newUpstreamRequest builds the request for the upstream that forwards in,
// with body (nil: none), for the sidecar's own client: same method, path,
// raw query, Host and headers.
func (p *Proxy) newUpstreamRequest(ctx context.Context, in *http.Request, body []byte) (*http.Request, error) {
	// The URL is set below: formatting the upstream's only to parse it
	// again was a measurable part of a call.
	out, err := http.NewRequestWithContext(ctx, in.Method, "", nil)
	if err != nil {
		return nil, err
	}
	out.URL = p.target(in.URL)
	out.Header = outgoingHeader(in.Header)
	out.Host = p.outHost(in.Host)
	if body != nil {
		out.Body = onceBody(body)
		out.ContentLength = int64(len(body))
	}
	return out, nil
}

// decodable are the content codings the sidecar can undo to read a
// response (Go's standard library has no Brotli or Zstandard).
var decodable = map[string]bool{"gzip": true, "x-gzip": true, "deflate": true, "identity": true}

// readableAcceptEncoding keeps, of a client's Accept-Encoding, the codings
// the sidecar can read, for a request whose response it must read: the
// server then answers in one the client accepts and the sidecar reads.
func readableAcceptEncoding(h http.Header) {
	vals, ok := h["Accept-Encoding"]
	if !ok {
		return
	}
	var keep []string
	for _, v := range vals {
		for _, tok := range strings.Split(v, ",") {
			coding, _, _ := strings.Cut(strings.TrimSpace(tok), ";")
			if decodable[strings.ToLower(strings.TrimSpace(coding))] {
				keep = append(keep, strings.TrimSpace(tok))
			}
		}
	}
	if len(keep) == 0 {
		h.Del("Accept-Encoding")
		return
	}
	h["Accept-Encoding"] = []string{strings.Join(keep, ", ")}
}

// errUnreadableEncoding is a Content-Encoding the sidecar cannot undo.
var errUnreadableEncoding = errors.New("content coding the sidecar cannot decode")

// decodeBody returns r with the codings of contentEncoding (a
// Content-Encoding header's values) undone, last applied first. It reads
// nothing until it is read.
func decodeBody(r io.Reader, contentEncoding []string) (io.Reader, error) {
	var codings []string
	for _, v := range contentEncoding {
		for _, tok := range strings.Split(v, ",") {
			if c := strings.ToLower(strings.TrimSpace(tok)); c != "" && c != "identity" {
				codings = append(codings, c)
			}
		}
	}
	for i := len(codings) - 1; i >= 0; i-- {
		switch codings[i] {
		case "gzip", "x-gzip":
			r = &lazyReader{open: func(src io.Reader) (io.Reader, error) { return gzip.NewReader(src) }, src: r}
		case "deflate":
			r = &lazyReader{open: openDeflate, src: r}
		default:
			return nil, fmt.Errorf("%w: %q", errUnreadableEncoding, codings[i])
		}
	}
	return r, nil
}

// openDeflate reads "deflate" as RFC 9110 defines it (a zlib stream), or
// as raw DEFLATE, which some servers send under that name.
func openDeflate(src io.Reader) (io.Reader, error) {
	br := bufio.NewReader(src)
	head, err := br.Peek(2)
	if err != nil {
		return nil, err
	}
	if (uint(head[0])<<8|uint(head[1]))%31 == 0 && head[0]&0x0f == 8 {
		return zlib.NewReader(br)
	}
	return flate.NewReader(br), nil
}

// lazyReader opens a decompressor on its first Read, so that building it
// does not wait for the server's first bytes.
type lazyReader struct {
	open func(io.Reader) (io.Reader, error)
	src  io.Reader
	r    io.Reader
	err  error
}

func (l *lazyReader) Read(b []byte) (int, error) {
	if l.r == nil && l.err == nil {
		l.r, l.err = l.open(l.src)
		if errors.Is(l.err, io.EOF) {
			l.err = io.ErrUnexpectedEOF
		}
	}
	if l.err != nil {
		return 0, l.err
	}
	return l.r.Read(b)
}

// decodeAll undoes a response body's codings, within limit bytes. A body
// it cannot decode, or one over the limit, is reported as over: the
// sidecar relays it but cannot keep it.
func decodeAll(b []byte, contentEncoding []string, limit int64) ([]byte, bool) {
	r, err := decodeBody(bytes.NewReader(b), contentEncoding)
	if err != nil {
		return nil, true
	}
	out, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil || int64(len(out)) > limit {
		return nil, true
	}
	return out, false
}
