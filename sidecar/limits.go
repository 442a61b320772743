package sidecar

import (
	"io"
	"net/http"
	"sync"
	"time"
)

const (
	// bodyReadTimeout bounds how long a client may take to send a request
	// body: a client trickling a large body would otherwise hold a
	// connection and its buffer forever. Response streams are not bounded.
	bodyReadTimeout = 30 * time.Second
	// idleTimeout closes keep-alive connections that carry no request.
	idleTimeout = 2 * time.Minute
)

// withBodyDeadline gives a request body d to arrive in full. The deadline
// is cleared once the body is read (or closed), so a long response stream
// that follows is not cut; a request without a body gets none, as a GET
// stream's background read would otherwise time out and end it.
func withBodyDeadline(d time.Duration, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
			next.ServeHTTP(w, r)
			return
		}
		rc := http.NewResponseController(w)
		if err := rc.SetReadDeadline(time.Now().Add(d)); err != nil {
			next.ServeHTTP(w, r)
			return
		}
		r.Body = &deadlineBody{ReadCloser: r.Body, clear: sync.OnceFunc(func() { _ = rc.SetReadDeadline(time.Time{}) })}
		next.ServeHTTP(w, r)
	})
}

type deadlineBody struct {
	io.ReadCloser
	clear func()
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.clear()
	}
	return n, err
}

func (b *deadlineBody) Close() error {
	b.clear()
	return b.ReadCloser.Close()
}
