package controllers_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

func TestPostgresSecret(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	p := &v1alpha1.IdempotencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "orders", Namespace: ns},
		Spec: v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StorePostgres,
			Postgres: &v1alpha1.PostgresStoreSpec{URLSecretRef: v1alpha1.SecretKeyRef{Name: "orders-db", Key: "url"}}}},
	}
	if err := k8s.Create(ctx, p); err != nil {
		t.Fatal(err)
	}
	eventually(t, "StoreReady False naming the Secret", func() error {
		p := getPolicy(t, ns, "orders")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonSecretNotFound); err != nil {
			return err
		}
		if msg := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady).Message; !strings.Contains(msg, ns+"/orders-db") || !strings.Contains(msg, "urlSecretRef") {
			return fmt.Errorf("message %q does not name the Secret and the field", msg)
		}
		return condition(p, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonStoreNotReady)
	})
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "orders-db", Namespace: ns},
		StringData: map[string]string{"url": "postgres://idemcp:s3cret@db.shared.svc:6432/orders?sslmode=require&connect_timeout=%%%"}}
	if err := k8s.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "SecretNotLabelled for a Secret not opted in to idemcp", func() error {
		return condition(getPolicy(t, ns, "orders"), v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonSecretNotLabelled)
	})
	secret.Labels = map[string]string{v1alpha1.LabelCredentials: "true"}
	if err := k8s.Update(ctx, secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "InvalidSecret for a value that is no connection string", func() error {
		p := getPolicy(t, ns, "orders")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonInvalidSecret); err != nil {
			return err
		}
		if msg := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady).Message; strings.Contains(msg, "s3cret") {
			return fmt.Errorf("the message shows the password: %q", msg)
		}
		return nil
	})
	secret.StringData = map[string]string{"url": "postgres://idemcp:s3cret@db.shared.svc:6432/orders?sslmode=require"}
	if err := k8s.Update(ctx, secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "StoreReady once the Secret holds a connection string", func() error {
		p := getPolicy(t, ns, "orders")
		if p.Status.Store == nil || p.Status.Store.Endpoint != "db.shared.svc:6432/orders" {
			return fmt.Errorf("endpoint %+v, want host:port/database without the password", p.Status.Store)
		}
		return errors.Join(condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonExternalPostgres),
			condition(p, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonReady))
	})
}
