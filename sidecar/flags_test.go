package sidecar

import "testing"

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
