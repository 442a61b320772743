// Package policystream is the manager's policy stream: every injected
// sidecar holds one HTTPS request open to it, receives its policy and every
// change within a second, and acknowledges the hash it applied. The server
// turns the acknowledgements into status.sidecars and the SidecarsSynced
// condition of each IdempotencyPolicy.
//
// Every replica listens, only the leader serves: a replica that is not (or
// no longer) the leader answers 503 and ends the streams it held, so a
// sidecar never takes a policy from a replica that may have stopped
// watching, and one replica sees every acknowledgement, which keeps the
// counts right. A sidecar says what it enforces when it connects, so the
// new leader after a failover knows every sidecar's state at once.
package policystream

import (
	"bufio"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/singleflight"
	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/certwatcher"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/internal/tracing"
)

// +kubebuilder:rbac:groups=authentication.k8s.io,resources=tokenreviews,verbs=create
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch
// +kubebuilder:rbac:groups=idemcp.io,resources=idempotencypolicies/status,verbs=get;update;patch

// Options configure the stream server.
type Options struct {
	// Addr is where it listens (":9444"); "0" turns it off.
	Addr string
	// CertDir holds tls.crt and tls.key, the webhook's serving pair (the
	// same certificate machinery); they are reloaded when they change.
	CertDir string
	// CABundle returns the PEM of the CAs the serving certificate may come
	// from; it travels on the stream so a sidecar survives a CA rotation.
	CABundle func(context.Context) ([]byte, error)
	// FlushInterval batches status writes: at most one per policy per
	// interval, whatever the number of sidecars (default 200ms).
	FlushInterval time.Duration
	// WriteTimeout bounds writing one snapshot to a sidecar that stopped
	// reading (default 10s); the stream ends if it passes.
	WriteTimeout time.Duration
	// MaxStreams caps the streams held at once (default 10000): a sidecar
	// beyond it is answered 503 and comes back after its backoff.
	MaxStreams int
	// TokenReviewQPS and TokenReviewBurst limit the TokenReviews of tokens
	// not in the cache (default 100 a second, burst twice that); a caller
	// that would wait more than TokenReviewWait (default 2s) for one is
	// answered 503.
	TokenReviewQPS   float64
	TokenReviewBurst int
	TokenReviewWait  time.Duration
	// TokenReviewTTL is how long an accepted token's review is reused
	// (default 2m), never past the token's expiry.
	TokenReviewTTL time.Duration
	// CARefresh is how often the CA bundle is read again and, if it
	// changed, pushed to every sidecar (default 1m).
	CARefresh time.Duration
	// Recorder gets the Warning event of a policy whose sidecars report
	// tools Auto deduplicates for want of annotations (nil: no events).
	Recorder events.EventRecorder
	// PodName and PodNamespace are the manager's own pod: the leader labels
	// it LabelLeader, which the stream's Service selects. Empty: no label.
	PodName, PodNamespace string
	// Routes, if set, adds handlers to the stream's listener (the keys
	// API of kubectl idemcp keys), served by every replica.
	Routes func(*http.ServeMux)
}

// LabelLeader marks the manager pod that serves the policy stream.
const LabelLeader = "idemcp.io/policy-stream"

// Server is the policy stream. Add it to the manager with Add.
type Server struct {
	opts      Options
	client    client.Client
	apiReader client.Reader
	pods      client.Reader
	cache     cache.Cache

	leading atomic.Bool
	// labelMu orders the leader's label with the startup's removal of a
	// stale one: a replica that wins the lease at once must keep its label.
	labelMu sync.Mutex
	synced  atomic.Bool
	ca      atomic.Pointer[string]
	nonce   atomic.Uint64
	fresh   singleflight.Group

	// slots holds one token per stream held or being authorized.
	slots       chan struct{}
	reviewLimit *rate.Limiter
	reviews     *reviewCache

	keyAnswers keyAnswers

	mu       sync.Mutex
	policies map[types.NamespacedName]*policyState
	// addr is the bound listener's address, for tests.
	addr chan net.Addr
}

