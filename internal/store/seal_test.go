package store_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/store/storetest"
)

func newKey(t testing.TB) []byte {
	t.Helper()
	k := make([]byte, store.SealKeyBytes)
	_, _ = rand.Read(k)
	return k
}

func ring(t testing.TB, keys ...[]byte) *store.Keyring {
	t.Helper()
	r, err := store.NewKeyring(keys...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestSealedMemoryContract(t *testing.T) {
	storetest.RunCore(t, func(t *testing.T) store.Store {
		return store.Seal(store.NewMemory(0), store.SealOptions{Keyring: ring(t, newKey(t)), Context: "memory:"})
	})
}

// failures records what OnOpenFailure was told.
type failures struct {
	mu      sync.Mutex
	reasons []string
}

func (f *failures) add(_, reason string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reasons = append(f.reasons, reason)
}

func (f *failures) get() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.reasons...)
}

func complete(t *testing.T, s store.Store, key string, resp []byte) {
	t.Helper()
	ctx := context.Background()
	c := store.Claim{Key: key, Fingerprint: "fp", Owner: rand.Text(), Lease: time.Minute, Retention: time.Hour}
	r, err := s.Reserve(ctx, c)
	if err != nil || r.State != store.Won {
		t.Fatalf("Reserve(%s) = %v, %v; want won", key, r.State, err)
	}
	if err := s.Complete(ctx, key, c.Owner, resp, time.Hour); err != nil {
		t.Fatal(err)
	}
}

