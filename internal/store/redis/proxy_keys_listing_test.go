package redisstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// The keys API opens a policy's Redis under the policy's prefix; an
// IdempotentProxy under that policy writes under prefix+"idpx/NAME:".
// kubectl idemcp keys list of the policy shows the policy's own keys and
// not the proxy's, which show/release/forget could never name.
func TestPolicyKeysListingLeavesOutIdempotentProxyRecords(t *testing.T) {
	srv := redistest.Start(t)
	base := policy.RedisKeyPrefix("shop", "payments")
	claim := func(key string) store.Claim {
		return store.Claim{Key: key, Fingerprint: "f", Owner: "o", Lease: time.Minute, Retention: time.Minute, Tool: "charge"}
	}
	px, err := redisstore.New(redisstore.Options{Addrs: []string{srv.Addr}, Prefix: base + "idpx/stripe-mcp:"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := px.Reserve(ctx, claim("3f9a1c2b7d0e3f9a")); err != nil {
		t.Fatal(err)
	}
	pol, err := redisstore.New(redisstore.Options{Addrs: []string{srv.Addr}, Prefix: base})
	if err != nil {
		t.Fatal(err)
	}
	const own = "0123456789abcdef0123456789abcdef"
	if _, err := pol.Reserve(ctx, claim(own)); err != nil {
		t.Fatal(err)
	}
	recs, err := pol.Records(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	sawOwn := false
	for _, r := range recs {
		if r.Key == own {
			sawOwn = true
			continue
		}
		t.Errorf("the policy's listing holds a record under key %q (the proxy's)", r.Key)
	}
	if !sawOwn {
		t.Errorf("the policy's listing lacks its own key %s: %+v", own, recs)
	}
	// The proxy's own listing still shows its record.
	precs, err := px.Records(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(precs) != 1 || precs[0].Key != "3f9a1c2b7d0e3f9a" {
		t.Errorf("the proxy's listing = %+v, want its one record", precs)
	}
}
