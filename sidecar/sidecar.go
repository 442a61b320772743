// Package sidecar is the `idemcp sidecar` command: the dedup proxy that
// runs beside an MCP server in a pod (or on a laptop in front of a
// Streamable HTTP server).
package sidecar

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
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
	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/cli"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
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
	Store            StoreOptions
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

// StoreOptions choose and reach the store; `idemcp sidecar` and
// `idemcp wrap` share them.
type StoreOptions struct {
	// Kind overrides the policy's store.type: "memory", "redis" or "postgres".
	Kind             string
	MemoryMaxEntries int
	MemoryMaxBytes   int64
	// RedisAddrs, RedisSentinelMaster and RedisTLS override
	// store.redis.external of the policy.
	RedisAddrs          string
	RedisSentinelMaster string
	RedisTLS            bool
	// RedisPasswordFile holds the Redis password; without it the password
	// comes from IDEMCP_REDIS_PASSWORD (a secretKeyRef env var in a pod).
	RedisPasswordFile string
	RedisKeyPrefix    string
	// RedisMinReplicas makes every claim and stored result wait until this
	// many replicas acknowledge it (Redis WAIT), for RedisReplicaTimeout.
	RedisMinReplicas    int
	RedisReplicaTimeout time.Duration
	// Upstream names the MCP server (its URL, or the command `wrap` runs).
	// Without --redis-key-prefix, the key prefix names it: a policy's key
	// space belongs to one MCP server, and two servers that share a Redis
	// must never replay each other's results. Not a flag: set by the
	// command.
	Upstream string
	// RedisURL is a redis:// or rediss:// URL (the REDIS_URL convention);
	// --redis-addr and the password flags override its parts.
	RedisURL string
	// PostgresURL, PostgresPasswordFile, PostgresListenURL and
	// PostgresKeyPrefix configure the PostgreSQL store (see postgres.go).
	PostgresURL          string
	PostgresPasswordFile string
	PostgresListenURL    string
	PostgresKeyPrefix    string
	// SealKeysFile holds the seal keyring; without it the keyring comes
	// from IDEMCP_SEAL_KEYS (a secretKeyRef env var in a pod). See seal.go.
	SealKeysFile string
	// SealOpenFailures counts stored results that failed to open, by
	// reason (nil: not counted). Not a flag: set by the command.
	SealOpenFailures *prometheus.CounterVec
}

// Flags registers the store flags on fs; BindEnv gives each its
// IDEMCP_* variable.
func (o *StoreOptions) Flags(fs *flag.FlagSet) {
	fs.Var(cli.Choice(&o.Kind, "", "memory", "redis", "postgres"), "store", "memory, redis or postgres (default: the policy's spec.store.type)")
	fs.IntVar(&o.MemoryMaxEntries, "memory-max-entries", store.DefaultMaxEntries, "most records the memory store holds")
	fs.Int64Var(&o.MemoryMaxBytes, "memory-store-max-bytes", store.DefaultMaxBytes, "most bytes the memory store's records take; the oldest completed results of the principal holding the most make room")
	fs.StringVar(&o.RedisAddrs, "redis-addr", "", "Redis host:port, comma-separated for Cluster seeds or Sentinels (default: the policy's store.redis.external.addresses)")
	fs.StringVar(&o.RedisSentinelMaster, "redis-sentinel-master", "", "master name when --redis-addr lists Sentinels")
	fs.BoolVar(&o.RedisTLS, "redis-tls", false, "connect to Redis with TLS")
	fs.StringVar(&o.RedisPasswordFile, "redis-password-file", "", "file holding the Redis password (default: $IDEMCP_REDIS_PASSWORD)")
	fs.StringVar(&o.RedisKeyPrefix, "redis-key-prefix", "", "prefix of every Redis key; the sidecars of one MCP server share it (default: idemcp:NAMESPACE/POLICY: plus a hash of the upstream)")
	fs.IntVar(&o.RedisMinReplicas, "redis-min-replicas", 0, "make every claim, renewal and stored result wait until this many Redis replicas have it (WAIT); fewer in time is a store failure, and onStoreUnavailable decides (0: do not wait). The policy's store.redis.external.minReplicas applies when it is higher")
	fs.DurationVar(&o.RedisReplicaTimeout, "redis-min-replicas-timeout", redisstore.DefaultReplicaTimeout, "how long a write waits for --redis-min-replicas")
	o.extraFlags(fs)
	o.sealFlags(fs)
}