func reserveKey(t *testing.T, s store.Store, key string) store.Reservation {
	t.Helper()
	r, err := s.Reserve(context.Background(), store.Claim{Key: key, Fingerprint: "fp", Owner: rand.Text(), Lease: time.Minute, Retention: time.Hour, TakeOver: true})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestSealedStoreHidesAndBindsResults(t *testing.T) {
	mem := store.NewMemory(0)
	defer func() { _ = mem.Close() }()
	var f failures
	s := store.Seal(mem, store.SealOptions{Keyring: ring(t, newKey(t)), Context: "idemcp:shop/payments:", OnOpenFailure: f.add})
	secret := []byte(`{"jsonrpc":"2.0","result":{"content":[{"type":"text","text":"card 4242 charged"}]}}`)
	complete(t, s, "k1", secret)

	raw := reserveKey(t, mem, "k1")
	if raw.State != store.Completed || bytes.Contains(raw.Response, []byte("4242")) || len(raw.Response) != len(secret)+store.SealOverhead {
		t.Fatalf("the store holds %q (%d bytes); want %d sealed bytes that do not show the result", raw.Response, len(raw.Response), len(secret)+store.SealOverhead)
	}
	if r := reserveKey(t, s, "k1"); r.State != store.Completed || !bytes.Equal(r.Response, secret) {
		t.Fatalf("sealed replay = %s %q, want the result", r.State, r.Response)
	}

	// The same bytes copied under another key do not open there.
	complete(t, mem, "k2", raw.Response)
	if r := reserveKey(t, s, "k2"); r.State != store.Won {
		t.Fatalf("a record copied under another key gave %s; want won (absent, run as new)", r.State)
	}
	if got := f.get(); len(got) != 1 || got[0] != store.OpenForged {
		t.Fatalf("failures = %v, want one forged", got)
	}
}

func TestSealContextBinds(t *testing.T) {
	k := ring(t, newKey(t))
	rec := k.Seal("idemcp:shop/payments:", "key", time.Now().Add(time.Hour), []byte("result"))
	if _, _, ok := k.Open("idemcp:shop/payments:", "key", rec, time.Now()); !ok {
		t.Fatal("a record does not open where it was sealed")
	}
	for _, tc := range []struct{ ctx, key string }{{"idemcp:shop/other:", "key"}, {"idemcp:shop/payments:", "kez"}, {"idemcp:shop/payments:k", "ey"}} {
		if _, reason, ok := k.Open(tc.ctx, tc.key, rec, time.Now()); ok || reason != store.OpenForged {
			t.Errorf("Open(%q, %q) = %v, %s; want forged", tc.ctx, tc.key, ok, reason)
		}
	}
	flipped := bytes.Clone(rec)
	flipped[len(flipped)-1] ^= 1
	if _, reason, ok := k.Open("idemcp:shop/payments:", "key", flipped, time.Now()); ok || reason != store.OpenForged {
		t.Errorf("an altered record opened (%v, %s)", ok, reason)
	}
	if _, reason, ok := k.Open("idemcp:shop/payments:", "key", []byte(`{"jsonrpc":"2.0","result":{}}`), time.Now()); ok || reason != store.OpenMalformed {
		t.Errorf("an unsealed record = %v, %s; want malformed", ok, reason)
	}
	if _, reason, ok := ring(t, newKey(t)).Open("idemcp:shop/payments:", "key", rec, time.Now()); ok || reason != store.OpenUnknownKey {
		t.Errorf("a record of another key = %v, %s; want unknown_key", ok, reason)
	}
	if a, b := k.Seal("c", "key", time.Now().Add(time.Hour), []byte("x")), k.Seal("c", "key", time.Now().Add(time.Hour), []byte("x")); bytes.Equal(a, b) {
		t.Error("two seals of the same result are equal: the nonce is not fresh")
	}
}

func TestSealedPlantedResultRunsOnce(t *testing.T) {
	mem := store.NewMemory(0)
	defer func() { _ = mem.Close() }()
	var f failures
	s := store.Seal(mem, store.SealOptions{Keyring: ring(t, newKey(t)), Context: "c", OnOpenFailure: f.add})
	attacker := store.Seal(mem, store.SealOptions{Keyring: ring(t, newKey(t)), Context: "c"})
	complete(t, attacker, "k", []byte("planted"))

	var wg sync.WaitGroup
	states := make(chan store.State, 10)
	for range 10 {
		wg.Go(func() { states <- reserveKey(t, s, "k").State })
	}
	wg.Wait()
	close(states)
	won := 0
	for st := range states {
		switch st {
		case store.Won:
			won++
		case store.Pending:
		default:
			t.Errorf("a caller got %s; want won once and pending for the rest", st)
		}
	}
	if won != 1 {
		t.Fatalf("%d of 10 callers won the key holding a planted result; want exactly 1", won)
	}
	if got := f.get(); len(got) == 0 || got[0] != store.OpenUnknownKey {
		t.Errorf("failures = %v, want unknown_key", got)
	}
}

func TestKeyringRotation(t *testing.T) {
	oldKey, nextKey := newKey(t), newKey(t)
	mem := store.NewMemory(0)
	defer func() { _ = mem.Close() }()
	before := store.Seal(mem, store.SealOptions{Keyring: ring(t, oldKey), Context: "c"})
	complete(t, before, "old", []byte("sealed before"))
	var f failures
	after := store.Seal(mem, store.SealOptions{Keyring: ring(t, nextKey, oldKey), Context: "c", OnOpenFailure: f.add})
	if r := reserveKey(t, after, "old"); r.State != store.Completed || string(r.Response) != "sealed before" {
		t.Fatalf("after rotation a result sealed under the previous key = %s %q; want it replayed", r.State, r.Response)
	}
	complete(t, after, "new", []byte("sealed after"))
	raw := reserveKey(t, mem, "new")
	if _, reason, ok := ring(t, oldKey).Open("c", "new", raw.Response, time.Now()); ok || reason != store.OpenUnknownKey {
		t.Fatalf("a result written after rotation opens with the previous key alone (%v, %s); want it sealed with the new key", ok, reason)
	}
	if len(f.get()) != 0 {
		t.Errorf("failures after rotation: %v", f.get())
	}
}

func TestParseKeyring(t *testing.T) {
	a, b := newKey(t), newKey(t)
	text := "# current first\n" + base64.StdEncoding.EncodeToString(a) + "\n" + base64.RawURLEncoding.EncodeToString(b) + "\n"
	k, err := store.ParseKeyring(text)
	if err != nil {
		t.Fatal(err)
	}
	if ids := k.IDs(); len(ids) != 2 || ids[0] != store.SealKeyID(a) || ids[1] != store.SealKeyID(b) || k.CurrentID() != ids[0] {
		t.Fatalf("IDs = %v, want [%s %s]", ids, store.SealKeyID(a), store.SealKeyID(b))
	}
	if _, err := store.ParseKeyring(base64.StdEncoding.EncodeToString(a) + "," + base64.StdEncoding.EncodeToString(b)); err != nil {
		t.Errorf("comma-separated keyring: %v", err)
	}
	for _, bad := range []struct{ text, want string }{
		{"", "no seal key"},
		{"not-base64!", "seal key 1 is not base64"},
		{base64.StdEncoding.EncodeToString(a) + " " + base64.StdEncoding.EncodeToString(a[:16]), "seal key 2 is 16 bytes long; a seal key is 32"},
	} {
		_, err := store.ParseKeyring(bad.text)
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("ParseKeyring(%q) = %v, want an error with %q", bad.text, err, bad.want)
		}
		if err != nil && strings.Contains(err.Error(), base64.StdEncoding.EncodeToString(a)) {
			t.Errorf("the error shows key material: %v", err)
		}
	}
}

