package policy

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

func TestDefaults(t *testing.T) {
	p := Default()
	if p.TTL != 24*time.Hour || p.WaitTimeout != 30*time.Second || p.LeaseDuration != 30*time.Second {
		t.Errorf("durations = %v/%v/%v, want 24h/30s/30s", p.TTL, p.WaitTimeout, p.LeaseDuration)
	}
	if p.MaxResultBytes != 1<<20 {
		t.Errorf("MaxResultBytes = %d, want 1Mi", p.MaxResultBytes)
	}
	if p.Spec.Store.Type != v1alpha1.StoreMemory || p.OnStoreUnavailable != v1alpha1.FailClosed || p.InFlight != v1alpha1.InFlightWait {
		t.Errorf("store/unavailable/inFlight = %s/%s/%s", p.Spec.Store.Type, p.OnStoreUnavailable, p.InFlight)
	}
	r := p.RuleFor("anything")
	if r.Mode != v1alpha1.ModeAuto || r.KeyScope != v1alpha1.ScopeSession || r.OnAbandoned != v1alpha1.AbandonedRetry {
		t.Errorf("default rule = %+v", r)
	}
	if p.PrincipalHeader != "Authorization" {
		t.Errorf("PrincipalHeader = %q", p.PrincipalHeader)
	}
}

const sample = `apiVersion: idemcp.io/v1alpha1
kind: IdempotencyPolicy
metadata: {name: payments, namespace: shop}
spec:
  ttl: 24h
  keyScope: Session
  principalHeader: x-forwarded-user
  defaultMode: Auto
  tools:
  - name: "charge_*"
    mode: Deduplicate
    ttl: 72h
    keyScope: Principal
    onAbandoned: Error
    cacheToolErrors: true
    ignoreArguments: ["/requestedAt"]
  - name: "get_*"
    mode: Passthrough
  - name: "charge_card_v?"
    mode: Passthrough
`

func TestParseRules(t *testing.T) {
	p, err := Parse([]byte(sample))
	if err != nil {
		t.Fatal(err)
	}
	if p.PrincipalHeader != "X-Forwarded-User" {
		t.Errorf("PrincipalHeader = %q, want it canonicalized", p.PrincipalHeader)
	}
	tests := []struct {
		tool    string
		mode    v1alpha1.ToolMode
		pattern string
		ttl     time.Duration
		scope   v1alpha1.KeyScope
	}{
		{"charge_card", v1alpha1.ModeDeduplicate, "charge_*", 72 * time.Hour, v1alpha1.ScopePrincipal},
		{"charge_card_v2", v1alpha1.ModeDeduplicate, "charge_*", 72 * time.Hour, v1alpha1.ScopePrincipal}, // first match wins
		{"get_balance", v1alpha1.ModePassthrough, "get_*", 24 * time.Hour, v1alpha1.ScopeSession},
		{"send_email", v1alpha1.ModeAuto, "", 24 * time.Hour, v1alpha1.ScopeSession},
		{"xcharge_card", v1alpha1.ModeAuto, "", 24 * time.Hour, v1alpha1.ScopeSession}, // globs are anchored
		{"charge.card", v1alpha1.ModeAuto, "", 24 * time.Hour, v1alpha1.ScopeSession},  // regexp metacharacters are literal
	}
	for _, tt := range tests {
		for range 2 { // the second lookup is served from the cache
			r := p.RuleFor(tt.tool)
			if r.Mode != tt.mode || r.Pattern != tt.pattern || r.TTL != tt.ttl || r.KeyScope != tt.scope {
				t.Errorf("RuleFor(%q) = mode %s pattern %q ttl %v scope %s, want %s %q %v %s",
					tt.tool, r.Mode, r.Pattern, r.TTL, r.KeyScope, tt.mode, tt.pattern, tt.ttl, tt.scope)
			}
		}
	}
	r := p.RuleFor("charge_card")
	if !r.CacheToolErrors || r.OnAbandoned != v1alpha1.AbandonedError || len(r.IgnoreArguments) != 1 {
		t.Errorf("charge rule = %+v", r)
	}
}

