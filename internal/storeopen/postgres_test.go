package storeopen

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/idemcp/idemcp/internal/policy"
)

func TestRedisURL(t *testing.T) {
	t.Setenv("IDEMCP_REDIS_PASSWORD", "")
	ro, err := redisOptions(Options{RedisURL: "rediss://app:s3cret@redis.shop.svc:6380/2"}, policy.Default())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(ro.Addrs, ",") != "redis.shop.svc:6380" || ro.Username != "app" || ro.Password != "s3cret" || ro.DB != 2 || !ro.TLS {
		t.Fatalf("options from the URL = %+v", ro)
	}
	ro, err = redisOptions(Options{RedisURL: "redis://redis.shop.svc", RedisAddrs: "other:6379"}, policy.Default())
	if err != nil || strings.Join(ro.Addrs, ",") != "other:6379" || ro.TLS {
		t.Fatalf("--redis-addr beside --redis-url = %+v, %v; want the address flag to win", ro, err)
	}
	_, err = redisOptions(Options{RedisURL: "http://u:s3cret@redis:6379"}, policy.Default())
	if err == nil || !strings.Contains(err.Error(), "--redis-url") || strings.Contains(err.Error(), "s3cret") {
		t.Fatalf("a bad URL gave %v; want an error naming --redis-url without the password", err)
	}
}

func TestPostgresStoreNeedsURL(t *testing.T) {
	_, _, err := Open(Options{Kind: "postgres"}, policy.Default(), slog.Default())
	if err == nil || !strings.Contains(err.Error(), "--postgres-url") || !strings.Contains(err.Error(), "DATABASE_URL") {
		t.Fatalf("Open without a URL = %v; want an error naming --postgres-url and DATABASE_URL", err)
	}
	_, _, err = Open(Options{Kind: "mongo"}, policy.Default(), slog.Default())
	if err == nil || !strings.Contains(err.Error(), "memory, redis, postgres") {
		t.Fatalf("Open of an unknown kind = %v", err)
	}
}
