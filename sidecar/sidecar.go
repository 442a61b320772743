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
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/sidecar/engine"
	"github.com/idemcp/idemcp/sidecar/httpproxy"
	"github.com/idemcp/idemcp/sidecar/policy"
	"github.com/idemcp/idemcp/sidecar/store"
	redisstore "github.com/idemcp/idemcp/sidecar/store/redis"
)

// Options are the sidecar's flags; each also reads IDEMCP_<FLAG> from the
// environment (IDEMCP_LISTEN, IDEMCP_UPSTREAM, ...).
type Options struct {
	Listen     string
	Upstream   string
	PolicyFile string
	// Policy is an inline IdempotencyPolicy manifest (YAML or JSON): the
	// snapshot the webhook writes into an injected sidecar's env.
	Policy           string
	AdminListen      string
	MaxBodyBytes     int64
	MaxResponseBytes int64
	Store            StoreOptions
	ShutdownTimeout  time.Duration
	LogLevel         string
}

// StoreOptions choose and reach the store; `idemcp sidecar` and
// `idemcp wrap` share them.
type StoreOptions struct {
	// Kind overrides the policy's store.type: "memory" or "redis".
	Kind             string
	MemoryMaxEntries int
	// RedisAddrs, RedisSentinelMaster and RedisTLS override
	// store.redis.external of the policy.
	RedisAddrs          string
	RedisSentinelMaster string
	RedisTLS            bool
	// RedisPasswordFile holds the Redis password; without it the password
	// comes from IDEMCP_REDIS_PASSWORD (a secretKeyRef env var in a pod).
	RedisPasswordFile string
	RedisKeyPrefix    string
}

// Flags registers the store flags on fs, with defaults from the environment.
func (o *StoreOptions) Flags(fs *flag.FlagSet) {
	fs.StringVar(&o.Kind, "store", Env("STORE", ""), "memory or redis (default: the policy's spec.store.type)")
	fs.IntVar(&o.MemoryMaxEntries, "memory-max-entries", int(EnvInt("MEMORY_MAX_ENTRIES", store.DefaultMaxEntries)), "most records the memory store holds")
	fs.StringVar(&o.RedisAddrs, "redis-addr", Env("REDIS_ADDR", ""), "Redis host:port, comma-separated for Cluster seeds or Sentinels (default: the policy's store.redis.external.addresses)")
	fs.StringVar(&o.RedisSentinelMaster, "redis-sentinel-master", Env("REDIS_SENTINEL_MASTER", ""), "master name when --redis-addr lists Sentinels")
	fs.BoolVar(&o.RedisTLS, "redis-tls", EnvBool("REDIS_TLS"), "connect to Redis with TLS")
	fs.StringVar(&o.RedisPasswordFile, "redis-password-file", Env("REDIS_PASSWORD_FILE", ""), "file holding the Redis password (default: $IDEMCP_REDIS_PASSWORD)")
	fs.StringVar(&o.RedisKeyPrefix, "redis-key-prefix", Env("REDIS_KEY_PREFIX", ""), "prefix of every Redis key (default: idemcp:NAMESPACE/POLICY:)")
}

// Flags registers the options on fs, with defaults from the environment.
func (o *Options) Flags(fs *flag.FlagSet) {
	fs.StringVar(&o.Listen, "listen", Env("LISTEN", ":8081"), "address the proxy listens on")
	fs.StringVar(&o.Upstream, "upstream", Env("UPSTREAM", ""), "URL of the MCP server, such as http://127.0.0.1:8080 (required)")
	fs.StringVar(&o.PolicyFile, "policy-file", Env("POLICY_FILE", ""), "an IdempotencyPolicy YAML file; only its spec is used (default: Memory store, Session scope, Auto, 24h TTL)")
	fs.StringVar(&o.Policy, "policy", Env("POLICY", ""), "an inline IdempotencyPolicy manifest (YAML or JSON), as the webhook injects it; exclusive with --policy-file")
	fs.StringVar(&o.AdminListen, "admin-listen", Env("ADMIN_LISTEN", ":9091"), "address of /healthz, /readyz and /metrics (empty: off)")
	fs.Int64Var(&o.MaxBodyBytes, "max-body-bytes", EnvInt("MAX_BODY_BYTES", httpproxy.DefaultMaxBodyBytes), "largest request body accepted")
	fs.Int64Var(&o.MaxResponseBytes, "max-response-bytes", EnvInt("MAX_RESPONSE_BYTES", httpproxy.DefaultMaxResponseBytes), "largest response message of a deduplicated call that is relayed")
	o.Store.Flags(fs)
	fs.DurationVar(&o.ShutdownTimeout, "shutdown-timeout", EnvDuration("SHUTDOWN_TIMEOUT", 30*time.Second), "how long to wait for calls in flight when stopping")
	fs.StringVar(&o.LogLevel, "log-level", Env("LOG_LEVEL", "info"), "debug, info, warn or error")
}

