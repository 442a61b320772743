// Package credentials holds idemcp's one rule for Secrets: a policy may
// use a Secret only with its owner's consent, the label
// idemcp.io/credentials: "true" on the Secret. A sidecar sends what a
// Secret holds to addresses the policy names, so without that consent
// anyone who may edit policies, but not read Secrets, could have any
// Secret of the namespace sent to a host of theirs. The webhook, before it
// gives a sidecar a secretKeyRef, and the controller, before it reports a
// store ready, both ask Check.
package credentials

import (
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/managedredis"
)

// Label and Value opt a Secret in to use by idemcp.
const (
	Label = v1alpha1.LabelCredentials
	Value = "true"
)

// Managed Secrets: the names and keys the controller gives a policy's own
// Secrets (it makes them, labelled).
const (
	RedisPasswordKey = managedredis.PasswordKey
	RedisConfigKey   = managedredis.ConfigKey
	SealKeysKey      = "keys"
)

// RedisSecretName is the Secret of a policy's managed Redis.
func RedisSecretName(policy string) string { return managedredis.Name(policy) }

// SealSecretName is the Secret of a policy's seal keys.
func SealSecretName(policy string) string { return policy + "-seal" }

// Ref is one Secret key a policy's sidecars get, as an environment
// variable the kubelet resolves.
type Ref struct {
	// Field is where the policy names it, or what the controller makes
	// it for ("the managed Redis's password").
	Field string
	// Env is the sidecar's environment variable that gets it.
	Env  string
	Name string
	Key  string
	// Managed is true for the Secrets the controller makes for the policy.
	Managed bool
}

// Refs lists every Secret key a policy's sidecars get: the webhook injects
// exactly these, so none escapes Check.
func Refs(p *v1alpha1.IdempotencyPolicy) []Ref {
	var out []Ref
	s := p.Spec.Store
	shared := false
	if r := s.Redis; s.Type == v1alpha1.StoreRedis && r != nil {
		shared = true
		switch {
		case r.Managed != nil:
			out = append(out, Ref{Field: "the managed Redis's password", Env: "IDEMCP_REDIS_PASSWORD", Name: RedisSecretName(p.Name), Key: RedisPasswordKey, Managed: true})
		case r.External != nil && r.External.PasswordSecretRef != nil:
			ref := r.External.PasswordSecretRef
			out = append(out, Ref{Field: "spec.store.redis.external.passwordSecretRef", Env: "IDEMCP_REDIS_PASSWORD", Name: ref.Name, Key: ref.Key})
		}
	}
	if pg := s.Postgres; s.Type == v1alpha1.StorePostgres && pg != nil {
		shared = true
		out = append(out, Ref{Field: "spec.store.postgres.urlSecretRef", Env: "IDEMCP_POSTGRES_URL", Name: pg.URLSecretRef.Name, Key: pg.URLSecretRef.Key})
	}
	if shared {
		out = append(out, Ref{Field: "the seal keys", Env: "IDEMCP_SEAL_KEYS", Name: SealSecretName(p.Name), Key: SealKeysKey, Managed: true})
	}
	return out
}

// Fields are the fields of the API that name a Secret; a test holds it
// to the API's types, so a new one cannot be forgotten here.
var Fields = []string{
	"spec.store.redis.external.passwordSecretRef",
	"spec.store.postgres.urlSecretRef",
}

// NotLabelled is the refusal of a Secret without the owner's consent.
type NotLabelled struct {
	Namespace string
	Ref       Ref
}

func (e *NotLabelled) Error() string {
	return fmt.Sprintf("Secret %s/%s (%s) lacks the label %s: %q, which opts a Secret in to use by idemcp, so that whoever may edit a policy cannot have any Secret sent to any address; if this Secret is meant for idemcp, its owner adds the label: %s",
		e.Namespace, e.Ref.Name, e.Ref.Field, Label, Value, LabelCommand(e.Namespace, e.Ref.Name))
}

// LabelCommand is how a Secret's owner opts it in.
func LabelCommand(ns, name string) string {
	return fmt.Sprintf("kubectl -n %s label secret %s %s=%s", ns, name, Label, Value)
}

// Allowed is the rule itself: a policy may use the Secret only if it
// carries the label.
func Allowed(secret metav1.Object) bool { return secret.GetLabels()[Label] == Value }

// Check returns nil if the policy may use secret for ref, else a
// *NotLabelled that names the Secret and the label.
func Check(ref Ref, secret metav1.Object) error {
	if Allowed(secret) {
		return nil
	}
	return &NotLabelled{Namespace: secret.GetNamespace(), Ref: ref}
}
