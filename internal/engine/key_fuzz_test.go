package engine

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// FuzzExplicitKey: a key is accepted exactly when it is 1-255 printable
// ASCII characters, whichever way it arrives (header or any _meta
// spelling); a refusal is invalid params that names where the key came
// from; an accepted key is never shared between two principals.
func FuzzExplicitKey(f *testing.F) {
	for _, k := range []string{"k", "order-42", "", " ", "\x7f", "é", "a\x00b", strings.Repeat("x", 255), strings.Repeat("x", 256), "\"quoted\"", "\\u0000"} {
		f.Add(k, true)
		f.Add(k, false)
	}
	f.Fuzz(func(t *testing.T, k string, header bool) {
		valid := len(k) >= 1 && len(k) <= MaxKeyLength
		for i := 0; i < len(k); i++ {
			valid = valid && k[i] >= 0x20 && k[i] <= 0x7e
		}
		var c Caller
		meta := map[string]json.RawMessage{}
		where := "Idempotency-Key"
		if header {
			c = Caller{HeaderKey: k, HasHeaderKey: true, Principal: "Bearer alice"}
		} else {
			raw, err := json.Marshal(k)
			if err != nil {
				t.Fatal(err)
			}
			where = MetaKeys[len(k)%len(MetaKeys)]
			meta[where] = raw
			c = Caller{Principal: "Bearer alice"}
		}
		got, err := ExplicitKey(c, meta)
		if (err == nil) != valid {
			t.Fatalf("key %q: accepted = %v, want %v (err %v)", k, err == nil, valid, err)
		}
		if err != nil {
			var e *Error
			if !errors.As(err, &e) || e.Code != -32602 || !strings.Contains(e.Message, where) {
				t.Fatalf("key %q refused with %v; want invalid params naming %s", k, err, where)
			}
			return
		}
		if got != k {
			t.Fatalf("key %q came back as %q", k, got)
		}
		rule := mustPolicy(t, "spec: {defaultMode: Deduplicate}").RuleFor("t")
		bob := c
		bob.Principal = "Bearer bob"
		if deriveKey("", rule, c, got, "f") == deriveKey("", rule, bob, got, "f") {
			t.Fatalf("key %q: two principals share a derived key", k)
		}
	})
}
