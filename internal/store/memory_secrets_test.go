package store_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/store"
)

// Calls through the engine leave in the memory store only hashes and the
// responses: no argument value, explicit key or principal a caller sent.
func TestMemoryStoreHoldsNoCallerSecrets(t *testing.T) {
	const arg, key, auth = "ARGMARK-1c9e", "KEYMARK-77d2", "AUTHMARK-e05b"
	mem := store.NewMemory(0)
	t.Cleanup(func() { _ = mem.Close() })
	pol, err := policy.Parse([]byte("spec: {defaultMode: Deduplicate}"))
	if err != nil {
		t.Fatal(err)
	}
	e := engine.New(engine.Options{Policy: pol, Store: mem})
	for _, tt := range []struct {
		params string
		caller engine.Caller
	}{
		{`{"name":"charge","arguments":{"memo":"` + arg + `"}}`, engine.Caller{Principal: "Bearer " + auth, Session: "s1"}},
		{`{"name":"charge","arguments":{"memo":"` + arg + `"}}`, engine.Caller{Principal: "Bearer " + auth, HeaderKey: key, HasHeaderKey: true}},
		{`{"name":"charge","arguments":{"memo":"` + arg + `"},"_meta":{"idempotency-key":"` + key + `-meta"}}`, engine.Caller{Session: "anonymous-session"}},
	} {
		tc, err := engine.ParseToolCall(json.RawMessage(tt.params))
		if err != nil {
			t.Fatal(err)
		}
		p, err := e.Plan(tc, tt.caller)
		if err != nil || p == nil {
			t.Fatalf("Plan(%s): %v, %v", tt.params, p, err)
		}
		_, err = e.Execute(context.Background(), p, func(context.Context) (engine.Upstream, error) {
			return engine.Upstream{Status: 200, Response: []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"stored-result"}]}}`)}, nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Drain(context.Background()); err != nil { // every result stored
		t.Fatal(err)
	}
	dump := mem.Dump()
	if mem.Len() != 3 || strings.Count(dump, "stored-result") != 3 {
		t.Fatalf("the store holds %d records; the dump shows %d results, want 3: the scan is broken", mem.Len(), strings.Count(dump, "stored-result"))
	}
	for _, m := range []string{arg, key, auth} {
		if strings.Contains(dump, m) {
			t.Errorf("the memory store holds %q:\n%s", m, dump)
		}
	}
}
