package redisstore_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemcp/idemcp/internal/store"
	redisstore "github.com/idemcp/idemcp/internal/store/redis"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
)

// raiseAfterComplete raises MinReplicas right after the complete script
// ran: a policy push applying minReplicas 0 -> 1 while a call settles.
type raiseAfterComplete struct {
	s    *redisstore.Store
	once sync.Once
}

func (h *raiseAfterComplete) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *raiseAfterComplete) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *raiseAfterComplete) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		for _, a := range cmd.Args() {
			if s, _ := a.(string); s == "result-raced" {
				h.once.Do(func() { _ = h.s.SetMinReplicas(1, 100*time.Millisecond) })
			}
			if b, _ := a.([]byte); string(b) == "result-raced" {
				h.once.Do(func() { _ = h.s.SetMinReplicas(1, 100*time.Millisecond) })
			}
		}
		return err
	}
}

// TestCompleteRacingSetMinReplicasIsNotMarkedAcknowledged: a Complete
// that ran its script with MinReplicas 0 (no WAIT) must not mark the
// result acknowledged by replicas because MinReplicas was raised before
// its second read. There is no replica at all here: no result may be
// replayed once MinReplicas is 1 without being confirmed.
func TestCompleteRacingSetMinReplicasIsNotMarkedAcknowledged(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer func() { _ = c.Close() }()
	s := redisstore.NewFromClient(c, prefix(t))
	defer func() { _ = s.Close() }()
	h := &raiseAfterComplete{s: s}
	c.AddHook(h)
	ctx := context.Background()
	cl := claim("raced", time.Minute)
	if r, err := s.Reserve(ctx, cl); err != nil || r.State != store.Won {
		t.Fatalf("Reserve: %v, %v", r.State, err)
	}
	if err := s.Complete(ctx, "raced", cl.Owner, []byte("result-raced"), time.Minute); err != nil {
		t.Fatalf("Complete (MinReplicas 0 when it wrote): %v", err)
	}
	if s.MinReplicas() != 1 {
		t.Fatalf("the hook did not raise MinReplicas")
	}
	a, _ := c.HGet(ctx, prefix(t)+"raced", "a").Result()
	r, err := s.Reserve(ctx, claim("raced", time.Minute))
	if a != "" || (err == nil && r.State == store.Completed) {
		t.Errorf("with no replica at all, the result is marked acknowledged (a=%q) and a Reserve under MinReplicas 1 replays it (%v, %v): the Complete read MinReplicas twice (0 for its WAIT, 1 for its ack mark)", a, r.State, err)
	}
}
