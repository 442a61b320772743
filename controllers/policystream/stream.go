package policystream

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime/debug"
	"strconv"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/internal/tracing"
)

// stream is one connected sidecar; its fields are guarded by Server.mu.
type stream struct {
	pod    string
	uid    string
	notify chan struct{}
	cancel context.CancelFunc

	sentVersion string
	sentOrder   policywire.Order
	sentCA      string
	sentLegacy  policywire.LegacyKeys
	lastNonce   string
	report      policywire.Report
	// keys carries KeysRequests to write, besides snapshots; done is
	// closed when the stream ends.
	keys chan []byte
	done <-chan struct{}
	// push is the span of the snapshot last sent, from its write until
	// the sidecar acknowledges (or refuses) it; nil once it has.
	push trace.Span
	// pendingVersion was sent at pendingSince and not acknowledged yet
	// (idemcp_policy_sync_duration_seconds).
	pendingVersion string
	pendingSince   time.Time
}

// serveStream is one sidecar's stream: authorize, send the current
// snapshot, then every change, and record its reports.
func (s *Server) serveStream(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	key := types.NamespacedName{Namespace: r.PathValue("namespace"), Name: r.PathValue("name")}
	// The stream's values go with each message rather than through
	// WithValues: zap encodes a With's fields into a buffer of its own at
	// once, about 2 KiB held by every open stream for messages that are
	// rare.
	logger := log.FromContext(ctx)
	kv := []any{"policy", klog.KRef(key.Namespace, key.Name)}
	if !s.leading.Load() || !s.synced.Load() {
		w.Header().Set("Retry-After", "1")
		http.Error(w, "this manager replica does not serve the policy stream now (not the leader); retry", http.StatusServiceUnavailable)
		return
	}
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	default:
		w.Header().Set("Retry-After", "5")
		http.Error(w, fmt.Sprintf("this manager holds its limit of %d policy streams (--policy-stream-max-streams); retry later", s.opts.MaxStreams), http.StatusServiceUnavailable)
		return
	}
	who, err := offStack(func() (*caller, error) { return s.authorize(ctx, r, key.Namespace, key.Name) })
	if err != nil {
		if ref, ok := refusalOf(err); ok {
			logger.V(1).Info("Refused a policy stream", append(kv, "reason", ref.why)...)
			if ref.retryAfter > 0 {
				w.Header().Set("Retry-After", strconv.Itoa(ref.retryAfter))
			}
			http.Error(w, ref.why, ref.code)
			return
		}
		logger.Error(err, "Authorizing a policy stream failed", kv...)
		http.Error(w, "the manager cannot check the caller now; retry", http.StatusServiceUnavailable)
		return
	}
	kv = append(kv, "pod", klog.KRef(key.Namespace, who.pod))
	if err := s.refresh(ctx, key); err != nil {
		if apierrors.IsNotFound(err) {
			http.Error(w, fmt.Sprintf("IdempotencyPolicy %s does not exist", key), http.StatusNotFound)
			return
		}
		logger.Error(err, "Reading the policy failed", kv...)
		http.Error(w, "the manager cannot read the policy now; retry", http.StatusServiceUnavailable)
		return
	}

	// One context, not a deadline's under a cancel's: each is held for as
	// long as the stream, with its parent's map of children.
	var sctx context.Context
	var cancel context.CancelFunc
	if who.expires.IsZero() {
		sctx, cancel = context.WithCancel(ctx)
	} else {
		sctx, cancel = context.WithDeadline(ctx, who.expires)
	}
	defer cancel()
	c := &stream{pod: who.pod, uid: who.uid, notify: make(chan struct{}, 1), cancel: cancel, keys: make(chan []byte, 4), done: sctx.Done()}
	poke(c.notify)
	s.mu.Lock()
	st := s.state(key)
	if st.snap == nil {
		s.mu.Unlock()
		http.Error(w, fmt.Sprintf("IdempotencyPolicy %s does not compile; see its status", key), http.StatusNotFound)
		return
	}
	st.streams[c] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(st.streams, c)
		st.dirty = true
		s.mu.Unlock()
	}()

	rc := http.NewResponseController(w)
	_ = rc.EnableFullDuplex() // HTTP/1.1; HTTP/2 is full duplex already
	w.Header().Set("Content-Type", policywire.ContentType)
	if who.ticket != "" {
		w.Header().Set(policywire.ReviewTicketHeader, who.ticket)
	}
	w.WriteHeader(http.StatusOK)
	if err := rc.Flush(); err != nil {
		return
	}
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		s.readReports(r, key, c)
	}()
	for {
		select {
		case <-sctx.Done():
			return
		case <-readDone:
			return
		case line := <-c.keys:
			if !s.writeLine(rc, w, line) {
				return
			}
			continue
		case <-c.notify:
		}
		s.mu.Lock()
		snap, ca := st.snap, *s.ca.Load()
		send := snap != nil && (snap.version != c.sentVersion || !snap.order.Equal(c.sentOrder) || ca != c.sentCA || !sameLegacy(snap.legacy, c.sentLegacy))
		var line []byte
		if send {
			enc, err := st.encoded(ca, &s.nonce)
			if err != nil {
				s.mu.Unlock()
				logger.Error(err, "Encoding a snapshot failed", kv...)
				return
			}
			if snap.version != c.sentVersion {
				c.pendingVersion, c.pendingSince = snap.version, time.Now()
			}
			c.sentVersion, c.sentOrder, c.sentCA, c.sentLegacy, c.lastNonce = snap.version, snap.order, ca, snap.legacy, enc.nonce
			line = enc.line
			if c.push != nil {
				c.push.SetAttributes(attribute.String("idemcp.push.result", "superseded"))
				c.push.End()
			}
			_, c.push = otel.Tracer(tracing.ScopeName).Start(sctx, "policy push",
				trace.WithSpanKind(trace.SpanKindProducer),
				trace.WithAttributes(attribute.String("k8s.namespace.name", key.Namespace), tracing.PolicyName.String(key.Name),
					tracing.PolicyHash.String(snap.version), attribute.String("k8s.pod.name", c.pod)))
		}
		s.mu.Unlock()
		if !send {
			continue
		}
		// A deadline for this write only: left set, it would end the
		// stream once it passed, however idle (an HTTP/2 stream is reset
		// when its write deadline fires, not when a write misses it), and
		// every sidecar would reconnect a WriteTimeout after each snapshot.
		_ = rc.SetWriteDeadline(time.Now().Add(s.opts.WriteTimeout))
		if _, err := w.Write(line); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			return
		}
		_ = rc.SetWriteDeadline(time.Time{})
	}
}

