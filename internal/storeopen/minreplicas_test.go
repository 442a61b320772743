package storeopen

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/test/poll"
)

// The policy's store.redis.external.minReplicas reaches the store the
// sidecar opens, as --redis-min-replicas does: against a Redis with no
// replica a deduplicated call is refused -32013 naming the replicas and
// nothing runs; once the Redis has a replica the same call runs and its
// retry is replayed. The flag may raise the policy's value, not lower it.
func TestPolicyMinReplicas(t *testing.T) {
	t.Setenv("IDEMCP_REDIS_PASSWORD", "")
	primary := redistest.Start(t)
	pol, err := policy.Parse([]byte(`spec:
  defaultMode: Deduplicate
  keyScope: Global
  store:
    type: Redis
    redis:
      external:
        addresses: ["` + primary.Addr + `"]
        minReplicas: 1
        minReplicasTimeout: 200ms
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		flag, want int
		timeout    time.Duration
	}{{0, 1, 200 * time.Millisecond}, {2, 2, time.Second}} {
		ro, err := redisOptions(Options{RedisMinReplicas: tc.flag, RedisReplicaTimeout: time.Second}, pol)
		if err != nil || ro.MinReplicas != tc.want || ro.ReplicaTimeout != tc.timeout {
			t.Errorf("--redis-min-replicas %d under minReplicas 1: %d replicas, timeout %v (%v); want %d, %v", tc.flag, ro.MinReplicas, ro.ReplicaTimeout, err, tc.want, tc.timeout)
		}
	}

	st, _, err := Open(Options{Kind: "redis", RedisReplicaTimeout: time.Second}, pol, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	e := engine.New(engine.Options{Policy: pol, Store: st})
	runs := 0
	call := func() (engine.Outcome, error) {
		tc, err := engine.ParseToolCall(json.RawMessage(`{"name":"charge","arguments":{"cents":100}}`))
		if err != nil {
			t.Fatal(err)
		}
		p, err := e.Plan(tc, engine.Caller{})
		if err != nil || p == nil {
			t.Fatalf("Plan: %v %v", p, err)
		}
		return e.Execute(context.Background(), p, func(context.Context) (engine.Upstream, error) {
			runs++
			return engine.Upstream{Status: 200, Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[]}}`)}, nil
		})
	}
	_, err = call()
	var ee *engine.Error
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeStoreUnavailable || !strings.Contains(ee.Message, "0 of the 1 replicas") || runs != 0 {
		t.Fatalf("a call with no replica: %v (ran %d); want -32013 naming the replicas, and nothing run", err, runs)
	}
	redistest.StartReplica(t, primary)
	poll.Within(t, 20*time.Second, "a call with a replica in sync to run", func() error {
		out, err := call()
		if err == nil && out.Kind == engine.Executed {
			return nil
		}
		return fmt.Errorf("%v: %w", out.Kind, err)
	})
	if out, err := call(); err != nil || out.Kind != engine.Replayed || runs != 1 {
		t.Fatalf("the retry: %v, %v (ran %d); want a replay of the one run", out.Kind, err, runs)
	}
}

// TestMinReplicasAppliedLive: a policy applied live that raises
// store.redis.external.minReplicas reaches the Redis store the sidecar
// opened (through its sealing and timing wrappers), with no restart: a
// call against a Redis with no replica is then refused -32013 naming the
// replicas, and nothing runs; lowered again, the call runs. The flag still
// may raise it, not lower it.
func TestMinReplicasAppliedLive(t *testing.T) {
	t.Setenv("IDEMCP_REDIS_PASSWORD", "")
	primary := redistest.Start(t)
	spec := func(n int) *policy.Policy {
		t.Helper()
		p, err := policy.Parse([]byte(`spec:
  defaultMode: Deduplicate
  keyScope: Global
  store:
    type: Redis
    redis:
      external:
        addresses: ["` + primary.Addr + `"]
        minReplicas: ` + strconv.Itoa(n) + `
`))
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	o := Options{Kind: "redis", RedisReplicaTimeout: 200 * time.Millisecond}
	st, _, err := Open(o, spec(0), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	e := engine.New(engine.Options{Policy: spec(0), Store: st})
	runs, n := 0, 0
	call := func() error {
		n++
		tc, err := engine.ParseToolCall(json.RawMessage(`{"name":"charge","arguments":{"cents":` + strconv.Itoa(n) + `}}`))
		if err != nil {
			t.Fatal(err)
		}
		p, err := e.Plan(tc, engine.Caller{})
		if err != nil || p == nil {
			t.Fatalf("Plan: %v %v", p, err)
		}
		_, err = e.Execute(context.Background(), p, func(context.Context) (engine.Upstream, error) {
			runs++
			return engine.Upstream{Status: 200, Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[]}}`)}, nil
		})
		return err
	}
	if err := call(); err != nil || runs != 1 {
		t.Fatalf("a call under minReplicas 0: %v (ran %d)", err, runs)
	}
	if changed, got, err := ApplyReplicas(st, o, spec(1)); err != nil || !changed || got != 1 {
		t.Fatalf("ApplyReplicas(minReplicas 1) = %v, %d, %v; want changed to 1", changed, got, err)
	}
	if changed, _, _ := ApplyReplicas(st, o, spec(1)); changed {
		t.Error("ApplyReplicas of the same minReplicas again reports a change")
	}
	err = call()
	var ee *engine.Error
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeStoreUnavailable || !strings.Contains(ee.Message, "0 of the 1 replicas") || runs != 1 {
		t.Fatalf("a call after minReplicas was raised to 1, with no replica: %v (ran %d); want -32013 naming the replicas, and nothing run", err, runs)
	}
	if changed, got, err := ApplyReplicas(st, Options{Kind: "redis", RedisMinReplicas: 1, RedisReplicaTimeout: 200 * time.Millisecond}, spec(0)); err != nil || changed || got != 1 {
		t.Errorf("--redis-min-replicas 1 under a policy lowered to 0: %v, %d, %v; want the flag's 1 kept", changed, got, err)
	}
	if _, _, err := ApplyReplicas(st, o, spec(0)); err != nil {
		t.Fatal(err)
	}
	if err := call(); err != nil || runs != 2 {
		t.Fatalf("a call after minReplicas was lowered to 0: %v (ran %d)", err, runs)
	}
}