// TestRetryWindow: a derived key's window is spec.retryWindow (10m by
// default) unless a rule sets its own; the ttl of explicit keys is apart.
func TestRetryWindow(t *testing.T) {
	if w := Default().RuleFor("any").RetryWindow; w != 10*time.Minute {
		t.Errorf("default retry window %v, want 10m", w)
	}
	p, err := Parse([]byte(`spec:
  ttl: 24h
  retryWindow: 2s
  tools:
  - {name: "charge_*", ttl: 72h, retryWindow: 15m}
  - {name: "short", ttl: 1m}
  - {name: "get_*", mode: Passthrough}
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		tool        string
		ttl, window time.Duration
	}{
		{"charge_card", 72 * time.Hour, 15 * time.Minute},
		{"short", time.Minute, 2 * time.Second},
		{"get_balance", 24 * time.Hour, 2 * time.Second},
		{"send_email", 24 * time.Hour, 2 * time.Second},
	} {
		if r := p.RuleFor(tt.tool); r.TTL != tt.ttl || r.RetryWindow != tt.window {
			t.Errorf("RuleFor(%q): ttl %v window %v, want %v %v", tt.tool, r.TTL, r.RetryWindow, tt.ttl, tt.window)
		}
	}
	if p.RetryWindow != 2*time.Second {
		t.Errorf("policy RetryWindow %v, want 2s", p.RetryWindow)
	}
}

// TestDefaultRetryWindowFitsAShortTTL: with no retryWindow written, the
// window is 10m capped at each ttl, so a policy with a short ttl (valid
// before retryWindow existed) still compiles; only a window someone wrote
// that is longer than its ttl is refused.
func TestDefaultRetryWindowFitsAShortTTL(t *testing.T) {
	p, err := Parse([]byte(`spec:
  ttl: 5m
  tools:
  - {name: "short", ttl: 1m}
  - {name: "long", ttl: 72h}
  - {name: "own", ttl: 2h, retryWindow: 30m}
`))
	if err != nil {
		t.Fatalf("a short ttl with no retryWindow: %v", err)
	}
	for tool, want := range map[string]time.Duration{"any": 5 * time.Minute, "short": time.Minute, "long": 10 * time.Minute, "own": 30 * time.Minute} {
		if w := p.RuleFor(tool).RetryWindow; w != want {
			t.Errorf("RuleFor(%q).RetryWindow = %v, want %v", tool, w, want)
		}
	}
	p, err = Parse([]byte("spec: {ttl: 1h, retryWindow: 10m, tools: [{name: short, ttl: 1m}]}"))
	if err != nil {
		t.Fatalf("an inherited window longer than a rule's ttl: %v", err)
	}
	if w := p.RuleFor("short").RetryWindow; w != time.Minute {
		t.Errorf("inherited window = %v, want the rule's ttl 1m", w)
	}
}

func TestHashStable(t *testing.T) {
	a, _ := Parse([]byte(sample))
	b, _ := Parse([]byte(sample))
	if a.Hash != b.Hash || a.Hash == "" {
		t.Errorf("hashes %q and %q differ", a.Hash, b.Hash)
	}
	if Default().Hash == a.Hash {
		t.Error("different specs hash the same")
	}
	explicit, err := Parse([]byte("spec: {ttl: 24h, keyScope: Session, defaultMode: Auto}"))
	if err != nil {
		t.Fatal(err)
	}
	if explicit.Hash != Default().Hash {
		t.Error("spelling out the defaults changed the hash")
	}
}

func TestInvalid(t *testing.T) {
	tests := []struct {
		name, yaml, want string
	}{
		{"not yaml", "spec: [", "does not parse"},
		{"unknown field", "spec: {tll: 1h}", `spec.tll: unknown field; did you mean "ttl"?`},
		{"unknown field of a rule", "spec: {tools: [{name: a}, {name: b, mod: Passthrough}]}", `spec.tools[1].mod: unknown field; did you mean "mode"?`},
		{"letter case", "spec: {TTL: 1h}", `spec.TTL: unknown field; did you mean "ttl"?`},
		{"no spec wrapper", "ttl: 1h\ntools: [{name: a}]", "tools, ttl: fields of spec written at the top of the manifest; put them under spec:"},
		{"empty", "", "the policy is empty; write an IdempotencyPolicy manifest: apiVersion: idemcp.io/v1alpha1, kind: IdempotencyPolicy and its settings under spec:"},
		{"only comments", "# nothing yet\n", "the policy is empty"},
		{"a list", "- spec: {}", "the policy is a list, not a mapping"},
		{"wrong type", "spec: {tools: {name: a}}", "spec.tools: got a mapping, want a list"},
		{"duplicate key", "spec: {ttl: 1h, ttl: 2h}", `key "ttl" already set`},
		{"ttl too long", "spec: {ttl: 800h}", "spec.ttl: 800h0m0s is outside 1s..720h"},
		{"ttl too short", "spec: {ttl: 10ms}", "spec.ttl"},
		{"bad duration", "spec: {ttl: soon}", "soon"},
		{"store type", "spec: {store: {type: Mongo}}", `spec.store.type: "Mongo" is not one of Memory, Redis, Postgres`},
		{"postgres on memory", "spec: {store: {type: Memory, postgres: {urlSecretRef: {name: pg, key: url}}}}", `spec.store.postgres: goes only with type Postgres`},
		{"postgres with redis", "spec: {store: {type: Postgres, redis: {managed: {}}}}", `spec.store.redis: type Postgres takes no store.redis`},
		{"memory with redis", "spec: {store: {type: Memory, redis: {managed: {}}}}", "spec.store.redis: type Memory takes no store.redis"},
		{"redis without config", "spec: {store: {type: Redis}}", "spec.store.redis: type Redis needs exactly one"},
		{"redis both", "spec: {store: {type: Redis, redis: {managed: {}, external: {addresses: [a:1]}}}}", "exactly one"},
		{"minReplicas", "spec: {store: {type: Redis, redis: {external: {addresses: [a:1], minReplicas: 17}}}}", "store.redis.external.minReplicas: 17 is outside 0..16"},
		{"minReplicasTimeout alone", "spec: {store: {type: Redis, redis: {external: {addresses: [a:1], minReplicasTimeout: 1s}}}}", "store.redis.external.minReplicasTimeout: bounds the wait for minReplicas"},
		{"minReplicasTimeout", "spec: {store: {type: Redis, redis: {external: {addresses: [a:1], minReplicas: 1, minReplicasTimeout: 1m}}}}", "store.redis.external.minReplicasTimeout: 1m0s is outside 10ms..30s"},
		{"scope", "spec: {keyScope: User}", `spec.keyScope: "User" is not one of Session, Principal, Global`},
		{"inFlight", "spec: {inFlight: Queue}", "spec.inFlight"},
		{"onAbandoned", "spec: {onAbandoned: Ignore}", "spec.onAbandoned"},
		{"lease", "spec: {leaseDuration: 100ms}", "spec.leaseDuration"},
		{"max result", "spec: {maxResultBytes: 0}", "spec.maxResultBytes"},
		{"default mode", "spec: {defaultMode: Cache}", "spec.defaultMode"},
		{"principal header", `spec: {principalHeader: "X User"}`, "spec.principalHeader"},
		{"tool mode", "spec: {tools: [{name: a, mode: Always}]}", `spec.tools[0].mode: "Always" is not one of`},
		{"tool name empty", "spec: {tools: [{name: ''}]}", "spec.tools[0].name: is empty"},
		{"tool dup", "spec: {tools: [{name: a}, {name: a}]}", `spec.tools[1].name: "a" is already the name of tools[0]`},
		{"pointer", "spec: {tools: [{name: a, ignoreArguments: [requestedAt]}]}", "spec.tools[0].ignoreArguments[0]"},
		{"tool ttl", "spec: {tools: [{name: a, ttl: 0s}]}", "spec.tools[0].ttl"},
		{"retryWindow too short", "spec: {retryWindow: 10ms}", "spec.retryWindow: 10ms is outside 1s..720h"},
		{"explicit retryWindow over ttl", "spec: {ttl: 1h, retryWindow: 2h}", "spec.retryWindow: 2h0m0s is longer than spec.ttl (1h0m0s)"},
		{"tool retryWindow over its ttl", "spec: {tools: [{name: a, ttl: 1m, retryWindow: 2m}]}", "spec.tools[0].retryWindow: 2m0s is longer than the rule's ttl (1m0s, its own)"},
		{"tool retryWindow over spec ttl", "spec: {ttl: 1h, retryWindow: 1m, tools: [{name: a, retryWindow: 2h}]}", "spec.tools[0].retryWindow: 2h0m0s is longer than the rule's ttl (1h0m0s, from spec.ttl)"},
		{"tool retryWindow too short", "spec: {tools: [{name: a, retryWindow: 0s}]}", "spec.tools[0].retryWindow: 0s is outside"},
		{"kind", "kind: Pod\nspec: {}", `kind: "Pod" is not IdempotencyPolicy`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.yaml))
			if err == nil {
				t.Fatalf("Parse succeeded, want an error containing %q", tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not contain %q", err, tt.want)
			}
		})
	}
}

// TestEveryProblemAtOnce: a policy with several typos and bad values gets
// one error that lists each, with its path.
func TestEveryProblemAtOnce(t *testing.T) {
	_, err := Parse([]byte(`apiVersion: idemcp.io/v1alpha1
kind: IdempotencyPolicy
metdata: {name: payments}
spec:
  tll: 24h
  keyScope: User
  tools:
  - name: charge_*
    mode: Deduplicate
  - name: get_*
    mod: Passthrough
    ignoreArgs: [/a]
`))
	if err == nil {
		t.Fatal("Parse succeeded")
	}
	want := `5 problems:
  metdata: unknown field; did you mean "metadata"?
  spec.tll: unknown field; did you mean "ttl"?
  spec.tools[1].ignoreArgs: unknown field; did you mean "ignoreArguments"?
  spec.tools[1].mod: unknown field; did you mean "mode"?
  spec.keyScope: "User" is not one of Session, Principal, Global`
	if err.Error() != want {
		t.Errorf("error:\n%s\nwant:\n%s", err, want)
	}
}

func TestLoadFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, []byte(sample), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := LoadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if p.RuleFor("charge_card").Mode != v1alpha1.ModeDeduplicate {
		t.Error("rules not loaded from file")
	}
	if _, err := LoadFile(filepath.Join(t.TempDir(), "missing.yaml")); err == nil {
		t.Error("missing file loaded")
	}
}

// The samples users start from must load in a sidecar as they are.
func TestSamplesCompile(t *testing.T) {
	paths, err := filepath.Glob("../../config/samples/idemcp_*.yaml")
	if err != nil || len(paths) < 3 {
		t.Fatalf("found samples %v (%v), want at least 3", paths, err)
	}
	for _, path := range paths {
		if _, err := LoadFile(path); err != nil {
			t.Errorf("%s: %v", path, err)
		}
	}
}