// policyState is one policy's current snapshot and the streams that hold it.
type policyState struct {
	snap       *snapshot
	generation int64
	// gone are the UIDs of objects of this name deleted or replaced by
	// another (the last few): their late events, from a cache behind a
	// fresh read, never come back. Creation times are not compared: API
	// servers' clocks may be skewed.
	gone    []string
	streams map[*stream]struct{}
	dirty   bool
	written string // the last status written, to skip identical writes
	// toolsWarned is the ToolsAnnotated message last sent as a Warning
	// event, so each new list of unannotated tools is one event.
	toolsWarned string
	enc         *encodedSnapshot
}

type snapshot struct {
	version string
	policy  *v1alpha1.IdempotencyPolicy
	order   policywire.Order
}

// encodedSnapshot is a snapshot as it goes on the wire, encoded once for
// every stream: its nonce names the content (version and CA bundle), so
// a NACK is matched to what the stream was sent.
type encodedSnapshot struct {
	version, ca, nonce string
	order              policywire.Order
	line               []byte
}

// encoded returns st's snapshot with ca, encoding it if it changed; the
// caller holds Server.mu.
func (st *policyState) encoded(ca string, nonces *atomic.Uint64) (*encodedSnapshot, error) {
	if e := st.enc; e != nil && e.version == st.snap.version && e.ca == ca && e.order.Equal(st.snap.order) {
		return e, nil
	}
	nonce := strconv.FormatUint(nonces.Add(1), 10)
	order := st.snap.order
	line, err := json.Marshal(policywire.Snapshot{Version: st.snap.version, Nonce: nonce, Policy: st.snap.policy, CABundle: ca, Order: &order})
	if err != nil {
		return nil, err
	}
	st.enc = &encodedSnapshot{version: st.snap.version, ca: ca, nonce: nonce, order: order, line: append(line, '\n')}
	return st.enc, nil
}

