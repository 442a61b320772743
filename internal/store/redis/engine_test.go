package redisstore_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/policy"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// TestRetryOfAResultNoReplicaHas, through the engine: the call ran, but
// the replica stopped before its result was stored, so only the primary
// has it. Its retry is neither replayed (a failover could still lose what
// it was handed) nor run again, even under FailOpen: it waits, and gets
// "still running, retry later" (-32011) after waitTimeout. Once the
// replica has the result, the retry gets it. Before, the retry got the
// result at once, from the primary alone.
func TestRetryOfAResultNoReplicaHas(t *testing.T) {
	primary := redistest.Start(t)
	replica := redistest.StartReplica(t, primary)
	s := newStore(t, redisstore.Options{Addrs: []string{primary.Addr}, MinReplicas: 1, ReplicaTimeout: 2 * time.Second})
	pol, err := policy.Parse([]byte("spec: {defaultMode: Deduplicate, onStoreUnavailable: FailOpen, waitTimeout: 1s}"))
	if err != nil {
		t.Fatal(err)
	}
	e := engine.New(engine.Options{Policy: pol, Store: s})
	t.Cleanup(func() {
		replica.Resume()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = e.Drain(ctx)
	})
	tc, err := engine.ParseToolCall(json.RawMessage(`{"name":"charge","arguments":{"card":"1"}}`))
	if err != nil {
		t.Fatal(err)
	}
	p, err := e.Plan(tc, engine.Caller{Principal: "Bearer alice"})
	if err != nil || p == nil {
		t.Fatalf("Plan: %v, %v", p, err)
	}
	ran := 0
	fwd := func(context.Context) (engine.Upstream, error) {
		ran++
		if ran == 1 {
			replica.Pause()
		}
		return engine.Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"charged":1}}`), Status: 200}, nil
	}
	ctx := context.Background()
	if out, err := e.Execute(ctx, p, fwd); err != nil || out.Kind != engine.Executed {
		t.Fatalf("first call: %v, %v", out.Kind, err)
	}

	out, err := e.Execute(ctx, p, fwd)
	var rpcErr *engine.Error
	if !errors.As(err, &rpcErr) || rpcErr.Code != mcpmsg.CodeInFlight || ran != 1 {
		t.Fatalf("retry of a result only the primary has: kind %v, err %v, ran %d; want -32011 and 1 run", out.Kind, err, ran)
	}

	replica.Resume()
	out, err = e.Execute(ctx, p, fwd)
	if err != nil || out.Kind != engine.Replayed || ran != 1 {
		t.Fatalf("retry once the replica is back: kind %v, err %v, ran %d; want a replay and 1 run", out.Kind, err, ran)
	}
}
