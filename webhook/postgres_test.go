package webhook_test

import (
	"context"
	"strings"
	"testing"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestInjectsPostgresURL: the sidecar of a Postgres policy gets the
// connection string as a secretKeyRef env var, never in the policy.
func TestInjectsPostgresURL(t *testing.T) {
	ns := namespace(t, true)
	createSecret(t, ns, "payments-db", true, map[string]string{"dsn": "postgres://u:p@db:5432/db"})
	createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StorePostgres,
		Postgres: &v1alpha1.PostgresStoreSpec{URLSecretRef: v1alpha1.SecretKeyRef{Name: "payments-db", Key: "dsn"}}}})
	pod := mcpPod(ns, "mcp-pg", optIn)
	if err := k8s.Create(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	c, _ := sidecarOf(t, pod)
	env := envValue(c, "IDEMCP_POSTGRES_URL")
	if env == nil || env.Value != "" || env.ValueFrom == nil || env.ValueFrom.SecretKeyRef == nil ||
		env.ValueFrom.SecretKeyRef.Name != "payments-db" || env.ValueFrom.SecretKeyRef.Key != "dsn" {
		t.Fatalf("IDEMCP_POSTGRES_URL = %+v, want a secretKeyRef to payments-db/dsn", env)
	}
	if envValue(c, "IDEMCP_REDIS_PASSWORD") != nil {
		t.Error("a Postgres policy got a Redis password")
	}
	if snap := envValue(c, "IDEMCP_POLICY"); snap == nil || !strings.Contains(snap.Value, `"type":"Postgres"`) {
		t.Errorf("policy snapshot %+v does not name the Postgres store", snap)
	}
}
