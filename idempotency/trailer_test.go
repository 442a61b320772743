package idempotency_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/idemcp/idemcp/idempotency"
)

func bitsWS(b []byte) []byte {
	var out []byte
	for _, c := range b {
		for i := 7; i >= 0; i-- {
			if c>>i&1 == 1 {
				out = append(out, '\t')
			} else {
				out = append(out, ' ')
			}
		}
	}
	return out
}

// A Do value that happens to end like a trace trailer (a run of spaces
// and tabs) comes back whole on replay, not cut short.
func TestReplayReturnsValueEndingInTraceTrailerWhole(t *testing.T) {
	payload := []byte{1}
	payload = append(payload, bytes.Repeat([]byte{0x11}, 16)...) // trace id
	payload = append(payload, bytes.Repeat([]byte{0x22}, 8)...)  // span id
	payload = append(payload, 1)
	value := append([]byte("user data"), bitsWS(payload)...)
	value = append(value, bitsWS([]byte("id"))...)
	st := idempotency.NewMemoryStore()
	g1 := idempotency.NewGroup(st, idempotency.Options{})
	g2 := idempotency.NewGroup(st, idempotency.Options{})
	fn := func(context.Context) ([]byte, error) { return value, nil }
	v1, _, err := g1.Do(context.Background(), "k", "fp", fn)
	if err != nil {
		t.Fatal(err)
	}
	v2, replayed, err := g2.Do(context.Background(), "k", "fp", fn)
	if err != nil || !replayed {
		t.Fatal(err, replayed)
	}
	if !bytes.Equal(v1, v2) {
		t.Fatalf("first call got %d bytes, replay got %d bytes (%q)", len(v1), len(v2), v2)
	}
}