// BindEnv binds the store flags to the variables of other tools' conventions
// (REDIS_URL, DATABASE_URL), read when the IDEMCP_* ones are not set.
func (o *StoreOptions) BindEnv(s *cli.Set) {
	s.AlsoEnv("redis-url", "REDIS_URL")
	s.AlsoEnv("postgres-url", "DATABASE_URL")
}

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
	fs.DurationVar(&o.RetryWindow, "retry-window", 0, RetryWindowFlag)
	fs.StringVar(&o.AdminListen, "admin-listen", DefaultAdminListen, "address of /healthz, /readyz and /metrics (empty: off); the webhook sets the pod's admin port")
	fs.Int64Var(&o.MaxBodyBytes, "max-body-bytes", httpproxy.DefaultMaxBodyBytes, "largest request body accepted")
	fs.Int64Var(&o.MaxResponseBytes, "max-response-bytes", httpproxy.DefaultMaxResponseBytes, "largest response message of a deduplicated call that is relayed")
	o.Store.Flags(fs)
	o.Push.Flags(fs)
	o.Limits.Flags(fs)
	fs.DurationVar(&o.ShutdownTimeout, "shutdown-timeout", 30*time.Second, "how long to wait for calls in flight when stopping")
	fs.Var(cli.Choice(&o.LogLevel, "info", "debug", "info", "warn", "error"), "log-level", "debug, info, warn or error")
	fs.BoolVar(&o.Tracing, "tracing", false, TracingFlag)
}

// TracingFlag is the help of --tracing, for sidecar and wrap.
const TracingFlag = "export an OpenTelemetry span for every tools/call, configured by the OTEL_* environment variables (default: only under a policy with spec.tracing.enabled)"

// NewTracing returns the engine's tracing for --tracing: spans go to a
// provider made from the OTEL_* environment the first time a call is
// traced, and lazy.Shutdown flushes them.
func NewTracing(on bool, service string, log *slog.Logger) (engine.Tracing, *tracing.Lazy) {
	lazy := tracing.NewLazy(service, func(err error) {
		log.Error("Tracing is turned on but its exporter cannot be made; no spans are exported", "err", err)
	})
	return engine.Tracing{Provider: lazy.Provider, On: on}, lazy
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
	return fs.Attribute(s.Run(ctx))
}

