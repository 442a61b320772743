package storeopen

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
)

// Info says which store a sidecar or wrapper runs on, as its startup
// log shows it: the store in use, which flags may have chosen over the
// policy's store.type.
type Info struct {
	// Kind is Memory, Redis or Postgres.
	Kind string
	// Mode is how Redis is reached: standalone, sentinel or cluster.
	Mode string
	// Address is where the store is: Redis host:port (comma-separated for
	// Sentinels or Cluster seeds), Postgres host:port/database. Never a
	// password.
	Address string
	// KeyPrefix is the prefix of the store's keys.
	KeyPrefix string
}

// LogAttrs are the store's attributes for a log line.
func (i Info) LogAttrs() []any {
	attrs := []any{"store", i.Kind}
	if i.Mode != "" {
		attrs = append(attrs, "storeMode", i.Mode)
	}
	if i.Address != "" {
		attrs = append(attrs, "storeAddress", i.Address)
	}
	if i.KeyPrefix != "" {
		attrs = append(attrs, "keyPrefix", i.KeyPrefix)
	}
	return attrs
}

func redisInfo(ro redisstore.Options) Info {
	mode := "standalone"
	switch {
	case ro.SentinelMaster != "":
		mode = "sentinel, master " + ro.SentinelMaster
	case ro.Cluster || len(ro.Addrs) > 1:
		mode = "cluster"
	}
	if ro.TLS {
		mode += ", TLS"
	}
	return Info{Kind: "Redis", Mode: mode, Address: strings.Join(ro.Addrs, ","), KeyPrefix: ro.Prefix}
}

func postgresInfo(url string) Info {
	info := Info{Kind: "Postgres"}
	if cfg, err := pgconn.ParseConfig(url); err == nil {
		info.Address = net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))) + "/" + cfg.Database
	}
	return info
}

// startupCheckTimeout bounds the startup check of a shared store.
const startupCheckTimeout = 5 * time.Second

// Check pings a shared store once at startup and says in the log
// whether it answers: a store that is unreachable, or that refuses the
// password, gets a warning naming its address and the cause. Startup goes
// on either way: the store may come up later, the sidecar reconnects by
// itself, and the policy's onStoreUnavailable decides for the calls until
// then.
func Check(ctx context.Context, st store.Store, info Info, p *policy.Policy, log *slog.Logger) {
	if info.Kind == "" || info.Kind == "Memory" {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, startupCheckTimeout)
	defer cancel()
	err := st.Ping(ctx)
	if err == nil {
		log.Info("Store reachable", "store", info.Kind, "storeAddress", info.Address)
		return
	}
	if errors.Is(err, context.Canceled) {
		return
	}
	until := "deduplicated calls are refused (onStoreUnavailable: FailClosed) until it answers"
	if p.OnStoreUnavailable == v1alpha1.FailOpen {
		until = "deduplicated calls are forwarded without deduplication (onStoreUnavailable: FailOpen) until it answers"
	}
	msg := "Store unreachable at startup"
	hint := "check the address and that the store runs"
	if refusesPassword(err) {
		msg = "Store refuses the password"
		hint = "check the password (IDEMCP_REDIS_PASSWORD, --redis-password-file, the URL's, or the policy's Secret)"
		if info.Kind == "Postgres" {
			hint = "check the user and password (the connection string, IDEMCP_POSTGRES_PASSWORD or --postgres-password-file)"
		}
	}
	log.Warn(msg, "store", info.Kind, "storeAddress", info.Address, "cause", cause(err), "hint", hint, "calls", until)
}

// refusesPassword tells an authentication failure from a store that is
// away: Redis answers NOAUTH (a password is needed), WRONGPASS (a wrong
// one), or that no password is configured; PostgreSQL answers SQLSTATE
// 28P01 (invalid_password) or 28000 (invalid_authorization_specification).
func refusesPassword(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == "28P01" || pgErr.Code == "28000"
	}
	m := err.Error()
	for _, s := range []string{"NOAUTH", "WRONGPASS", "invalid password", "without any password configured", "invalid username-password"} {
		if strings.Contains(m, s) {
			return true
		}
	}
	return false
}

// cause is what the store or the network said, without our wrapping.
func cause(err error) string {
	m := err.Error()
	if _, after, ok := strings.Cut(m, store.ErrUnavailable.Error()+": "); ok {
		m = after
	}
	return m
}
