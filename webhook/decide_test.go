package webhook_test

import (
	"context"
	"errors"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/webhook"
)

// TestDecideSaysWhy: Decide, which kubectl idemcp check-inject runs as a
// dry run, says why it left a pod alone. Its Recorder is nil: a dry run
// that wrote an Event would panic.
func TestDecideSaysWhy(t *testing.T) {
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", v1alpha1.IdempotencyPolicySpec{})
	inj := &webhook.Injector{Client: k8s, Config: sidecar, ManagerNamespace: "idemcp-system", MissingPolicy: webhook.MissingPolicyDeny}
	dryRun := func(namespace string) context.Context {
		return admission.NewContextWithRequest(context.Background(), admission.Request{AdmissionRequest: admissionv1.AdmissionRequest{Namespace: namespace, DryRun: ptr.To(true)}})
	}

	notOptedIn := mcpPod(ns, "a", optIn)
	notOptedIn.Labels = nil
	host := mcpPod(ns, "b", optIn)
	host.Spec.HostNetwork = true
	injected := mcpPod(ns, "c", optIn)
	if _, err := inj.Decide(dryRun(ns), injected); err != nil || !webhook.Injected(injected) {
		t.Fatalf("an opted-in pod: err %v, injected %t", err, webhook.Injected(injected))
	}
	for _, c := range []struct {
		ns   string
		pod  *corev1.Pod
		want string
	}{
		{ns, notOptedIn, webhook.SkipNotOptedIn},
		{ns, host, webhook.SkipHostNetwork},
		{ns, injected, webhook.SkipAlreadyInjected},
		{"idemcp-system", mcpPod("idemcp-system", "d", optIn), webhook.SkipManagerNamespace},
	} {
		if got, err := inj.Decide(dryRun(c.ns), c.pod); got != c.want || err != nil {
			t.Errorf("pod %s: skipped %q, err %v; want %q", c.pod.Name, got, err, c.want)
		}
	}

	_, err := inj.Decide(dryRun(ns), mcpPod(ns, "e", map[string]string{webhook.AnnotationPolicy: "nope"}))
	var r *webhook.Refusal
	if !errors.As(err, &r) || r.Reason != webhook.DenyPolicyMissing {
		t.Errorf("a pod naming a missing policy: %v, want a %s refusal", err, webhook.DenyPolicyMissing)
	}
}
