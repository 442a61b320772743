package mcpmiddleware_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"log/slog"
	"testing"

	"github.com/idemcp/idemcp/idempotency"
	"github.com/idemcp/idemcp/idempotency/mcpmiddleware"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// The seal keys a shared store is opened with reach the middleware's
// calls: a result planted in Redis by someone without the key is not
// replayed, and the tool runs.
func TestMiddlewareSealedStore(t *testing.T) {
	srv := redistest.Start(t)
	open := func(opts ...idempotency.StoreOption) idempotency.Store {
		st, err := idempotency.NewRedisStore(idempotency.RedisOptions{Addrs: []string{srv.Addr}, Prefix: "mw:"},
			append(opts, idempotency.StoreLogger(slog.New(slog.DiscardHandler)))...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.Close() })
		return st
	}
	key := make([]byte, idempotency.SealKeyBytes)
	_, _ = rand.Read(key)
	call := func(st idempotency.Store, text string) string {
		return callThrough(t, mcpmiddleware.Options{Store: st}, nil, func(context.Context) string { return text })
	}
	if got := call(open(), "planted"); got != "planted" {
		t.Fatalf("planting: %q", got)
	}
	if got := call(open(), "charged"); got != "planted" {
		t.Fatalf("through another unsealed store the call got %q; the threat is the planted result replayed", got)
	}
	sealed := open(idempotency.SealKeyring(base64.StdEncoding.EncodeToString(key)))
	if got := call(sealed, "charged"); got != "charged" {
		t.Fatalf("through a sealed store the call got %q; want the tool to run, not the planted result", got)
	}
	if got := call(sealed, "charged again"); got != "charged" {
		t.Fatalf("the retry got %q; want the sealed result replayed", got)
	}
}
