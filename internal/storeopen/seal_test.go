package storeopen

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

func sealKey() string {
	k := make([]byte, store.SealKeyBytes)
	_, _ = rand.Read(k)
	return base64.StdEncoding.EncodeToString(k)
}

// sealedBackend opens the same shared store as a sidecar does, sealed with
// the keyring given, and unsealed (as whoever can write to it sees it).
type sealedBackend struct {
	name string
	opts func(t *testing.T) Options
}

func sealedBackends(t *testing.T) []sealedBackend {
	return []sealedBackend{
		{"redis", func(t *testing.T) Options {
			srv := redistest.Start(t)
			return Options{Kind: "redis", RedisAddrs: srv.Addr, RedisKeyPrefix: "idemcp:{seal/" + rand.Text()[:8] + "}:"}
		}},
		{"postgres", func(t *testing.T) Options {
			srv := pgtest.Start(t)
			return Options{Kind: "postgres", PostgresURL: srv.URL, PostgresKeyPrefix: "idemcp:seal/" + rand.Text()[:8] + ":"}
		}},
	}
}

type sealedSidecar struct {
	engine   *engine.Engine
	failures *prometheus.CounterVec
}

func openSealed(t *testing.T, o Options, keys string) sealedSidecar {
	t.Helper()
	t.Setenv(SealKeysEnv, keys)
	o.SealOpenFailures = NewSealMetrics(nil)
	st, _, err := Open(o, policy.Default(), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return sealedSidecar{engine: engine.New(engine.Options{Store: st}), failures: o.SealOpenFailures}
}

func openRaw(t *testing.T, o Options) store.Store {
	t.Helper()
	st, _, err := openStore(o, policy.Default(), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return st
}

// upstream counts the calls that reach the MCP server.
type upstream struct{ runs atomic.Int32 }

func (u *upstream) forward(result string) engine.Forward {
	return func(context.Context) (engine.Upstream, error) {
		u.runs.Add(1)
		time.Sleep(20 * time.Millisecond)
		return engine.Upstream{Status: 200, Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"` + result + `"}]}}`)}, nil
	}
}

func plan(t *testing.T, e *engine.Engine, amount string) *engine.Plan {
	t.Helper()
	tc, err := engine.ParseToolCall(json.RawMessage(`{"name":"charge","arguments":{"amount":` + amount + `}}`))
	if err != nil {
		t.Fatal(err)
	}
	p, err := e.Plan(tc, engine.Caller{Principal: "Bearer agent"})
	if err != nil || p == nil {
		t.Fatalf("Plan = %v, %v", p, err)
	}
	return p
}

func execute(t *testing.T, e *engine.Engine, p *engine.Plan, fwd engine.Forward) engine.Outcome {
	t.Helper()
	out, err := e.Execute(context.Background(), p, fwd)
	if err != nil {
		t.Fatalf("Execute: %v", err)
	}
	// The client is answered before the result is stored: wait for that.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestSealedSharedStores(t *testing.T) {
	for _, b := range sealedBackends(t) {
		t.Run(b.name, func(t *testing.T) {
			o := b.opts(t)
			keys := sealKey()

			t.Run("PlantedResultRunsOnceThenReplays", func(t *testing.T) {
				s := openSealed(t, o, keys)
				raw := openRaw(t, o)
				p := plan(t, s.engine, "10")
				// Planted with another seal key, and with this key's own
				// fingerprint, so only the seal can tell.
				forger := store.Seal(raw, store.SealOptions{Keyring: mustRing(t, sealKey()), Context: contextOf(o)})
				plantWithFingerprint(t, forger, p, `{"jsonrpc":"2.0","result":{"content":[{"type":"text","text":"planted"}]}}`)

				var up upstream
				var wg sync.WaitGroup
				outs := make(chan engine.Outcome, 8)
				for range 8 {
					wg.Go(func() {
						out, err := s.engine.Execute(context.Background(), p, up.forward("charged 10"))
						if err != nil {
							t.Errorf("Execute: %v", err)
						}
						outs <- out
					})
				}
				wg.Wait()
				close(outs)
				if n := up.runs.Load(); n != 1 {
					t.Fatalf("the call ran %d times over a planted result; want once", n)
				}
				for out := range outs {
					if out.Kind == engine.Replayed && strings.Contains(string(out.Response), "planted") {
						t.Fatalf("the planted result was replayed: %s", out.Response)
					}
				}
				out := execute(t, s.engine, p, up.forward("again"))
				if out.Kind != engine.Replayed || !strings.Contains(string(out.Response), "charged 10") || up.runs.Load() != 1 {
					t.Fatalf("the retry after = %v %s (runs %d); want the real result replayed", out.Kind, out.Response, up.runs.Load())
				}
				if n := count(s.failures.WithLabelValues(store.OpenUnknownKey)); n < 1 {
					t.Errorf("idemcp_sealed_open_failures_total{reason=unknown_key} = %v, want at least 1", n)
				}
			})

			t.Run("CopiedResultIsNotReplayed", func(t *testing.T) {
				s := openSealed(t, o, keys)
				raw := openRaw(t, o)
				var up upstream
				a, b := plan(t, s.engine, "20"), plan(t, s.engine, "30")
				if out := execute(t, s.engine, a, up.forward("charged 20")); out.Kind != engine.Executed {
					t.Fatalf("first call = %v", out.Kind)
				}
				r, err := raw.Reserve(context.Background(), store.Claim{Key: a.Key, Fingerprint: a.Fingerprint, Owner: "reader", Lease: time.Minute})
				if err != nil || r.State != store.Completed {
					t.Fatalf("reading the stored record = %v, %v", r.State, err)
				}
				if strings.Contains(string(r.Response), "charged 20") {
					t.Fatalf("the store holds the result in clear: %q", r.Response)
				}
				plantWithRaw(t, raw, b, r.Response)
				out := execute(t, s.engine, b, up.forward("charged 30"))
				if out.Kind != engine.Executed || up.runs.Load() != 2 {
					t.Fatalf("a call whose key holds another key's sealed record = %v %s; want it executed", out.Kind, out.Response)
				}
				if n := count(s.failures.WithLabelValues(store.OpenForged)); n != 1 {
					t.Errorf("idemcp_sealed_open_failures_total{reason=forged} = %v, want 1", n)
				}
				if out := execute(t, s.engine, a, up.forward("again")); out.Kind != engine.Replayed || !strings.Contains(string(out.Response), "charged 20") {
					t.Fatalf("the original = %v %s; want its own result replayed", out.Kind, out.Response)
				}
			})

			t.Run("RotationLosesNothing", func(t *testing.T) {
				old, next := sealKey(), sealKey()
				before := openSealed(t, o, old)
				var up upstream
				p := plan(t, before.engine, "40")
				execute(t, before.engine, p, up.forward("charged 40"))

				// The Secret after a rotation: the new key first, the old one kept.
				after := openSealed(t, o, next+"\n"+old)
				out := execute(t, after.engine, p, up.forward("again"))
				if out.Kind != engine.Replayed || !strings.Contains(string(out.Response), "charged 40") || up.runs.Load() != 1 {
					t.Fatalf("after rotation a result sealed before = %v %s (runs %d); want it replayed", out.Kind, out.Response, up.runs.Load())
				}
				q := plan(t, after.engine, "41")
				execute(t, after.engine, q, up.forward("charged 41"))
				// Written with the new key: the previous key alone does not open it.
				r, err := openRaw(t, o).Reserve(context.Background(), store.Claim{Key: q.Key, Fingerprint: q.Fingerprint, Owner: "reader", Lease: time.Minute})
				if err != nil || r.State != store.Completed {
					t.Fatal(r.State, err)
				}
				if _, reason, ok := mustRing(t, old).Open(contextOf(o), q.Key, r.Response, time.Now()); ok || reason != store.OpenUnknownKey {
					t.Fatalf("a result written after rotation opens with the old key (%v %s); want the new key used", ok, reason)
				}
				for _, reason := range []string{store.OpenMalformed, store.OpenUnknownKey, store.OpenForged} {
					if n := count(after.failures.WithLabelValues(reason)); n != 0 {
						t.Errorf("open failures{%s} = %v after rotation, want 0", reason, n)
					}
				}
			})
		})
	}
}

func mustRing(t *testing.T, text string) *store.Keyring {
	t.Helper()
	k, err := store.ParseKeyring(text)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func contextOf(o Options) string {
	if o.RedisKeyPrefix != "" {
		return o.RedisKeyPrefix
	}
	return o.PostgresKeyPrefix
}

func plantWithFingerprint(t *testing.T, s store.Store, p *engine.Plan, response string) {
	t.Helper()
	ctx := context.Background()
	c := store.Claim{Key: p.Key, Fingerprint: p.Fingerprint, Owner: "attacker", Lease: time.Minute, Retention: time.Hour}
	if r, err := s.Reserve(ctx, c); err != nil || r.State != store.Won {
		t.Fatalf("planting: Reserve = %v, %v", r.State, err)
	}
	if err := s.Complete(ctx, p.Key, c.Owner, []byte(response), time.Hour); err != nil {
		t.Fatal(err)
	}
}

func plantWithRaw(t *testing.T, raw store.Store, p *engine.Plan, record []byte) {
	t.Helper()
	ctx := context.Background()
	c := store.Claim{Key: p.Key, Fingerprint: p.Fingerprint, Owner: "attacker", Lease: time.Minute, Retention: time.Hour}
	if r, err := raw.Reserve(ctx, c); err != nil || r.State != store.Won {
		t.Fatalf("copying: Reserve = %v, %v", r.State, err)
	}
	if err := raw.Complete(ctx, p.Key, c.Owner, record, time.Hour); err != nil {
		t.Fatal(err)
	}
}

func TestSealKeysFromFileAndEnv(t *testing.T) {
	t.Setenv(SealKeysEnv, "too-short")
	_, _, err := Open(Options{Kind: "memory"}, policy.Default(), slog.New(slog.DiscardHandler))
	if err == nil || !strings.Contains(err.Error(), SealKeysEnv) {
		t.Fatalf("a bad %s = %v; want an error naming it", SealKeysEnv, err)
	}
	_, _, err = Open(Options{Kind: "memory", SealKeysFile: t.TempDir() + "/none"}, policy.Default(), slog.New(slog.DiscardHandler))
	if err == nil || !strings.Contains(err.Error(), "--seal-keys-file") {
		t.Fatalf("a missing --seal-keys-file = %v; want an error naming it", err)
	}
	t.Setenv(SealKeysEnv, sealKey())
	st, _, err := Open(Options{Kind: "memory"}, policy.Default(), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	if _, ok := st.(*store.Sealed); !ok {
		t.Fatalf("with %s set the store is a %T, want sealed", SealKeysEnv, st)
	}
}

func count(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}