// readReports records each report of c until its body ends. It reads
// through a small buffer and assembles a longer line apart: a scanner's
// buffer, sized for the longest report, was 4 KiB held by every stream.
func (s *Server) readReports(r *http.Request, key types.NamespacedName, c *stream) {
	br := bufio.NewReaderSize(r.Body, reportReadBuffer)
	for {
		line, err := readLine(br, policywire.MaxMessageBytes)
		if err != nil {
			if !errors.Is(err, io.EOF) && r.Context().Err() == nil {
				log.FromContext(r.Context()).V(1).Info("Ending a stream whose reports cannot be read", "pod", c.pod, "err", err.Error())
			}
			return
		}
		rep, err := offStack(func() (rep policywire.Report, err error) { return rep, policywire.Decode(line, &rep) })
		if err != nil {
			log.FromContext(r.Context()).V(1).Info("Ending a stream that sent a bad report", "pod", c.pod, "err", err.Error())
			return
		}
		if rep.KeysReply != nil {
			s.keyAnswers.deliver(c, rep.KeysReply)
			continue
		}
		s.mu.Lock()
		c.report = rep
		c.observeAck(rep.Version, time.Now())
		s.state(key).dirty = true
		if c.push != nil && rep.Nonce != "" && rep.Nonce == c.lastNonce {
			if rep.Error != "" {
				c.push.SetAttributes(attribute.String("idemcp.push.result", "refused"))
				c.push.SetStatus(codes.Error, rep.Error)
			} else {
				c.push.SetAttributes(attribute.String("idemcp.push.result", "acknowledged"))
			}
			c.push.End()
			c.push = nil
		}
		s.mu.Unlock()
	}
}