// stream is one connected sidecar; its fields are guarded by Server.mu.
type stream struct {
	pod    string
	uid    string
	notify chan struct{}
	cancel context.CancelFunc

	sentVersion string
	sentOrder   policywire.Order
	sentCA      string
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

// New returns a server that reads through mgr's cache and writes with its
// client.
func New(mgr manager.Manager, o Options) *Server {
	if o.FlushInterval <= 0 {
		o.FlushInterval = 200 * time.Millisecond
	}
	if o.WriteTimeout <= 0 {
		o.WriteTimeout = 10 * time.Second
	}
	if o.MaxStreams <= 0 {
		o.MaxStreams = 10000
	}
	if o.TokenReviewQPS <= 0 {
		o.TokenReviewQPS = 100
	}
	if o.TokenReviewBurst <= 0 {
		o.TokenReviewBurst = max(1, int(2*o.TokenReviewQPS))
	}
	if o.TokenReviewWait <= 0 {
		o.TokenReviewWait = 2 * time.Second
	}
	if o.TokenReviewTTL <= 0 {
		o.TokenReviewTTL = 2 * time.Minute
	}
	if o.CARefresh <= 0 {
		o.CARefresh = time.Minute
	}
	empty := ""
	s := &Server{
		opts: o, client: mgr.GetClient(), apiReader: mgr.GetAPIReader(), pods: mgr.GetClient(), cache: mgr.GetCache(),
		policies: map[types.NamespacedName]*policyState{}, addr: make(chan net.Addr, 1),
		slots:       make(chan struct{}, o.MaxStreams),
		reviewLimit: rate.NewLimiter(rate.Limit(o.TokenReviewQPS), o.TokenReviewBurst),
		reviews:     &reviewCache{max: 4 * o.MaxStreams, entries: map[[sha256.Size]byte]cachedReview{}},
	}
	s.ca.Store(&empty)
	return s
}

// Add registers the listener (every replica) and the leader's part (serving
// and status writes) with mgr.
func (s *Server) Add(mgr manager.Manager) error {
	if s.opts.Addr == "0" {
		return nil
	}
	if err := mgr.Add(listener{s}); err != nil {
		return err
	}
	return mgr.Add(&leader{s})
}

// Addr returns the address the server listens on, once it does.
func (s *Server) Addr(ctx context.Context) (net.Addr, error) {
	select {
	case a := <-s.addr:
		s.addr <- a
		return a, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (s *Server) listen(ctx context.Context) error {
	logger := log.FromContext(ctx).WithName("policy-stream")
	ctx = log.IntoContext(ctx, logger)
	if err := s.watch(ctx); err != nil {
		return err
	}
	// A replica restarted in the same pod is not the leader (yet), unless
	// it already won the lease: then the label it just set stays.
	s.labelMu.Lock()
	if !s.leading.Load() {
		if err := s.labelSelf(ctx, false); err != nil {
			logger.Error(err, "Removing the leader label from the manager's pod failed")
		}
	}
	s.labelMu.Unlock()
	watcher, err := certwatcher.New(s.opts.CertDir+"/tls.crt", s.opts.CertDir+"/tls.key")
	if err != nil {
		return fmt.Errorf("policy stream: loading the serving certificate from %s: %w", s.opts.CertDir, err)
	}
	go func() {
		if err := watcher.Start(ctx); err != nil {
			logger.Error(err, "Watching the policy stream's serving certificate failed")
		}
	}()
	ln, err := net.Listen("tcp", s.opts.Addr)
	if err != nil {
		return fmt.Errorf("policy stream: %w", err)
	}
	s.addr <- ln.Addr()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/namespaces/{namespace}/idempotencypolicies/{name}/stream", s.serveStream)
	if s.opts.Routes != nil {
		s.opts.Routes(mux)
	}
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		TLSConfig:         &tls.Config{GetCertificate: watcher.GetCertificate, MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}},
		HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: 4, SendPingTimeout: 30 * time.Second, PingTimeout: 10 * time.Second},
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
	go s.refreshCA(ctx)
	errc := make(chan error, 1)
	go func() { errc <- srv.ServeTLS(ln, "", "") }()
	logger.Info("Serving the policy stream", "addr", ln.Addr().String())
	select {
	case err := <-errc:
		return fmt.Errorf("policy stream: %w", err)
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		_ = srv.Close()
	}
	return nil
}

// watch feeds policy and pod changes from the manager's cache.
func (s *Server) watch(ctx context.Context) error {
	pi, err := s.cache.GetInformer(ctx, &v1alpha1.IdempotencyPolicy{})
	if err != nil {
		return fmt.Errorf("policy stream: watching policies: %w", err)
	}
	if _, err := pi.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.observePolicy(o) },
		UpdateFunc: func(_, o any) { s.observePolicy(o) },
		DeleteFunc: func(o any) { s.forgetPolicy(o) },
	}); err != nil {
		return err
	}
	podi, err := s.cache.GetInformer(ctx, &corev1.Pod{})
	if err != nil {
		return fmt.Errorf("policy stream: watching pods: %w", err)
	}
	if _, err := podi.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.podChanged(o, false) },
		UpdateFunc: func(_, o any) { s.podChanged(o, false) },
		DeleteFunc: func(o any) { s.podChanged(o, true) },
	}); err != nil {
		return err
	}
	go func() {
		if s.cache.WaitForCacheSync(ctx) {
			s.synced.Store(true)
		}
	}()
	return nil
}

