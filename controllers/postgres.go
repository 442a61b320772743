package controllers

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/credentials"
)

// reconcilePostgres checks the Secret of a PostgreSQL store: it exists, has
// the key, and the key holds a connection string. The endpoint shown is
// the host and database, never the password.
func (r *IdempotencyPolicyReconciler) reconcilePostgres(ctx context.Context, p *v1alpha1.IdempotencyPolicy) (storeState, time.Duration, error) {
	ref := p.Spec.Store.Postgres.URLSecretRef
	st := storeState{status: metav1.ConditionTrue, reason: v1alpha1.ReasonExternalPostgres, endpoint: "postgres"}
	var secret corev1.Secret
	err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: p.Namespace, Name: ref.Name}, &secret)
	switch {
	case apierrors.IsNotFound(err):
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonSecretNotFound
		st.message = fmt.Sprintf("Secret %s/%s named by spec.store.postgres.urlSecretRef does not exist; create it with the PostgreSQL connection string (postgres://user:password@host:5432/db) under key %q and the label %s: \"true\"", p.Namespace, ref.Name, ref.Key, v1alpha1.LabelCredentials)
		return st, r.recheck(), nil
	case err != nil:
		return st, 0, fmt.Errorf("reading Secret %s/%s: %w", p.Namespace, ref.Name, err)
	}
	if err := credentials.Check(credentials.Ref{Field: "spec.store.postgres.urlSecretRef", Name: ref.Name, Key: ref.Key}, &secret); err != nil {
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonSecretNotLabelled
		st.message = err.Error() + "; until then the webhook refuses new pods of this policy"
		return st, r.recheck(), nil
	}
	raw, ok := secret.Data[ref.Key]
	if !ok {
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonSecretKeyMissing
		st.message = fmt.Sprintf("Secret %s/%s has no key %q (spec.store.postgres.urlSecretRef.key); add the PostgreSQL connection string under that key", p.Namespace, ref.Name, ref.Key)
		return st, r.recheck(), nil
	}
	cfg, err := pgconn.ParseConfig(string(raw))
	if err != nil {
		st.status, st.reason = metav1.ConditionFalse, v1alpha1.ReasonInvalidSecret
		// pgconn's error may quote the value, password and all.
		st.message = fmt.Sprintf("Secret %s/%s key %q is not a PostgreSQL connection string; write it as postgres://user:password@host:5432/db?sslmode=verify-full", p.Namespace, ref.Name, ref.Key)
		return st, r.recheck(), nil
	}
	st.endpoint = fmt.Sprintf("%s:%d/%s", cfg.Host, cfg.Port, cfg.Database)
	st.message = "sidecars connect to PostgreSQL at " + st.endpoint
	return st, 0, nil
}
