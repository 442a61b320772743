package httpproxy

import (
	"fmt"
	"net/http"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
)

// Default bounds on the requests a proxy holds open at once: every POST
// until its response ends, every GET stream (a Streamable HTTP session's, a
// resumed one, a legacy SSE session's). Each holds a connection, a
// goroutine and buffers: a client that opens thousands of sessions or
// streams would otherwise hold as many as it cares to.
const (
	DefaultMaxStreamsPerPrincipal = 4096
	DefaultMaxStreams             = 16384
)

// streams counts the requests open, by tenant (engine.Tenant: a hash of
// the principal; callers with no principal are one tenant) and in all.
type streams struct {
	mu        sync.Mutex
	byTenant  map[string]int
	total     int
	maxTenant int
	maxTotal  int
	open      prometheus.Gauge
}

func newStreams(maxTenant, maxTotal int) *streams {
	if maxTenant == 0 {
		maxTenant = DefaultMaxStreamsPerPrincipal
	}
	if maxTotal == 0 {
		maxTotal = DefaultMaxStreams
	}
	return &streams{
		byTenant: make(map[string]int), maxTenant: maxTenant, maxTotal: maxTotal,
		open: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idemcp_open_streams",
			Help: "Requests the proxy holds open: POSTs until their response ends, and GET streams.",
		}),
	}
}

// acquire takes a slot for a request of tenant, or returns the limit it is
// over (a negative bound is no bound).
func (s *streams) acquire(tenant string) (release func(), over string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.maxTenant > 0 && s.byTenant[tenant] >= s.maxTenant {
		return nil, engine.LimitStreamsPerPrincipal
	}
	if s.maxTotal > 0 && s.total >= s.maxTotal {
		return nil, engine.LimitStreamsTotal
	}
	s.byTenant[tenant]++
	s.total++
	s.open.Inc()
	return sync.OnceFunc(func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.byTenant[tenant]--; s.byTenant[tenant] == 0 {
			delete(s.byTenant, tenant)
		}
		s.total--
		s.open.Dec()
	}), ""
}

// Open reports how many requests the proxy holds open.
func (p *Proxy) Open() int {
	p.streams.mu.Lock()
	defer p.streams.mu.Unlock()
	return p.streams.total
}

// admit takes a stream slot for r, or answers it 429 (this principal is
// over its bound) or 503 (the sidecar is over its total) with a JSON-RPC
// error, counted in idemcp_over_limit_total, and returns false.
func (p *Proxy) admit(w http.ResponseWriter, r *http.Request) (release func(), ok bool) {
	release, over := p.streams.acquire(engine.Tenant(r.Header.Get(p.engine.Policy().PrincipalHeader)))
	if over == "" {
		return release, true
	}
	p.engine.Metrics().OverLimit.WithLabelValues(over).Inc()
	status, msg := http.StatusTooManyRequests, fmt.Sprintf(
		"this caller already holds %d requests and streams open through the idemcp sidecar (--max-streams-per-principal); close some, or retry later", p.streams.maxTenant)
	if over == engine.LimitStreamsTotal {
		status, msg = http.StatusServiceUnavailable, fmt.Sprintf(
			"the idemcp sidecar already holds %d requests and streams open (--max-streams); retry later", p.streams.maxTotal)
	}
	w.Header().Set("Retry-After", "1")
	writeError(w, r, status, nil, mcpmsg.CodeOverloaded, msg)
	return nil, false
}
