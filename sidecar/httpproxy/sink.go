package httpproxy

import (
	"io"
	"net/http"
	"sync"
	"time"
)

// sink writes to a client that may go away: once detached, writes are
// dropped, so a call detached from its client can run to the end. Each
// write has a deadline: a client that stays connected but stops reading is
// detached rather than allowed to stall the call.
type sink struct {
	mu      sync.Mutex
	w       http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	gone    bool
	started bool
	aborted bool      // the server's response broke off: abort the client's
	tail    *tailBody // the server's stream after the response, to relay
	// headerFlush sends a header that no body followed within
	// headerFlushDelay; unflushed says a written header still waits.
	headerFlush *time.Timer
	unflushed   bool
}

// tailBody is what is left of an upstream stream once the response passed.
type tailBody struct {
	body io.ReadCloser
	rest io.Reader
	rb   *readTracker
}

func newSink(w http.ResponseWriter, timeout time.Duration) *sink {
	return &sink{w: w, rc: http.NewResponseController(w), timeout: timeout}
}

func (s *sink) header(status int, h http.Header) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gone || s.started {
		return
	}
	dst := s.w.Header()
	for k, v := range h {
		dst[k] = v
	}
	s.w.WriteHeader(status)
	s.started = true
	s.unflushed = true
	s.headerFlush = time.AfterFunc(headerFlushDelay, s.flushHeader)
}

// flushHeader sends a header still waiting for its body.
func (s *sink) flushHeader() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.unflushed {
		s.flushLocked(false)
	}
}

func (s *sink) write(b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	deadline := false
	for len(b) > 0 && !s.gone {
		chunk := b[:min(len(b), sinkChunk)]
		b = b[len(chunk):]
		_ = s.rc.SetWriteDeadline(time.Now().Add(s.timeout))
		deadline = true
		if _, err := s.w.Write(chunk); err != nil {
			s.gone = true
		}
	}
	// The last chunk's deadline covers the flush that sends it.
	s.flushLocked(deadline)
}

// flushLocked sends what is written; deadline says a write deadline was
// just set for it.
func (s *sink) flushLocked(deadline bool) {
	if s.headerFlush != nil {
		s.headerFlush.Stop()
		s.headerFlush = nil
	}
	s.unflushed = false
	if s.gone {
		return
	}
	if !deadline {
		_ = s.rc.SetWriteDeadline(time.Now().Add(s.timeout))
	}
	if err := s.rc.Flush(); err != nil {
		s.gone = true
		return
	}
	_ = s.rc.SetWriteDeadline(time.Time{})
}

// Write lets the sink be an io.Writer; a client that left swallows it all.
func (s *sink) Write(b []byte) (int, error) {
	s.write(b)
	return len(b), nil
}

func (s *sink) isGone() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gone
}

func (s *sink) hasStarted() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.started
}

// abort asks the handler to break the client's response off.
func (s *sink) abort() {
	s.mu.Lock()
	s.aborted = true
	s.mu.Unlock()
}

func (s *sink) abortRequested() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.aborted && !s.gone
}

// setTail hands the rest of the server's stream to the handler, which
// relays it after the call is settled.
func (s *sink) setTail(body io.ReadCloser, rest io.Reader, rb *readTracker) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gone {
		drainAndClose(body)
		return
	}
	s.tail = &tailBody{body: body, rest: rest, rb: rb}
}

// relayTail relays what the server streams after the response, until the
// stream or the client ends.
func (s *sink) relayTail() {
	s.mu.Lock()
	t := s.tail
	s.tail = nil
	s.mu.Unlock()
	if t == nil {
		return
	}
	bp := tailBufs.Get().(*[]byte)
	defer tailBufs.Put(bp)
	buf := *bp
	for {
		n, err := t.rest.Read(buf)
		if n > 0 {
			s.write(buf[:n])
		}
		if s.isGone() {
			drainAndClose(t.body)
			return
		}
		if err != nil {
			if t.rb.err != nil {
				s.abort()
			}
			_ = t.body.Close()
			return
		}
	}
}

func (s *sink) detach() {
	s.mu.Lock()
	s.gone = true
	if s.headerFlush != nil {
		s.headerFlush.Stop()
		s.headerFlush = nil
	}
	t := s.tail
	s.tail = nil
	s.mu.Unlock()
	if t != nil {
		drainAndClose(t.body)
	}
}
