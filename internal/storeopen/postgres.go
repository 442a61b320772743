package storeopen

import (
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	pgstore "github.com/idemcp/idemcp/internal/store/postgres"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
)

// extraFlags registers the flags that follow the conventions of other
// tools: REDIS_URL and DATABASE_URL are read when the IDEMCP_ variables
// are not set (see BindEnv).
func (o *Options) extraFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.RedisURL, "redis-url", "", "redis:// or rediss:// URL of the Redis store, the alternative to --redis-addr (default: $REDIS_URL)")
	fs.StringVar(&o.PostgresURL, "postgres-url", "", "PostgreSQL connection string or postgres:// URL of the Postgres store (default: $DATABASE_URL); a pod gets it from the policy's store.postgres.urlSecretRef")
	fs.StringVar(&o.PostgresPasswordFile, "postgres-password-file", "", "file holding the PostgreSQL password, overriding the URL's (default: $IDEMCP_POSTGRES_PASSWORD)")
	fs.StringVar(&o.PostgresListenURL, "postgres-listen-url", "", "where waiters LISTEN when --postgres-url is a PgBouncer in transaction mode: the database itself (default: --postgres-url; without a working one, waiters poll)")
	fs.StringVar(&o.PostgresKeyPrefix, "postgres-key-prefix", "", "prefix of every key in the Postgres store; the sidecars of one MCP server share it (default: idemcp:NAMESPACE/POLICY: plus a hash of the upstream)")
}

// redisURLOptions reads a redis:// or rediss:// URL into store options.
func redisURLOptions(raw string) (redisstore.Options, error) {
	var ro redisstore.Options
	if raw == "" {
		return ro, nil
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "redis" && u.Scheme != "rediss") || u.Host == "" {
		return ro, fmt.Errorf("--redis-url (REDIS_URL): %s is not a redis:// or rediss:// URL with a host, such as redis://:password@redis.shop.svc:6379/0", redactURL(raw))
	}
	opt, err := redis.ParseURL(raw)
	if err != nil {
		return ro, fmt.Errorf("--redis-url (REDIS_URL): %s: %w", redactURL(raw), errors.New(strings.ReplaceAll(err.Error(), raw, redactURL(raw))))
	}
	ro.Addrs = []string{opt.Addr}
	ro.Username, ro.Password, ro.DB = opt.Username, opt.Password, opt.DB
	ro.TLS = u.Scheme == "rediss"
	return ro, nil
}

// redactURL hides a URL's password, for messages.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "the given URL"
	}
	return u.Redacted()
}

// openPostgres opens the Postgres store. The URL comes from the flag or
// the environment (a secretKeyRef in a pod), never from the policy.
func openPostgres(o Options, p *policy.Policy) (store.Store, Info, error) {
	if o.PostgresURL == "" {
		hint := "set --postgres-url, IDEMCP_POSTGRES_URL or DATABASE_URL"
		if pg := p.Spec.Store.Postgres; pg != nil {
			hint = fmt.Sprintf("in a pod it comes from the Secret %s, key %s (store.postgres.urlSecretRef); elsewhere %s", pg.URLSecretRef.Name, pg.URLSecretRef.Key, hint)
		}
		return nil, Info{}, errors.New("--postgres-url: the Postgres store needs a connection string; " + hint)
	}
	po := pgstore.Options{
		URL:       o.PostgresURL,
		ListenURL: o.PostgresListenURL,
		Password:  os.Getenv("IDEMCP_POSTGRES_PASSWORD"),
		Prefix:    o.PostgresKeyPrefix,
	}
	if o.PostgresPasswordFile != "" {
		pw, err := passwordFile("--postgres-password-file", o.PostgresPasswordFile)
		if err != nil {
			return nil, Info{}, err
		}
		po.Password = pw
	}
	if po.Prefix == "" {
		po.Prefix = defaultPrefix(o, p)
	}
	st, err := pgstore.New(po)
	if err != nil {
		return nil, Info{}, fmt.Errorf("--postgres-url: %w", err)
	}
	info := postgresInfo(po.URL)
	info.KeyPrefix = st.KeyPrefix() // what seals bind to
	return st, info, nil
}
