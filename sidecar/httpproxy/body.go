package httpproxy

// A POST body the proxy streams to the server while it answers (full
// duplex) must be left to net/http in a state its HTTP/1 server handles.
// When the handler returns with the body unread (the server was
// unreachable, broke off, or answered before reading it), net/http reads
// the rest itself after its last check for reads in flight, starts its
// background read at the body's end, and then reads the next request on
// the same connection: "http: panic serving ...: invalid concurrent
// Body.Read call" (golang/go#68560). A body it cannot finish reading
// leaves the rest of it on the connection to be parsed as the next
// request. And the Transport may still be reading the body for the
// server when the handler returns: a read of it that reaches the end
// starts that background read from the Transport's goroutine, where the
// same panic ends the process.
//
// So a response to a request whose body was not read to its end closes
// the connection (net/http then never reads another request from it), and
// no read of the body outlives the handler.

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// errBodyAfterHandler answers a read of a request body after its handler
// ended.
var errBodyAfterHandler = errors.New("request body read after its handler ended")

// duplexBody is the body of an HTTP/1 request the proxy may stream to the
// server. Reads run one at a time under mu, so that end can wait for one
// in flight.
type duplexBody struct {
	mu    sync.Mutex
	rc    io.ReadCloser
	ended bool        // guarded by mu
	eof   atomic.Bool // the body was read to its end
}

const duplexBodyKey ctxKey = 1

// guardBody gives r (an HTTP/1 request with a body) a duplexBody; the
// caller must call end before its handler returns.
func guardBody(r *http.Request) (*http.Request, *duplexBody) {
	b := &duplexBody{rc: r.Body}
	// A copy of r: net/http's own request keeps the body it knows.
	r = r.WithContext(context.WithValue(r.Context(), duplexBodyKey, b))
	r.Body = b
	return r, b
}

func (b *duplexBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ended {
		return 0, errBodyAfterHandler
	}
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.eof.Store(true)
	}
	return n, err
}

// Close leaves the body to end and to net/http: closing it reads the rest.
func (b *duplexBody) Close() error { return nil }

// end stops every read of the body before the handler returns. A read
// still waiting for the client is broken off: the connection closes after
// this response anyway (closeIfBodyUnread). A response not yet written
// gets Connection: close too.
func (b *duplexBody) end(w http.ResponseWriter) {
	broken := false
	if !b.mu.TryLock() {
		if !b.eof.Load() {
			_ = http.NewResponseController(w).SetReadDeadline(time.Unix(1, 0))
			broken = true
		}
		b.mu.Lock()
	}
	b.ended = true
	b.mu.Unlock()
	// Once the read deadline is broken, the connection is done even if
	// the read reached the end meanwhile: net/http's background read,
	// started at the end, fails on it and cancels the connection.
	if broken || !b.eof.Load() {
		w.Header().Set("Connection", "close")
	}
}

// closeIfBodyUnread makes a response header close the connection when the
// request it answers (found by ctx) has a body not read to its end: the
// rest of it must not be read as the next request. Only for final
// responses, never for a protocol switch.
func closeIfBodyUnread(ctx context.Context, status int, h http.Header) {
	if status < http.StatusOK {
		return
	}
	if b, _ := ctx.Value(duplexBodyKey).(*duplexBody); b != nil && !b.eof.Load() {
		h.Set("Connection", "close")
	}
}
