package controllers_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestManagedSecretMissingItsKeyIsRepaired: a managed Redis's Secret that
// lost its password key gets it back, the one Redis runs with (from its
// redis.conf), with an Event that says so; before, new pods got a
// secretKeyRef to a key that did not exist and never started.
func TestManagedSecretMissingItsKeyIsRepaired(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "keys")); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "keys-redis"}
	var secret corev1.Secret
	eventually(t, "the Secret", func() error { return k8s.Get(ctx, key, &secret) })
	password := string(secret.Data["password"])
	delete(secret.Data, "password")
	if err := k8s.Update(ctx, &secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the password key back, unchanged", func() error {
		var s corev1.Secret
		if err := k8s.Get(ctx, key, &s); err != nil {
			return err
		}
		if got := string(s.Data["password"]); got != password {
			return fmt.Errorf("password %q, want the one Redis runs with", got)
		}
		return nil
	})
	assertEvent(t, ns, "keys", "RedisSecretRepaired", `Secret keys-redis had no key "password"; put it back with the password of its redis.conf`)
}

// TestHandEditedRedisPasswordNamesStalePods: a password changed by hand
// in the managed Secret is the one Redis restarts with (redis.conf is
// made from it), and the status names the running pods that still hold
// the old one and the command that restarts them, until they are gone.
// Before, StoreReady stayed RedisAvailable and the pods failed silently.
func TestHandEditedRedisPasswordNamesStalePods(t *testing.T) {
	ctx := context.Background()
	ns := newNamespace(t)
	if err := k8s.Create(ctx, managedPolicy(ns, "edit")); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "edit-redis"}
	var secret corev1.Secret
	var sts appsv1.StatefulSet
	eventually(t, "the Secret and StatefulSet", func() error { return errors.Join(k8s.Get(ctx, key, &secret), k8s.Get(ctx, key, &sts)) })
	markReady(t, &sts)
	rs := newDeployment(t, ns, "mcp", "7d9f")["7d9f"]
	pod := injectedPod(t, ns, "mcp-7d9f-a", "edit", rs, true)
	eventually(t, "RedisAvailable", func() error {
		return condition(getPolicy(t, ns, "edit"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable)
	})
	hash := func() string {
		if err := k8s.Get(ctx, key, &sts); err != nil {
			t.Fatal(err)
		}
		return sts.Spec.Template.Annotations["idemcp.io/config-hash"]
	}
	before := hash()

	if err := k8s.Get(ctx, key, &secret); err != nil {
		t.Fatal(err)
	}
	secret.Data["password"] = []byte("chosen-by-hand")
	if err := k8s.Update(ctx, &secret); err != nil {
		t.Fatal(err)
	}
	eventually(t, "RedisPasswordChanged naming the pod and the restart", func() error {
		p := getPolicy(t, ns, "edit")
		if err := condition(p, v1alpha1.ConditionStoreReady, metav1.ConditionFalse, v1alpha1.ReasonRedisPasswordChanged); err != nil {
			return err
		}
		for _, want := range []string{"the password in Secret edit-redis was changed by hand", "1 pod (mcp-7d9f-a) still hold", "kubectl -n " + ns + " rollout restart deployment/mcp"} {
			if !strings.Contains(storeMessage(p), want) {
				return fmt.Errorf("message %q lacks %q", storeMessage(p), want)
			}
		}
		return nil
	})
	assertEvent(t, ns, "edit", v1alpha1.ReasonRedisPasswordChanged, "mcp-7d9f-a")
	if err := k8s.Get(ctx, key, &secret); err != nil {
		t.Fatal(err)
	}
	if got := string(secret.Data["redis.conf"]); got != "requirepass chosen-by-hand\n" {
		t.Errorf("redis.conf %q does not require the new password", got)
	}
	if hash() == before {
		t.Error("Redis does not restart with the new password")
	}
	markReady(t, &sts) // as the StatefulSet controller, once Redis is back
	if err := k8s.Delete(ctx, pod); err != nil {
		t.Fatal(err)
	}
	eventually(t, "RedisAvailable once no pod holds the old password", func() error {
		return condition(getPolicy(t, ns, "edit"), v1alpha1.ConditionStoreReady, metav1.ConditionTrue, v1alpha1.ReasonRedisAvailable)
	})
}
