package plugin_test

import (
	"context"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/plugin"
)

func TestAnalyzeProxyNotReady(t *testing.T) {
	ns := newNamespace(t, "proxy", false)
	px := &v1alpha1.IdempotentProxy{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "stripe"},
		Spec: v1alpha1.IdempotentProxySpec{
			Upstream:  v1alpha1.ProxyUpstream{URL: "https://mcp.stripe.example"},
			PolicyRef: v1alpha1.PolicyReference{Name: "payments"},
		},
	}
	create(t, px)
	r, code := analyze(t, "-n", ns)
	wantOnly(t, r, plugin.CodeProxyNotReady, plugin.SeverityError, "idempotentproxy/"+ns+"/stripe", "no Ready condition")
	if code != 1 {
		t.Errorf("exit %d, want 1", code)
	}

	// As the controller reports a missing policy.
	px.Status.Conditions = []metav1.Condition{condition(v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonNotConfigured,
		"Configured: spec.policyRef.name: IdempotencyPolicy "+ns+"/payments does not exist", px.Generation)}
	if err := k8s.Status().Update(context.Background(), px); err != nil {
		t.Fatal(err)
	}
	r, _ = analyze(t, "-n", ns)
	wantOnly(t, r, plugin.CodeProxyNotReady, plugin.SeverityError, "idempotentproxy/"+ns+"/stripe", v1alpha1.ReasonNotConfigured, "spec.policyRef.name")
}
