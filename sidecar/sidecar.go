// Package sidecar is the `idemcp sidecar` command: the dedup proxy that
// runs beside an MCP server in a pod (or on a laptop in front of a
// Streamable HTTP server).
package sidecar

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemcp/idemcp/internal/cli"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/storeopen"
	"github.com/idemcp/idemcp/internal/tracing"
	"github.com/idemcp/idemcp/sidecar/httpproxy"
	"github.com/idemcp/idemcp/sidecar/policysync"
	"github.com/idemcp/idemcp/sidecar/toollist"
)

// Options are the sidecar's flags; each also reads IDEMCP_<FLAG> from the
// environment (IDEMCP_LISTEN, IDEMCP_UPSTREAM, ...; see NewFlagSet).
type Options struct {
	Listen   string
	Upstream string
	// UpstreamDialIPs are IP addresses, comma-separated, at which the
	// upstream's port is tried before the upstream URL's host: the pod's
	// IPs, which the webhook sets from the Downward API (httpproxy's
	// dial.go says why).
	UpstreamDialIPs string
	// UpstreamHost, if set, is the Host of the sidecar's own requests (the
	// tool listing), and the only Host under which a tools/list response
	// passing through teaches Auto ("": the upstream URL's host, and any
	// Host).
	UpstreamHost string
	// UpstreamHostHeader is client (the client's Host goes upstream) or
	// upstream (--upstream's host does: a remote server).
	UpstreamHostHeader string
	// UpstreamTLS configures TLS to an https:// upstream (upstreamtls.go).
	UpstreamTLS UpstreamTLSOptions
	// KeySpace is the MCP server the keys belong to (engine.Options).
	KeySpace string
	// LegacyKeys is what the sidecar starts with for keys without its key
	// space (ParseLegacyKeys); the policy stream brings every change.
	LegacyKeys string
	PolicyFile string
	// RetryWindow, when not 0, overrides the policy's spec.retryWindow
	// (--retry-window), for a sidecar run without a manager.
	RetryWindow time.Duration
	// Policy is an inline IdempotencyPolicy manifest (YAML or JSON): the
	// snapshot the webhook writes into an injected sidecar's env.
	Policy           string
	AdminListen      string
	MaxBodyBytes     int64
	MaxResponseBytes int64
	Store            storeopen.Options
	ShutdownTimeout  time.Duration
	LogLevel         string
	// Tracing exports a span for every tools/call, whatever the policy's
	// spec.tracing says (docs/tracing.md).
	Tracing bool
	Push    PushOptions
	Limits  LimitOptions
}

// LimitOptions bound what one caller, or all of them, can hold in the
// sidecar at once. 0 means the default; a negative value, no bound.
type LimitOptions struct {
	MaxWaitersPerKey       int
	MaxWaitersPerPrincipal int
	MaxStreamsPerPrincipal int
	MaxStreams             int
	MaxRunningPerPrincipal int
	MaxRunning             int
	// MaxConnections bounds the proxy's client connections (0: the
	// default of maxConnections).
	MaxConnections int
}

// Flags registers the limit flags on fs.
func (o *LimitOptions) Flags(fs *flag.FlagSet) {
	fs.IntVar(&o.MaxWaitersPerKey, "max-waiters-per-key", engine.DefaultMaxWaitersPerKey, "most duplicates waiting at once for one call in flight; more get error -32017 (negative: no bound)")
	fs.IntVar(&o.MaxWaitersPerPrincipal, "max-waiters-per-principal", engine.DefaultMaxWaitersPerPrincipal, "most duplicates one principal has waiting at once for calls in flight (callers with no principal count as one); more get error -32017 (negative: no bound)")
	fs.IntVar(&o.MaxStreamsPerPrincipal, "max-streams-per-principal", httpproxy.DefaultMaxStreamsPerPrincipal, "most requests and streams one principal holds open at once (callers with no principal count as one); more get HTTP 429 (negative: no bound)")
	fs.IntVar(&o.MaxStreams, "max-streams", httpproxy.DefaultMaxStreams, "most requests and streams the sidecar holds open at once; more get HTTP 503 (negative: no bound)")
	fs.IntVar(&o.MaxRunningPerPrincipal, "max-running-per-principal", engine.DefaultMaxRunningPerPrincipal, "most deduplicated calls one principal has running upstream at once, those whose client left included (callers with no principal count as one); more get error -32017 and do not run (negative: no bound)")
	fs.IntVar(&o.MaxRunning, "max-running", engine.DefaultMaxRunning, "most deduplicated calls running upstream at once, for all callers together; more get error -32017 and do not run (negative: no bound)")
	fs.IntVar(&o.MaxConnections, "max-connections", 0, "most client connections the proxy port holds at once; more are answered 503 and closed (0: 20000, or the open-file limit less 1024 if that is lower; negative: no bound)")
}

