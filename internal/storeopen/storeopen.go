// Package storeopen opens the store that `idemcp sidecar` and `idemcp wrap`
// run on: their shared store flags, the policy's store.type under them,
// sealing, and the startup check. It lives apart from both commands so
// that neither imports the other.
package storeopen

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/cli"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
)

// Options choose and reach the store; `idemcp sidecar` and
// `idemcp wrap` share them.
type Options struct {
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
func (o *Options) Flags(fs *flag.FlagSet) {
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
func (o *Options) BindEnv(s *cli.Set) {
	s.AlsoEnv("redis-url", "REDIS_URL")
	s.AlsoEnv("postgres-url", "DATABASE_URL")
}

// Open opens the store the options and the policy ask for, sealed
// when a seal keyring is given (see seal.go), and says which one it is,
// for the startup log.
func Open(o Options, p *policy.Policy, log *slog.Logger) (store.Store, Info, error) {
	ring, err := sealKeyring(o)
	if err != nil {
		return nil, Info{}, err
	}
	st, info, err := openStore(o, p, log)
	if err != nil {
		return nil, Info{}, err
	}
	prefix := info.KeyPrefix
	if info.Kind == "Memory" {
		prefix = "memory:"
	}
	return sealStore(st, ring, prefix, o, log), info, nil
}

func openStore(o Options, p *policy.Policy, log *slog.Logger) (store.Store, Info, error) {
	kind := strings.ToLower(o.Kind)
	if kind == "" {
		kind = strings.ToLower(string(p.Spec.Store.Type))
	}
	switch kind {
	case "memory":
		return store.NewMemorySized(o.MemoryMaxEntries, o.MemoryMaxBytes), Info{Kind: "Memory"}, nil
	case "redis":
		ro, err := redisOptions(o, p)
		if err != nil {
			return nil, Info{}, err
		}
		redis.SetLogger(redisLogger{log})
		info := redisInfo(ro)
		st, err := redisstore.New(ro)
		if err != nil {
			return nil, Info{}, err
		}
		info.KeyPrefix = st.KeyPrefix() // what seals bind to
		return st, info, nil
	case "postgres":
		return openPostgres(o, p)
	default:
		return nil, Info{}, fmt.Errorf("--store: %q is not one of memory, redis, postgres", kind)
	}
}

// minReplicas is how many Redis replicas every write waits for, and for
// how long: the policy's store.redis.external.minReplicas, or the flag's
// when higher (the flag may raise the policy's guarantee, never lower it).
func minReplicas(o Options, p *policy.Policy) (int, time.Duration) {
	n, timeout := o.RedisMinReplicas, o.RedisReplicaTimeout
	if r := p.Spec.Store.Redis; r != nil && r.External != nil && int(r.External.MinReplicas) > n {
		n = int(r.External.MinReplicas)
		if t := r.External.MinReplicasTimeout; t != nil && t.Duration > 0 {
			timeout = t.Duration
		}
	}
	return n, timeout
}

// ApplyReplicas gives a Redis store that serves the minReplicas of a
// policy applied live (the webhook's snapshot, then each push): a change of
// store.redis.external.minReplicas or minReplicasTimeout holds from the
// next call, with no restart. It reports whether the setting changed; any
// other store is left as it is.
func ApplyReplicas(st store.Store, o Options, p *policy.Policy) (changed bool, n int, err error) {
	rs, ok := store.As[*redisstore.Store](st)
	if !ok {
		return false, 0, nil
	}
	n, timeout := minReplicas(o, p)
	if timeout <= 0 {
		timeout = redisstore.DefaultReplicaTimeout
	}
	if n == rs.MinReplicas() && timeout == rs.ReplicaTimeout() {
		return false, n, nil
	}
	return true, n, rs.SetMinReplicas(n, timeout)
}

// redisOptions merges the flags over the policy's store.redis.external.
// Secrets never come from the policy: the password is a file or an env var.
func redisOptions(o Options, p *policy.Policy) (redisstore.Options, error) {
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
	ro.MinReplicas, ro.ReplicaTimeout = minReplicas(o, p)
	if r := p.Spec.Store.Redis; r != nil && r.External != nil && len(ro.Addrs) == 0 {
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
		if ro.Password, err = passwordFile("--redis-password-file", o.RedisPasswordFile); err != nil {
			return ro, err
		}
	}
	ro.Prefix = o.RedisKeyPrefix
	if ro.Prefix == "" {
		ro.Prefix = defaultPrefix(o, p)
	}
	return ro, nil
}

// passwordFile reads the password in the file a flag names, without the
// line end an editor or echo leaves.
func passwordFile(flag, path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("%s: %w", flag, err)
	}
	return strings.TrimRight(string(b), "\r\n"), nil
}

// defaultPrefix keeps apart, in a shared store, the records of different
// policies and, when run by hand, of different MCP servers: a policy's key
// space belongs to one MCP server, and two servers must never replay each
// other's results.
func defaultPrefix(o Options, p *policy.Policy) string {
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
// lookups) to the command's log at debug level.
type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.DebugContext(ctx, "redis: "+fmt.Sprintf(format, v...))
}
