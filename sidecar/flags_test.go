package sidecar

import (
	"context"
	"strings"
	"testing"
	"time"
)

// By hand the admin listener is loopback only; in a pod the webhook sets
// its port on every interface. The limit flags take their defaults, or
// IDEMCP_* from the environment.
func TestFlagDefaults(t *testing.T) {
	t.Setenv("IDEMCP_MAX_STREAMS", "77")
	var o Options
	if err := NewFlagSet(&o).Parse([]string{"--max-waiters-per-key", "5"}); err != nil {
		t.Fatal(err)
	}
	if o.AdminListen != "127.0.0.1:9091" {
		t.Errorf("--admin-listen defaults to %q, want loopback 127.0.0.1:9091", o.AdminListen)
	}
	if o.Limits.MaxStreams != 77 || o.Limits.MaxWaitersPerKey != 5 || o.Limits.MaxStreamsPerPrincipal != 4096 || o.Limits.MaxWaitersPerPrincipal != 4096 {
		t.Errorf("limits %+v, want streams 77 (env), waiters/key 5 (flag), the rest defaults", o.Limits)
	}
}

// TestEnvErrorsNameTheVariable: values from IDEMCP_* that fail the checks
// made after parsing (the upstream's scheme, the listen address) are
// reported under the variable's name.
func TestEnvErrorsNameTheVariable(t *testing.T) {
	for _, tc := range []struct{ env, value, want string }{
		{"IDEMCP_UPSTREAM", "ftp://x", `IDEMCP_UPSTREAM (--upstream): "ftp://x" is not an http:// or https:// URL with a host`},
		{"IDEMCP_LOG_LEVEL", "loud", `IDEMCP_LOG_LEVEL: "loud" is not one of debug, info, warn, error`},
		{"IDEMCP_LISTEN", "nonsense", "IDEMCP_LISTEN (--listen): listen tcp: address nonsense: missing port in address"},
		{"IDEMCP_UPSTREAM_DIAL_IPS", "10.1.2.3,mcp.local", `IDEMCP_UPSTREAM_DIAL_IPS (--upstream-dial-ips): "mcp.local" is not an IP address`},
		{"IDEMCP_LEGACY_KEYS", "soon", `IDEMCP_LEGACY_KEYS (--legacy-keys): "soon" is neither "writers" nor an RFC 3339 time, such as 2026-12-02T03:00:00Z`},
	} {
		t.Run(tc.env, func(t *testing.T) {
			t.Setenv(tc.env, tc.value)
			args := []string{"--admin-listen", ""}
			if tc.env != "IDEMCP_UPSTREAM" {
				args = append(args, "--upstream", "http://127.0.0.1:1")
			}
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			err := Main(ctx, args)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v\nwant one containing %s", err, tc.want)
			}
		})
	}
}

// TestLegacyKeysFlag: IDEMCP_LEGACY_KEYS, as the webhook sets it, is what
// the engine starts with.
func TestLegacyKeysFlag(t *testing.T) {
	for v, want := range map[string]string{"writers": "writers", "2026-12-02T03:00:00Z": "until 2026-12-02T03:00:00Z", "": "none"} {
		t.Setenv("IDEMCP_LEGACY_KEYS", v)
		var o Options
		if err := NewFlagSet(&o).Parse([]string{"--upstream", "http://127.0.0.1:1", "--admin-listen", "", "--key-space", "Deployment/api"}); err != nil {
			t.Fatal(err)
		}
		s, err := New(o)
		if err != nil {
			t.Fatal(err)
		}
		got := "none"
		switch l := s.Engine().LegacyKeys(); {
		case l.Writers:
			got = "writers"
		case !l.Until.IsZero():
			got = "until " + l.Until.UTC().Format(time.RFC3339)
		}
		if got != want {
			t.Errorf("IDEMCP_LEGACY_KEYS=%q: the engine has %s, want %s", v, got, want)
		}
	}
}

// TestRetryWindowFlag: --retry-window (IDEMCP_RETRY_WINDOW) sets the
// window of a sidecar run without a manager, checked against the ttl.
func TestRetryWindowFlag(t *testing.T) {
	t.Setenv("IDEMCP_RETRY_WINDOW", "2s")
	var o Options
	if err := NewFlagSet(&o).Parse([]string{"--upstream", "http://127.0.0.1:1", "--admin-listen", ""}); err != nil {
		t.Fatal(err)
	}
	s, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	if p := s.Engine().Policy(); p.RetryWindow != 2*time.Second || p.RuleFor("any").RetryWindow != 2*time.Second || p.TTL != 24*time.Hour {
		t.Errorf("window %v (rule %v), ttl %v; want 2s, 2s, 24h", p.RetryWindow, p.RuleFor("any").RetryWindow, p.TTL)
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--retry-window", "48h"}, "--retry-window 48h0m0s: spec.retryWindow: 48h0m0s is longer than spec.ttl (24h0m0s)"},
		{[]string{"--retry-window", "1m", "--policy-endpoint", "https://manager:9443"}, "--retry-window is for a sidecar without a manager"},
	} {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		err := Main(ctx, append([]string{"--upstream", "http://127.0.0.1:1", "--admin-listen", ""}, tc.args...))
		cancel()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: got %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
}

func TestStoreFlagsReadConventionalEnv(t *testing.T) {
	t.Setenv("REDIS_URL", "redis://r:6379")
	t.Setenv("DATABASE_URL", "postgres://db/app")
	var so Options
	if err := NewFlagSet(&so).Parse(nil); err != nil {
		t.Fatal(err)
	}
	o := so.Store
	if o.RedisURL != "redis://r:6379" || o.PostgresURL != "postgres://db/app" {
		t.Fatalf("REDIS_URL/DATABASE_URL not read: %+v", o)
	}
	t.Setenv("IDEMCP_POSTGRES_URL", "postgres://mine/app")
	so = Options{}
	if err := NewFlagSet(&so).Parse(nil); err != nil {
		t.Fatal(err)
	}
	if o = so.Store; o.PostgresURL != "postgres://mine/app" {
		t.Fatalf("IDEMCP_POSTGRES_URL does not win over DATABASE_URL: %q", o.PostgresURL)
	}
}