// maxConnections is the proxy's connection bound for --max-connections
// n: under the open-file limit, with room left for the connections to
// the MCP server and the store, so that a flood of clients never makes
// the sidecar unable to reach them.
func maxConnections(n int) int {
	if n != 0 {
		return n
	}
	n = DefaultMaxConnections
	if limit := openFileLimit(); limit > 0 && limit < uint64(n)+1024 {
		n = max(256, int(limit)-1024)
	}
	return n
}

// DefaultMaxConnections is --max-connections when the open-file limit
// allows it: more than --max-streams, since each HTTP/1 stream holds a
// connection.
const DefaultMaxConnections = 20000

// Flags registers the options on fs.
func (o *Options) Flags(fs *flag.FlagSet) {
	fs.StringVar(&o.Listen, "listen", ":8081", "address the proxy listens on")
	fs.StringVar(&o.Upstream, "upstream", "", "URL of the MCP server, such as http://127.0.0.1:8080 (required)")
	fs.StringVar(&o.UpstreamDialIPs, "upstream-dial-ips", "", "IP addresses, comma-separated, where the sidecar connects to the upstream's port first, falling back to --upstream's host when nothing listens there; the webhook sets the pod's IPs, so that the MCP server sees requests to its pod IP, not loopback (empty: --upstream's host only)")
	fs.StringVar(&o.UpstreamHost, "upstream-host", "", "the Host of the sidecar's own tool listing, for a server that allows only its public host names (such as mcp.shop.svc); then only tools/list responses to requests with this Host teach defaultMode Auto (empty: --upstream's host, and any Host)")
	o.upstreamFlags(fs)
	fs.StringVar(&o.KeySpace, "key-space", "", "the MCP server the keys belong to, part of every key: the webhook sets the pod's workload (Deployment/NAME), or the idemcp.io/key-space annotation's value, so that two workloads under one policy never replay each other's results (empty: keys of no workload; run by hand, the store's key prefix names the upstream instead)")
	fs.StringVar(&o.LegacyKeys, "legacy-keys", "", "what to do with keys without --key-space, made by pods of an idemcp before key spaces (the webhook sets the policy's status.legacyKeys): \"writers\" (such pods still run: derive keys without the key space, as they do), an RFC 3339 time (none is left: until then, a call not found under its key is looked for under the key without the key space), or empty (none)")
	fs.StringVar(&o.PolicyFile, "policy-file", "", "an IdempotencyPolicy YAML file; only its spec is used (default: Memory store, Session scope, Auto, 24h TTL, 10m retry window)")
	fs.StringVar(&o.Policy, "policy", "", "an inline IdempotencyPolicy manifest (YAML or JSON), as the webhook injects it; exclusive with --policy-file")
	fs.DurationVar(&o.RetryWindow, "retry-window", 0, policy.RetryWindowFlag)
	fs.StringVar(&o.AdminListen, "admin-listen", DefaultAdminListen, "address of /healthz, /readyz and /metrics (empty: off); the webhook sets the pod's admin port")
	fs.Int64Var(&o.MaxBodyBytes, "max-body-bytes", httpproxy.DefaultMaxBodyBytes, "largest request body accepted")
	fs.Int64Var(&o.MaxResponseBytes, "max-response-bytes", httpproxy.DefaultMaxResponseBytes, "largest response message of a deduplicated call that is relayed")
	o.Store.Flags(fs)
	o.Push.Flags(fs)
	o.Limits.Flags(fs)
	fs.DurationVar(&o.ShutdownTimeout, "shutdown-timeout", 30*time.Second, "how long to wait for calls in flight when stopping")
	fs.Var(cli.Choice(&o.LogLevel, "info", "debug", "info", "warn", "error"), "log-level", "debug, info, warn or error")
	fs.BoolVar(&o.Tracing, "tracing", false, engine.TracingFlag)
}

