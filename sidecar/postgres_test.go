package sidecar

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/idemcp/idemcp/internal/policy"
)

func TestRedisURL(t *testing.T) {
	t.Setenv("IDEMCP_REDIS_PASSWORD", "")
	ro, err := redisOptions(StoreOptions{RedisURL: "rediss://app:s3cret@redis.shop.svc:6380/2"}, policy.Default())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(ro.Addrs, ",") != "redis.shop.svc:6380" || ro.Username != "app" || ro.Password != "s3cret" || ro.DB != 2 || !ro.TLS {
		t.Fatalf("options from the URL = %+v", ro)
	}
	ro, err = redisOptions(StoreOptions{RedisURL: "redis://redis.shop.svc", RedisAddrs: "other:6379"}, policy.Default())
	if err != nil || strings.Join(ro.Addrs, ",") != "other:6379" || ro.TLS {
		t.Fatalf("--redis-addr beside --redis-url = %+v, %v; want the address flag to win", ro, err)
	}
	_, err = redisOptions(StoreOptions{RedisURL: "http://u:s3cret@redis:6379"}, policy.Default())
	if err == nil || !strings.Contains(err.Error(), "--redis-url") || strings.Contains(err.Error(), "s3cret") {
		t.Fatalf("a bad URL gave %v; want an error naming --redis-url without the password", err)
	}
}

func TestStoreFlagsReadConventionalEnv(t *testing.T) {
	t.Setenv("REDIS_URL", "redis://r:6379")
	t.Setenv("DATABASE_URL", "postgres://db/app")
	var so Options
	if err := NewFlagSet(&so).Parse(nil); err != nil {
		t.Fatal(err)
	}
	o := so.Store
	if o.RedisURL != "redis://r:6379" || o.PostgresURL != "postgres://db/app" {
		t.Fatalf("REDIS_URL/DATABASE_URL not read: %+v", o)
	}
	t.Setenv("IDEMCP_POSTGRES_URL", "postgres://mine/app")
	so = Options{}
	if err := NewFlagSet(&so).Parse(nil); err != nil {
		t.Fatal(err)
	}
	if o = so.Store; o.PostgresURL != "postgres://mine/app" {
		t.Fatalf("IDEMCP_POSTGRES_URL does not win over DATABASE_URL: %q", o.PostgresURL)
	}
}

func TestPostgresStoreNeedsURL(t *testing.T) {
	_, _, err := OpenStore(StoreOptions{Kind: "postgres"}, policy.Default(), slog.Default())
	if err == nil || !strings.Contains(err.Error(), "--postgres-url") || !strings.Contains(err.Error(), "DATABASE_URL") {
		t.Fatalf("OpenStore without a URL = %v; want an error naming --postgres-url and DATABASE_URL", err)
	}
	_, _, err = OpenStore(StoreOptions{Kind: "mongo"}, policy.Default(), slog.Default())
	if err == nil || !strings.Contains(err.Error(), "memory, redis, postgres") {
		t.Fatalf("OpenStore of an unknown kind = %v", err)
	}
}
