package poll

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

func TestUntilReturnsOnceTheConditionHolds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		calls := 0
		err := Until(context.Background(), time.Minute, func() error {
			calls++
			if time.Since(start) < time.Second {
				return errors.New("not yet")
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if waited := time.Since(start); waited > time.Second+maxInterval {
			t.Errorf("waited %v for a condition that held after 1s", waited)
		}
		if calls > 20 {
			t.Errorf("%d calls in a second: the interval does not grow", calls)
		}
	})
}

func TestUntilReturnsTheLastErrorAtTheDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		want := errors.New("still down")
		if err := Until(context.Background(), 3*time.Second, func() error { return want }); !errors.Is(err, want) {
			t.Fatalf("Until: %v, want %v", err, want)
		}
		if waited := time.Since(start); waited != 3*time.Second {
			t.Errorf("gave up after %v, want 3s", waited)
		}
	})
}

func TestUntilEndsWithItsContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if err := Until(ctx, time.Hour, True(func() bool { return false })); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Until: %v, want the context's error", err)
		}
	})
}