// DefaultAdminListen is loopback: run by hand, the metrics and probes are
// nobody else's business. In a pod the webhook gives the admin port
// explicitly, for the kubelet's probes and for scraping.
const DefaultAdminListen = "127.0.0.1:9091"

const sidecarIntro = `Usage: idemcp sidecar --upstream URL [flags]

Runs the dedup proxy in front of a Streamable HTTP (or legacy HTTP+SSE)
MCP server: retried tools/call requests get the first call's result.`

// NewFlagSet returns the flags of `idemcp sidecar`, bound to o and to
// their IDEMCP_* environment variables.
func NewFlagSet(o *Options) *cli.Set {
	s := cli.New("idemcp sidecar", sidecarIntro)
	o.Flags(s.FlagSet)
	s.BindEnv("IDEMCP_")
	o.Store.BindEnv(s)
	return s
}

// Main runs `idemcp sidecar ARGS` until ctx ends.
func Main(ctx context.Context, args []string) error {
	var o Options
	fs := NewFlagSet(&o)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q: idemcp sidecar takes only flags; run idemcp sidecar --help for them", fs.Arg(0))
	}
	s, err := New(o)
	if err != nil {
		return fs.Attribute(err)
	}
	cli.SetMemoryLimit(s.log)
	return fs.Attribute(s.Run(ctx))
}

// Sidecar is a configured proxy, ready to run.
type Sidecar struct {
	opts      Options
	log       *slog.Logger
	engine    *engine.Engine
	store     store.Store
	storeInfo storeopen.Info
	proxy     *httpproxy.Proxy
	handler   http.Handler
	lister    *toollist.Lister
	registry  *prometheus.Registry
	spans     *tracing.Lazy
	conns     *connMetrics
	storeDown atomic.Bool
	// push is the policy stream's client, nil without --policy-endpoint.
	push atomic.Pointer[policysync.Client]
}