// Main runs `idemcp sidecar ARGS` until ctx ends.
func Main(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("idemcp sidecar", flag.ContinueOnError)
	var o Options
	o.Flags(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	s, err := New(o)
	if err != nil {
		return err
	}
	return s.Run(ctx)
}

// Sidecar is a configured proxy, ready to run.
type Sidecar struct {
	opts     Options
	log      *slog.Logger
	engine   *engine.Engine
	store    store.Store
	proxy    *httpproxy.Proxy
	registry *prometheus.Registry
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
	pol, err := LoadPolicy(o.PolicyFile, o.Policy)
	if err != nil {
		return nil, err
	}
	st, err := OpenStore(o.Store, pol, log)
	if err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	eng := engine.New(engine.Options{Policy: pol, Store: st, Metrics: engine.NewMetrics(reg), Logger: log})
	return &Sidecar{
		opts:     o,
		log:      log,
		engine:   eng,
		store:    st,
		registry: reg,
		proxy: httpproxy.New(httpproxy.Options{
			Upstream:         up,
			Engine:           eng,
			MaxBodyBytes:     o.MaxBodyBytes,
			MaxResponseBytes: o.MaxResponseBytes,
			Logger:           log,
		}),
	}, nil
}

// OpenStore opens the store the options and the policy ask for.
func OpenStore(o StoreOptions, p *policy.Policy, log *slog.Logger) (store.Store, error) {
	kind := strings.ToLower(o.Kind)
	if kind == "" {
		kind = strings.ToLower(string(p.Spec.Store.Type))
	}
	switch kind {
	case "memory":
		return store.NewMemory(o.MemoryMaxEntries), nil
	case "redis":
		ro, err := redisOptions(o, p)
		if err != nil {
			return nil, err
		}
		redis.SetLogger(redisLogger{log})
		return redisstore.New(ro)
	default:
		return nil, fmt.Errorf("--store: %q is not one of memory, redis", o.Kind)
	}
}

// redisOptions merges the flags over the policy's store.redis.external.
// Secrets never come from the policy: the password is a file or an env var.
func redisOptions(o StoreOptions, p *policy.Policy) (redisstore.Options, error) {
	var ro redisstore.Options
	if r := p.Spec.Store.Redis; r != nil && r.External != nil {
		ro.Addrs = r.External.Addresses
		ro.SentinelMaster = r.External.SentinelMaster
		ro.TLS = r.External.TLS
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
		return ro, errors.New("--redis-addr: the Redis store needs an address (host:port); set --redis-addr or the policy's store.redis.external.addresses")
	}
	if o.RedisSentinelMaster != "" {
		ro.SentinelMaster = o.RedisSentinelMaster
	}
	ro.TLS = ro.TLS || o.RedisTLS
	ro.Password = os.Getenv("IDEMCP_REDIS_PASSWORD")
	if o.RedisPasswordFile != "" {
		b, err := os.ReadFile(o.RedisPasswordFile)
		if err != nil {
			return ro, fmt.Errorf("--redis-password-file: %w", err)
		}
		ro.Password = strings.TrimRight(string(b), "\r\n")
	}
	ro.Prefix = o.RedisKeyPrefix
	if ro.Prefix == "" {
		ns, name := p.Namespace, p.Name
		if ns == "" {
			ns = "default"
		}
		if name == "" {
			name = "default"
		}
		ro.Prefix = "idemcp:" + ns + "/" + name + ":"
	}
	return ro, nil
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
func (s *Sidecar) Handler() http.Handler { return s.proxy }

// AdminHandler serves /healthz, /readyz and /metrics.
func (s *Sidecar) AdminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		// A store outage is not a reason to pull the pod from its Service:
		// passthrough traffic still works, and onStoreUnavailable decides
		// for deduplicated calls. The body says how the store is.
		ctx, cancel := context.WithTimeout(r.Context(), time.Second)
		defer cancel()
		state := "reachable"
		if err := s.store.Ping(ctx); err != nil {
			state = "unreachable (" + err.Error() + ")"
		}
		_, _ = fmt.Fprintf(w, "ok policy=%s store=%s\n", s.engine.Policy().Hash, state)
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
	servers := []*http.Server{{Handler: s.proxy, ReadHeaderTimeout: 10 * time.Second}}
	listeners := []net.Listener{ln}
	if s.opts.AdminListen != "" {
		aln, err := net.Listen("tcp", s.opts.AdminListen)
		if err != nil {
			_ = ln.Close()
			return fmt.Errorf("--admin-listen: %w", err)
		}
		servers = append(servers, &http.Server{Handler: s.AdminHandler(), ReadHeaderTimeout: 10 * time.Second})
		listeners = append(listeners, aln)
	}
	s.log.Info("Sidecar listening", "listen", ln.Addr().String(), "upstream", s.opts.Upstream,
		"policy", s.engine.Policy().Hash, "store", s.engine.Policy().Spec.Store.Type)
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
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
