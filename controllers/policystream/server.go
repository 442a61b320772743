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
	"context"
	"crypto/sha256"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"
	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/manager"
)

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
	// ticketKey returns the key of review tickets (nil: none issued or
	// taken); set when the listener has the serving key.
	ticketKey func() ([]byte, error)

	keyAnswers keyAnswers

	mu       sync.Mutex
	policies map[types.NamespacedName]*policyState
	// addr is the bound listener's address, for tests.
	addr chan net.Addr
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

// maxGone bounds policyState.gone.
const maxGone = 8

// refreshTimeout bounds the read of a policy shared by connecting streams.
const refreshTimeout = 10 * time.Second