// New checks the options, loads the policy and builds the store.
func New(o Options) (*Sidecar, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.LogLevel)); err != nil {
		return nil, fmt.Errorf("--log-level: %q is not one of debug, info, warn, error", o.LogLevel)
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if o.Upstream == "" {
		return nil, errors.New("--upstream is required: the MCP server's URL, such as http://127.0.0.1:8080")
	}
	up, err := url.Parse(o.Upstream)
	if err != nil || (up.Scheme != "http" && up.Scheme != "https") || up.Host == "" {
		shown := o.Upstream
		if err == nil {
			shown = up.Redacted() // a password in it stays out of the error
		}
		return nil, fmt.Errorf("--upstream: %q is not an http:// or https:// URL with a host", shown)
	}
	if h := o.UpstreamHost; h != "" {
		if u, err := url.Parse("http://" + h); err != nil || u.Host != h || u.User != nil {
			return nil, fmt.Errorf("--upstream-host: %q is not a host name with an optional port, such as mcp.shop.svc", h)
		}
	}
	dialIPs, err := parseDialIPs(o.UpstreamDialIPs)
	if err != nil {
		return nil, err
	}
	tlsConfig, err := o.UpstreamTLS.config(up)
	if err != nil {
		return nil, err
	}
	var outHost string
	if o.UpstreamHostHeader == HostHeaderUpstream {
		outHost = up.Host
	}
	pol, err := policy.Load(o.PolicyFile, o.Policy)
	if err != nil {
		return nil, err
	}
	legacy, err := ParseLegacyKeys(o.LegacyKeys)
	if err != nil {
		return nil, err
	}
	if o.RetryWindow != 0 && o.Push.Endpoint != "" {
		return nil, errors.New("--retry-window is for a sidecar without a manager; with --policy-endpoint set spec.retryWindow in the IdempotencyPolicy instead")
	}
	if pol, err = policy.WithRetryWindow(pol, o.RetryWindow); err != nil {
		return nil, err
	}
	if o.Store.Upstream == "" {
		// The server, not its credentials: a changed password must not move
		// the store's keys (a retry after the restart would run its call
		// again).
		server := *up
		server.User = nil
		o.Store.Upstream = server.String()
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if o.Store.SealOpenFailures == nil {
		o.Store.SealOpenFailures = storeopen.NewSealMetrics(reg)
	}
	st, info, err := storeopen.Open(o.Store, pol, log)
	if err != nil {
		return nil, err
	}
	st = store.Timed(st, storeopen.NewDurationMetrics(reg))
	tr, spans := engine.NewTracing(o.Tracing, "idemcp-sidecar", log)
	eng := engine.New(engine.Options{Policy: pol, Store: st, Metrics: engine.NewMetrics(reg), Logger: log, KeySpace: o.KeySpace, Tracing: tr,
		MaxWaitersPerKey: o.Limits.MaxWaitersPerKey, MaxWaitersPerPrincipal: o.Limits.MaxWaitersPerPrincipal,
		MaxRunningPerPrincipal: o.Limits.MaxRunningPerPrincipal, MaxRunning: o.Limits.MaxRunning,
		Pod: os.Getenv("POD_NAME")})
	eng.SetLegacyKeys(legacy)
	// Every connection to the MCP server goes through one dialer, which
	// remembers the address that answers.
	dialer := httpproxy.NewUpstreamDialer(up, dialIPs, log)
	proxy := httpproxy.New(httpproxy.Options{
		Upstream:         up,
		Dialer:           dialer,
		Engine:           eng,
		MaxBodyBytes:     o.MaxBodyBytes,
		MaxResponseBytes: o.MaxResponseBytes,
		Logger:           log,
		Registerer:       reg,

		MaxStreamsPerPrincipal: o.Limits.MaxStreamsPerPrincipal,
		MaxStreams:             o.Limits.MaxStreams,
		// The listing's target and the tap's: the configuration's.
		ToolsListPath: httpproxy.DefaultToolsListPath(up),
		ToolsListHost: o.UpstreamHost,

		Host:            outHost,
		TLSClientConfig: tlsConfig,
	})
	// Auto needs each tool's readOnlyHint before its first call: the
	// sidecar lists the tools itself rather than wait for a client to.
	lt := httpproxy.NewTransport()
	lt.MaxIdleConns, lt.MaxIdleConnsPerHost = 2, 2
	lt.DialContext = dialer.DialContext
	if tlsConfig != nil {
		lt.TLSClientConfig = tlsConfig.Clone()
	}
	lh := toollist.NewHTTP(&http.Client{Timeout: 30 * time.Second, Transport: lt}, up, o.UpstreamHost)
	lister := toollist.New(toollist.Options{Hints: eng.Hints(), List: lh.List, ListIn: lh.ListIn, Registerer: reg, Logger: log, Listed: eng.ReportAnnotations,
		OverBound: func() { eng.Metrics().OverLimit.WithLabelValues(engine.LimitToolsListContexts).Inc() }})
	lh.OnChanged(lister.Changed)
	return &Sidecar{spans: spans,
		opts:      o,
		log:       log,
		engine:    eng,
		store:     st,
		storeInfo: info,
		registry:  reg,
		conns:     newConnMetrics(reg),
		proxy:     proxy,
		handler:   lh.Watch(proxy),
		lister:    lister,
	}, nil
}

// parseDialIPs reads --upstream-dial-ips: the Downward API's
// status.podIPs, comma-separated, primary first.
func parseDialIPs(v string) ([]netip.Addr, error) {
	var ips []netip.Addr
	for _, f := range strings.Split(v, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		ip, err := netip.ParseAddr(f)
		if err != nil {
			return nil, fmt.Errorf("--upstream-dial-ips: %q is not an IP address; want IP addresses separated by commas, such as 10.1.2.3,fd00::3", f)
		}
		ips = append(ips, ip)
	}
	return ips, nil
}

// Engine returns the sidecar's engine.
func (s *Sidecar) Engine() *engine.Engine { return s.engine }

// Handler returns the proxy handler.
func (s *Sidecar) Handler() http.Handler { return s.handler }

// StartToolListing lists the upstream's tools now and whenever a call or
// the server asks for it, until ctx ends; Run does it itself.
func (s *Sidecar) StartToolListing(ctx context.Context) { s.lister.Start(ctx) }

// AdminHandler serves /healthz, /readyz and /metrics.
func (s *Sidecar) AdminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		// A store outage is not a reason to pull the pod from its Service:
		// passthrough traffic still works, and onStoreUnavailable decides
		// for deduplicated calls. The body says how the store is, not
		// why: the admin port is open to the cluster network, and a
		// store's error names its addresses and users. The cause goes to
		// the log, once each time the store is lost.
		ctx, cancel := context.WithTimeout(r.Context(), time.Second)
		defer cancel()
		state := "reachable"
		if err := s.store.Ping(ctx); err != nil {
			state = "unreachable"
			if !s.storeDown.Swap(true) {
				s.log.Warn("Store unreachable", append([]any{"err", err.Error()}, s.storeInfo.LogAttrs()...)...)
			}
		} else if s.storeDown.Swap(false) {
			s.log.Info("Store reachable again", s.storeInfo.LogAttrs()...)
		}
		// stream: whether the policy stream is open now (kubectl idemcp
		// status shows it per pod; the manager publishes only counts).
		stream := "off"
		if c := s.push.Load(); c != nil {
			stream = "disconnected"
			if c.Connected() {
				stream = "connected"
			}
		}
		_, _ = fmt.Fprintf(w, "ok policy=%s store=%s stream=%s\n", s.engine.Policy().Hash, state, stream)
	})
	mux.Handle("/metrics", promhttp.HandlerFor(s.registry, promhttp.HandlerOpts{}))
	return mux
}