// Sidecar is a configured proxy, ready to run.
type Sidecar struct {
	opts      Options
	log       *slog.Logger
	engine    *engine.Engine
	store     store.Store
	storeInfo StoreInfo
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
		return nil, fmt.Errorf("--upstream: %q is not an http:// or https:// URL with a host", o.Upstream)
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
	pol, err := LoadPolicy(o.PolicyFile, o.Policy)
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
	if pol, err = WithRetryWindow(pol, o.RetryWindow); err != nil {
		return nil, err
	}
	if o.Store.Upstream == "" {
		o.Store.Upstream = up.String()
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if o.Store.SealOpenFailures == nil {
		o.Store.SealOpenFailures = NewSealMetrics(reg)
	}
	st, info, err := OpenStore(o.Store, pol, log)
	if err != nil {
		return nil, err
	}
	st = store.Timed(st, newStoreDuration(reg))
	tr, spans := NewTracing(o.Tracing, "idemcp-sidecar", log)
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

// OpenStore opens the store the options and the policy ask for, sealed
// when a seal keyring is given (see seal.go), and says which one it is,
// for the startup log.
func OpenStore(o StoreOptions, p *policy.Policy, log *slog.Logger) (store.Store, StoreInfo, error) {
	ring, err := sealKeyring(o)
	if err != nil {
		return nil, StoreInfo{}, err
	}
	st, info, err := openStore(o, p, log)
	if err != nil {
		return nil, StoreInfo{}, err
	}
	prefix := info.KeyPrefix
	if info.Kind == "Memory" {
		prefix = "memory:"
	}
	return sealStore(st, ring, prefix, o, log), info, nil
}

func openStore(o StoreOptions, p *policy.Policy, log *slog.Logger) (store.Store, StoreInfo, error) {
	kind := strings.ToLower(o.Kind)
	if kind == "" {
		kind = strings.ToLower(string(p.Spec.Store.Type))
	}
	switch kind {
	case "memory":
		return store.NewMemorySized(o.MemoryMaxEntries, o.MemoryMaxBytes), StoreInfo{Kind: "Memory"}, nil
	case "redis":
		ro, err := redisOptions(o, p)
		if err != nil {
			return nil, StoreInfo{}, err
		}
		redis.SetLogger(redisLogger{log})
		info := redisInfo(ro)
		st, err := redisstore.New(ro)
		if err != nil {
			return nil, StoreInfo{}, err
		}
		info.KeyPrefix = st.KeyPrefix() // what seals bind to
		return st, info, nil
	case "postgres":
		return openPostgres(o, p)
	default:
		return nil, StoreInfo{}, fmt.Errorf("--store: %q is not one of memory, redis, postgres", kind)
	}
}

// redisOptions merges the flags over the policy's store.redis.external.
// Secrets never come from the policy: the password is a file or an env var.
func redisOptions(o StoreOptions, p *policy.Policy) (redisstore.Options, error) {
	ro, err := redisURLOptions(o.RedisURL)
	if err != nil {
		return ro, err
	}
	if o.RedisMinReplicas < 0 {
		return ro, fmt.Errorf("--redis-min-replicas %d: want a whole number of replicas, 0 or more", o.RedisMinReplicas)
	}
	if o.RedisReplicaTimeout < 0 {
		return ro, fmt.Errorf("--redis-min-replicas-timeout %v: want a positive duration such as 500ms or 2s", o.RedisReplicaTimeout)
	}
	ro.MinReplicas, ro.ReplicaTimeout = o.RedisMinReplicas, o.RedisReplicaTimeout
	if r := p.Spec.Store.Redis; r != nil && r.External != nil {
		if len(ro.Addrs) == 0 {
			ro.Addrs = r.External.Addresses
			ro.SentinelMaster = r.External.SentinelMaster
			ro.TLS = r.External.TLS
		}
		// The flag may raise the policy's guarantee, never lower it.
		if n := int(r.External.MinReplicas); n > ro.MinReplicas {
			ro.MinReplicas = n
			if t := r.External.MinReplicasTimeout; t != nil && t.Duration > 0 {
				ro.ReplicaTimeout = t.Duration
			}
		}
	}
	if o.RedisAddrs != "" {
		ro.Addrs = nil
		for _, a := range strings.Split(o.RedisAddrs, ",") {
			if a = strings.TrimSpace(a); a != "" {
				ro.Addrs = append(ro.Addrs, a)
			}
		}
	}
	if len(ro.Addrs) == 0 {
		return ro, errors.New("--redis-addr: the Redis store needs an address (host:port); set --redis-addr, --redis-url (REDIS_URL) or the policy's store.redis.external.addresses")
	}
	if o.RedisSentinelMaster != "" {
		ro.SentinelMaster = o.RedisSentinelMaster
	}
	ro.TLS = ro.TLS || o.RedisTLS
	if pw := os.Getenv("IDEMCP_REDIS_PASSWORD"); pw != "" {
		ro.Password = pw
	}
	if o.RedisPasswordFile != "" {
		b, err := os.ReadFile(o.RedisPasswordFile)
		if err != nil {
			return ro, fmt.Errorf("--redis-password-file: %w", err)
		}
		ro.Password = strings.TrimRight(string(b), "\r\n")
	}
	ro.Prefix = o.RedisKeyPrefix
	if ro.Prefix == "" {
		ro.Prefix = defaultPrefix(o, p)
	}
	return ro, nil
}

// defaultPrefix keeps apart, in a shared store, the records of different
// policies and, when run by hand, of different MCP servers: a policy's key
// space belongs to one MCP server, and two servers must never replay each
// other's results.
func defaultPrefix(o StoreOptions, p *policy.Policy) string {
	prefix := policy.RedisKeyPrefix(p.Namespace, p.Name)
	if o.Upstream != "" {
		// A hash, not the URL or command itself: those may hold
		// credentials, and the store's operator reads key names.
		h := sha256.Sum256([]byte(o.Upstream))
		prefix += "up-" + hex.EncodeToString(h[:8]) + ":"
	}
	return prefix
}

// redisLogger sends go-redis's own messages (reconnects, Sentinel
// lookups) to the sidecar's log at debug level.
type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.DebugContext(ctx, "redis: "+fmt.Sprintf(format, v...))
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
	s.log.Info("Sidecar listening", append([]any{"listen", ln.Addr().String(), "admin", admin, "upstream", s.opts.Upstream,
		"upstreamDialIPs", s.opts.UpstreamDialIPs, "policy", pol.Hash}, s.storeInfo.LogAttrs()...)...)
	go CheckStore(ctx, s.store, s.storeInfo, pol, s.log)
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
