package idempotency_test

import (
	"context"
	"fmt"
	"os"

	"github.com/idemcp/idemcp/idempotency"
)

// A payment is charged once, however often the caller retries.
func ExampleGroup_Do() {
	g := idempotency.NewGroup(idempotency.NewMemoryStore(), idempotency.Options{})
	charge := func(ctx context.Context) ([]byte, error) {
		fmt.Println("charging the card")
		return []byte(`{"charge":"ch_1"}`), nil
	}
	ctx := context.Background()
	for range 3 {
		v, replayed, err := g.Do(ctx, "order-77", "card=4242 amount=12.50", charge)
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(string(v), replayed)
	}
	// Output:
	// charging the card
	// {"charge":"ch_1"} false
	// {"charge":"ch_1"} true
	// {"charge":"ch_1"} true
}

// The same key with other arguments is refused, and fn does not run.
func ExampleGroup_Do_conflict() {
	g := idempotency.NewGroup(idempotency.NewMemoryStore(), idempotency.Options{})
	ctx := context.Background()
	run := func(ctx context.Context) ([]byte, error) { return []byte("ok"), nil }
	_, _, _ = g.Do(ctx, "order-77", "amount=12.50", run)
	_, _, err := g.Do(ctx, "order-77", "amount=99.00", run)
	fmt.Println(err)
	// Output:
	// key "order-77": idempotency key conflict: the key was already used with a different fingerprint
}

// DoJSON keeps any JSON-encodable value.
func ExampleDoJSON() {
	type Receipt struct {
		ID     string  `json:"id"`
		Amount float64 `json:"amount"`
	}
	g := idempotency.NewGroup(idempotency.NewMemoryStore(), idempotency.Options{})
	for range 2 {
		r, replayed, err := idempotency.DoJSON(context.Background(), g, "order-78", "amount=5", func(context.Context) (Receipt, error) {
			return Receipt{ID: "rc_9", Amount: 5}, nil
		})
		fmt.Println(r.ID, r.Amount, replayed, err)
	}
	// Output:
	// rc_9 5 false <nil>
	// rc_9 5 true <nil>
}

// Replicas share their results through PostgreSQL (or Redis): a retry that
// reaches another replica gets the first one's result.
func ExampleNewPostgresStore() {
	st, err := idempotency.NewPostgresStore(idempotency.PostgresOptions{
		URL:    os.Getenv("DATABASE_URL"),
		Prefix: "payments:",
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = st.Close() }()
	g := idempotency.NewGroup(st, idempotency.Options{AbandonedError: true})
	_ = g
}