func (s *Server) refreshCA(ctx context.Context) {
	if s.opts.CABundle == nil {
		return
	}
	t := time.NewTicker(s.opts.CARefresh)
	defer t.Stop()
	for {
		if pem, err := s.opts.CABundle(ctx); err == nil && len(pem) > 0 && string(pem) != *s.ca.Load() {
			v := string(pem)
			s.ca.Store(&v)
			s.notifyAll()
		} else if err != nil && ctx.Err() == nil {
			log.FromContext(ctx).Error(err, "Reading the CA bundle for the policy stream failed")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *Server) notifyAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, st := range s.policies {
		for c := range st.streams {
			poke(c.notify)
		}
	}
}

func poke(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

func (s *Server) state(key types.NamespacedName) *policyState {
	st := s.policies[key]
	if st == nil {
		st = &policyState{streams: map[*stream]struct{}{}}
		s.policies[key] = st
	}
	return st
}

// observePolicy takes a policy from the cache or a fresh read; an older
// one than the one known (an earlier generation, or an object since
// deleted or replaced, whose last events come after the fresh read of the
// new one) never replaces it. A newer generation of the same spec moves
// the snapshot's order on: a sidecar that refused an older one from
// another replica must get it.
func (s *Server) observePolicy(o any) {
	p, ok := o.(*v1alpha1.IdempotencyPolicy)
	if !ok {
		return
	}
	compiled, err := policy.Compile(p.Spec)
	key := types.NamespacedName{Namespace: p.Namespace, Name: p.Name}
	order := policywire.Order{UID: string(p.UID), Created: p.CreationTimestamp.Time, Generation: p.Generation}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.state(key)
	st.dirty = true
	if slices.Contains(st.gone, order.UID) {
		return
	}
	if err != nil || (st.snap != nil && policywire.Older(order, st.snap.order)) || (st.snap == nil && p.Generation < st.generation) {
		// A spec that does not compile is the reconciler's to report
		// (InvalidSpec); sidecars keep the last good one.
		return
	}
	if st.snap != nil && st.snap.order.UID != order.UID {
		st.forget(st.snap.order.UID) // replaced: deleted and created again
	}
	st.generation = p.Generation
	if st.snap != nil && st.snap.version == compiled.Hash {
		if !st.snap.order.Equal(order) {
			st.snap = &snapshot{version: st.snap.version, policy: st.snap.policy, order: order}
			for c := range st.streams {
				poke(c.notify)
			}
		}
		return
	}
	st.snap = &snapshot{version: compiled.Hash, order: order, policy: &v1alpha1.IdempotencyPolicy{
		TypeMeta:   p.TypeMeta,
		ObjectMeta: objectMeta(p),
		Spec:       compiled.Spec,
	}}
	st.snap.policy.APIVersion, st.snap.policy.Kind = v1alpha1.GroupVersion.String(), "IdempotencyPolicy"
	for c := range st.streams {
		poke(c.notify)
	}
}

func (s *Server) forgetPolicy(o any) {
	if d, ok := o.(toolscache.DeletedFinalStateUnknown); ok {
		o = d.Obj
	}
	p, ok := o.(*v1alpha1.IdempotencyPolicy)
	if !ok {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.state(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
	st.forget(string(p.UID))
	if st.snap != nil && st.snap.order.UID != string(p.UID) {
		return // the late delete of an object already replaced
	}
	// Sidecars keep their last policy; nothing newer will come.
	st.snap, st.generation, st.written = nil, 0, ""
	forgetSidecarsGauge(types.NamespacedName{Namespace: p.Namespace, Name: p.Name})
}

// maxGone bounds policyState.gone.
const maxGone = 8

// forget records that the object uid is deleted or replaced.
func (st *policyState) forget(uid string) {
	if uid == "" || slices.Contains(st.gone, uid) {
		return
	}
	if len(st.gone) == maxGone {
		st.gone = st.gone[1:]
	}
	st.gone = append(st.gone, uid)
}

func (s *Server) podChanged(o any, gone bool) {
	if d, ok := o.(toolscache.DeletedFinalStateUnknown); ok {
		o = d.Obj
	}
	pod, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	name := pod.Labels[v1alpha1.LabelPolicy]
	gone = gone || pod.DeletionTimestamp != nil
	s.mu.Lock()
	defer s.mu.Unlock()
	// A stream lasts only as long as authorize would admit it: its pod
	// deleted, replaced or labelled for another policy, it ends. A live pod
	// of its name but another UID replaced its pod; a going one of another
	// UID is the pod it replaced, whose last events may come late.
	for key, st := range s.policies {
		if key.Namespace != pod.Namespace {
			continue
		}
		for c := range st.streams {
			same := c.uid == string(pod.UID)
			if c.pod == pod.Name && (same && (gone || key.Name != name) || !same && !gone) {
				c.cancel()
			}
		}
	}
	if name != "" {
		s.state(types.NamespacedName{Namespace: pod.Namespace, Name: name}).dirty = true
	}
}

// refresh reads the policy from the API server, not the cache, before a
// new stream gets its first snapshot: connections arriving together share
// one read.
func (s *Server) refresh(ctx context.Context, key types.NamespacedName) error {
	ch := s.fresh.DoChan(key.String(), func() (any, error) {
		// Not the first caller's context: the callers who joined must not
		// fail because that one went away.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refreshTimeout)
		defer cancel()
		var p v1alpha1.IdempotencyPolicy
		if err := s.apiReader.Get(rctx, key, &p); err != nil {
			return nil, err
		}
		s.observePolicy(&p)
		return nil, nil
	})
	select {
	case r := <-ch:
		return r.Err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// refreshTimeout bounds the read of a policy shared by connecting streams.
const refreshTimeout = 10 * time.Second

// serveStream is one sidecar's stream: authorize, send the current
// snapshot, then every change, and record its reports.
func (s *Server) serveStream(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	key := types.NamespacedName{Namespace: r.PathValue("namespace"), Name: r.PathValue("name")}
	logger := log.FromContext(ctx).WithValues("policy", klog.KRef(key.Namespace, key.Name))
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
	who, err := s.authorize(ctx, r, key.Namespace, key.Name)
	if err != nil {
		if ref, ok := refusalOf(err); ok {
			logger.V(1).Info("Refused a policy stream", "reason", ref.why)
			if ref.retryAfter > 0 {
				w.Header().Set("Retry-After", strconv.Itoa(ref.retryAfter))
			}
			http.Error(w, ref.why, ref.code)
			return
		}
		logger.Error(err, "Authorizing a policy stream failed")
		http.Error(w, "the manager cannot check the caller now; retry", http.StatusServiceUnavailable)
		return
	}
	logger = logger.WithValues("pod", klog.KRef(key.Namespace, who.pod))
	if err := s.refresh(ctx, key); err != nil {
		if apierrors.IsNotFound(err) {
			http.Error(w, fmt.Sprintf("IdempotencyPolicy %s does not exist", key), http.StatusNotFound)
			return
		}
		logger.Error(err, "Reading the policy failed")
		http.Error(w, "the manager cannot read the policy now; retry", http.StatusServiceUnavailable)
		return
	}

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if !who.expires.IsZero() {
		var stop context.CancelFunc
		sctx, stop = context.WithDeadline(sctx, who.expires)
		defer stop()
	}
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
		send := snap != nil && (snap.version != c.sentVersion || !snap.order.Equal(c.sentOrder) || ca != c.sentCA)
		var line []byte
		if send {
			enc, err := st.encoded(ca, &s.nonce)
			if err != nil {
				s.mu.Unlock()
				logger.Error(err, "Encoding a snapshot failed")
				return
			}
			if snap.version != c.sentVersion {
				c.pendingVersion, c.pendingSince = snap.version, time.Now()
			}
			c.sentVersion, c.sentOrder, c.sentCA, c.lastNonce = snap.version, snap.order, ca, enc.nonce
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

// readReports records each report of c until its body ends.
func (s *Server) readReports(r *http.Request, key types.NamespacedName, c *stream) {
	sc := bufio.NewScanner(r.Body)
	sc.Buffer(make([]byte, 0, 4096), policywire.MaxMessageBytes)
	for sc.Scan() {
		var rep policywire.Report
		if err := policywire.Decode(sc.Bytes(), &rep); err != nil {
			log.FromContext(r.Context()).V(1).Info("Ending a stream that sent a bad report", "pod", c.pod, "err", err.Error())
			return
		}
		if rep.KeysReply != nil {
			s.keyAnswers.deliver(c.pod, rep.KeysReply)
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

// listener is the part of the server every replica runs: the port, so the
// Service's endpoints move with the leader label alone.
type listener struct{ s *Server }

func (l listener) NeedLeaderElection() bool { return false }

func (l listener) Start(ctx context.Context) error { return l.s.listen(ctx) }

// leader is the part of the server that runs on the elected replica only.
type leader struct{ s *Server }

func (l *leader) NeedLeaderElection() bool { return true }

func (l *leader) Start(ctx context.Context) error {
	s := l.s
	s.leading.Store(true)
	defer func() {
		s.leading.Store(false)
		// Only the leader counts sidecars: a replica that was one must not
		// keep serving its last counts.
		sidecarsGauge.Reset()
		// Streams end with the leadership: a sidecar must not keep taking
		// policies from a replica that may no longer watch them.
		s.mu.Lock()
		for _, st := range s.policies {
			for c := range st.streams {
				c.cancel()
			}
		}
		s.mu.Unlock()
	}()
	s.mu.Lock()
	for _, st := range s.policies {
		st.dirty, st.written = true, ""
	}
	s.mu.Unlock()
	// Without the label the stream's Service has no endpoint: retry until
	// it is set.
	for wait := 250 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
		s.labelMu.Lock()
		err := s.labelSelf(ctx, true)
		s.labelMu.Unlock()
		if err == nil {
			break
		}
		log.FromContext(ctx).Error(err, "Labelling the manager's pod as the policy stream's leader failed; retrying", "in", wait)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
	defer func() {
		unlabel, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.labelMu.Lock()
		_ = s.labelSelf(unlabel, false)
		s.labelMu.Unlock()
	}()
	return s.flushLoop(log.IntoContext(ctx, log.FromContext(ctx).WithName("policy-stream")))
}

func (s *Server) flushLoop(ctx context.Context) error {
	t := time.NewTicker(s.opts.FlushInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if !s.synced.Load() {
			continue
		}
		s.flush(ctx)
	}
}

// objectMeta is what a sidecar needs of the policy's metadata: its name
// and namespace scope the store's keys. Annotations and managed fields stay
// behind.
func objectMeta(p *v1alpha1.IdempotencyPolicy) metav1.ObjectMeta {
	return metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace}
}

// labelSelf sets or removes LabelLeader on the manager's own pod and, when
// it takes the lead, removes it from any other pod that still has it (a
// replica that died without cleaning up).
func (s *Server) labelSelf(ctx context.Context, leader bool) error {
	if s.opts.PodName == "" || s.opts.PodNamespace == "" {
		return nil
	}
	var value any
	if leader {
		value = "leader"
		var pods corev1.PodList
		if err := s.apiReader.List(ctx, &pods, client.InNamespace(s.opts.PodNamespace), client.MatchingLabels{LabelLeader: "leader"}); err == nil {
			for i := range pods.Items {
				if pods.Items[i].Name != s.opts.PodName {
					_ = s.client.Patch(ctx, &pods.Items[i], client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"`+LabelLeader+`":null}}}`)))
				}
			}
		}
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{LabelLeader: value}}})
	if err != nil {
		return err
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: s.opts.PodNamespace, Name: s.opts.PodName}}
	return client.IgnoreNotFound(s.client.Patch(ctx, pod, client.RawPatch(types.MergePatchType, patch)))
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