// Run serves until ctx ends, then drains: calls running upstream finish
// and their results are stored before it returns.
func (s *Sidecar) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", s.opts.Listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	listCtx, stopListing := context.WithCancel(ctx)
	defer stopListing()
	s.lister.Start(listCtx)
	// No ReadTimeout or WriteTimeout on the proxy: they would cut SSE
	// streams. Request bodies have their own deadline (withBodyDeadline).
	servers := []*http.Server{{Handler: withBodyDeadline(bodyReadTimeout, s.handler), ReadHeaderTimeout: proxyReadHeaderTimeout, IdleTimeout: idleTimeout}}
	listeners := []net.Listener{newLimitListener(ln, "proxy", maxConnections(s.opts.Limits.MaxConnections), 0, s.conns)}
	if s.opts.AdminListen != "" {
		aln, err := net.Listen("tcp", s.opts.AdminListen)
		if err != nil {
			_ = ln.Close()
			return fmt.Errorf("--admin-listen: %w", err)
		}
		servers = append(servers, adminServer(s.AdminHandler()))
		listeners = append(listeners, newLimitListener(aln, "admin", adminMaxConns, adminMaxConnsPerClient, s.conns))
	}
	admin := "off"
	if len(listeners) > 1 {
		admin = listeners[1].Addr().String()
	}
	pol := s.engine.Policy()
	s.log.Info("Sidecar listening", append([]any{"listen", ln.Addr().String(), "admin", admin, "upstream", redactedURL(s.opts.Upstream),
		"upstreamDialIPs", s.opts.UpstreamDialIPs, "policy", pol.Hash}, s.storeInfo.LogAttrs()...)...)
	go storeopen.Check(ctx, s.store, s.storeInfo, pol, s.log)
	pushCtx, stopPush := context.WithCancel(ctx)
	defer stopPush()
	if err := s.startPush(pushCtx); err != nil {
		for _, l := range listeners {
			_ = l.Close()
		}
		return err
	}
	errc := make(chan error, len(servers))
	for i, srv := range servers {
		go func() { errc <- srv.Serve(listeners[i]) }()
	}
	select {
	case err = <-errc:
	case <-ctx.Done():
	}
	// Stop taking requests; streams that never end on their own (GET
	// streams, legacy sessions) are cut after a third of the time, then
	// the calls that still run upstream get the rest to finish and store.
	deadline := time.Now().Add(s.opts.ShutdownTimeout)
	shutdownCtx, cancel := context.WithTimeout(context.Background(), s.opts.ShutdownTimeout/3)
	defer cancel()
	for _, srv := range servers {
		if serr := srv.Shutdown(shutdownCtx); serr != nil {
			_ = srv.Close()
		}
	}
	drainCtx, cancelDrain := context.WithDeadline(context.Background(), deadline)
	defer cancelDrain()
	if derr := s.engine.Drain(drainCtx); derr != nil {
		s.log.Error("Calls still running at shutdown; their results are not stored", "err", derr)
	}
	_ = s.store.Close()
	if serr := s.spans.Shutdown(context.Background()); serr != nil {
		s.log.Warn("Spans not exported at shutdown", "err", serr)
	}
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// redactedURL is u with its password, if any, as "xxxxx", for logs.
func redactedURL(u string) string {
	if p, err := url.Parse(u); err == nil {
		return p.Redacted()
	}
	return u
}