// offStack runs f on a goroutine that ends with it. A stream's goroutines
// live as long as the stream, and a goroutine keeps the stack its deepest
// call grew while a quarter of it stays in use (a GC halves it only
// below that): a TokenReview, or a report's JSON decode, run on them held
// that much more for every open stream. A panic in f is raised again on
// the caller's goroutine, as if f had run there (on a handler's,
// net/http's recovery ends the one stream, not the manager); so is an f
// that exits its goroutine.
func offStack[T any](f func() (T, error)) (T, error) {
	type result struct {
		v        T
		err      error
		panicked any
	}
	done := make(chan result, 1)
	go func() {
		returned := false
		defer func() {
			if !returned {
				p := recover()
				if p == nil {
					p = errors.New("offStack: the function exited its goroutine without returning")
				} else if p != http.ErrAbortHandler { //nolint:errorlint // the sentinel value itself, as net/http compares it
					p = fmt.Sprintf("%v\n%s", p, debug.Stack())
				}
				done <- result{panicked: p}
			}
		}()
		v, err := f()
		returned = true
		done <- result{v: v, err: err}
	}()
	r := <-done
	if r.panicked != nil {
		panic(r.panicked)
	}
	return r.v, r.err
}

// reportReadBuffer is the read buffer of a stream's reports: most fit.
const reportReadBuffer = 512

// errLineTooLong is a report longer than policywire.MaxMessageBytes.
var errLineTooLong = errors.New("a report is longer than the limit")

// readLine returns the next line of br without its newline, at most max
// bytes; a line that does not fit br's buffer is copied. A last line
// without a newline is returned too, as bufio.Scanner did.
func readLine(br *bufio.Reader, max int) ([]byte, error) {
	var long []byte
	for {
		part, err := br.ReadSlice('\n')
		if len(long)+len(part) > max+1 {
			return nil, errLineTooLong
		}
		switch {
		case err == nil && long == nil:
			return bytes.TrimSuffix(part, []byte("\n")), nil
		case err == nil:
			return bytes.TrimSuffix(append(long, part...), []byte("\n")), nil
		case errors.Is(err, bufio.ErrBufferFull):
			long = append(long, part...)
		case errors.Is(err, io.EOF) && len(long)+len(part) > 0:
			return append(long, part...), nil
		default:
			return nil, err
		}
	}
}

// SyncedPods names the pods whose sidecar holds a stream for a policy on
// this replica and enforces its current version (an IdempotentProxy
// counts its own pods with it).
func (s *Server) SyncedPods(namespace, name string) map[string]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]bool{}
	st := s.policies[types.NamespacedName{Namespace: namespace, Name: name}]
	if st == nil || st.snap == nil {
		return out
	}
	for c := range st.streams {
		if c.report.Version == st.snap.version && c.report.RestartRequired == "" {
			out[c.pod] = true
		}
	}
	return out
}

// Streams reports how many sidecars hold a stream for a policy on this
// replica, and how many of them enforce its current version.
func (s *Server) Streams(namespace, name string) (connected, synced int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.policies[types.NamespacedName{Namespace: namespace, Name: name}]
	if st == nil {
		return 0, 0
	}
	for c := range st.streams {
		connected++
		if st.snap != nil && c.report.Version == st.snap.version {
			synced++
		}
	}
	return connected, synced
}