const benchResponse = `{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"charged 129.99 EUR to card ending 4242 (charge ch_3k2j)"}],"structuredContent":{"chargeId":"ch_3k2j","status":"succeeded"}}}`

func BenchmarkSeal(b *testing.B) {
	k := ring(b, newKey(b))
	b.ReportAllocs()
	for b.Loop() {
		_ = k.Seal("idemcp:shop/payments:", "3f9a1c0d5e7b2a4f", time.Now().Add(time.Hour), []byte(benchResponse))
	}
}

func BenchmarkOpen(b *testing.B) {
	k := ring(b, newKey(b))
	rec := k.Seal("idemcp:shop/payments:", "3f9a1c0d5e7b2a4f", time.Now().Add(time.Hour), []byte(benchResponse))
	b.ReportAllocs()
	for b.Loop() {
		if _, _, ok := k.Open("idemcp:shop/payments:", "3f9a1c0d5e7b2a4f", rec, time.Now()); !ok {
			b.Fatal("does not open")
		}
	}
}

// TestSealBindsTheExpiry: a record opens until its sealed expiry, never
// after (a copy restored after its TTL does not replay), and altering the
// expiry breaks the seal.
func TestSealBindsTheExpiry(t *testing.T) {
	k := ring(t, newKey(t))
	expires := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	rec := k.Seal("c", "key", expires, []byte("result"))
	for _, tc := range []struct {
		now    time.Time
		ok     bool
		reason string
	}{
		{expires.Add(-time.Hour), true, ""},
		{expires, true, ""},
		{expires.Add(time.Millisecond), false, store.OpenExpired},
		{expires.Add(24 * time.Hour), false, store.OpenExpired},
	} {
		if _, reason, ok := k.Open("c", "key", rec, tc.now); ok != tc.ok || reason != tc.reason {
			t.Errorf("at expiry%+v: Open = %v, %q; want %v, %q", tc.now.Sub(expires), ok, reason, tc.ok, tc.reason)
		}
	}
	// Pushing the expiry out breaks the tag.
	later := bytes.Clone(rec)
	later[5]++ // the expiry's most significant byte
	if _, reason, ok := k.Open("c", "key", later, expires.Add(time.Hour)); ok || reason != store.OpenForged {
		t.Errorf("a record with its expiry pushed out = %v, %s; want forged", ok, reason)
	}
}
