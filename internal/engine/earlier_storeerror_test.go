package engine

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/internal/store"
)

// flaky fails the next Reserve once (a store blip on the earlier key's
// round trip, or the shard holding it).
type flakyReserve struct {
	*store.Memory
	fail atomic.Bool
}

func (f *flakyReserve) Reserve(ctx context.Context, c store.Claim) (store.Reservation, error) {
	if f.fail.CompareAndSwap(true, false) {
		return store.Reservation{}, errors.New("connection reset")
	}
	return f.Memory.Reserve(ctx, c)
}

// A store error on the earlier key's lookup, then a working store for the
// key now: the retry of a stored call is answered (FailClosed), never run
// again.
func TestStoreErrorOnAnEarlierKeyNeverRunsTheCallAgain(t *testing.T) {
	st := &flakyReserve{Memory: store.NewMemory(0)}
	e := New(Options{Policy: mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Session, onStoreUnavailable: FailClosed}"), Store: st, KeySpace: "Deployment/api"})
	var ran atomic.Int32
	a := caller{t, e, Caller{Principal: "Bearer alice", Session: "s1"}, &ran}
	const call = `{"name":"charge","arguments":{"amount":5}}`
	if a.call(call) != Executed {
		t.Fatal("first call")
	}
	e.SetPolicy(mustPolicy(t, "spec: {defaultMode: Deduplicate, keyScope: Principal, onStoreUnavailable: FailClosed}"))
	st.fail.Store(true)
	tc, err := ParseToolCall(json.RawMessage(call))
	if err != nil {
		t.Fatal(err)
	}
	p, err := e.Plan(tc, a.c)
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.Execute(context.Background(), p, func(context.Context) (Upstream, error) {
		ran.Add(1)
		return Upstream{Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{}}`), Status: 200}, nil
	})
	var ee *Error
	if !errors.As(err, &ee) || ee.Code != mcpmsg.CodeStoreUnavailable || ran.Load() != 1 {
		t.Fatalf("retry after a keyScope change, with a store blip on the earlier key: %v, the tool ran %d times; want -32015 and 1 run", err, ran.Load())
	}
	// Once the store answers, the retry gets the stored result.
	if k := a.call(call); k != Replayed || ran.Load() != 1 {
		t.Fatalf("retry with the store back: %v, the tool ran %d times; want a replay of the one run", k, ran.Load())
	}
}
