package webhook_test

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/idemcp/idemcp/webhook"
)

// replicaSetPod is a pod as a Deployment's ReplicaSet creates it: named
// after the ReplicaSet, labelled with its pod-template-hash, controlled by it.
func replicaSetPod(ns, deployment, hash, suffix string, annotations map[string]string) *corev1.Pod {
	pod := mcpPod(ns, deployment+"-"+hash+"-"+suffix, annotations)
	pod.Labels["pod-template-hash"] = hash
	pod.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: deployment + "-" + hash,
		UID: types.UID("rs-" + deployment + "-" + hash), Controller: ptr.To(true)}}
	return pod
}

// TestKeySpaceIsTheWorkload: the webhook gives each sidecar its workload
// as its key space, the same for every replica and rollout of one
// Deployment and different for two Deployments under one policy; two
// workloads annotated with one idemcp.io/key-space share it, and a
// key space that is not a DNS label is refused, naming the annotation.
func TestKeySpaceIsTheWorkload(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t, true)
	createPolicy(t, ns, "payments", managedSpec())
	share := map[string]string{webhook.AnnotationPolicy: "payments", webhook.AnnotationKeySpace: "checkout"}
	for _, tc := range []struct {
		pod  *corev1.Pod
		want string
	}{
		{replicaSetPod(ns, "orders", "5d4f8b", "a1", optIn), "Deployment/orders"},
		{replicaSetPod(ns, "orders", "5d4f8b", "b2", optIn), "Deployment/orders"},
		{replicaSetPod(ns, "orders", "77c9d1", "c3", optIn), "Deployment/orders"}, // the next rollout
		{replicaSetPod(ns, "billing", "5d4f8b", "a1", optIn), "Deployment/billing"},
		{replicaSetPod(ns, "checkout-blue", "6b7c8d", "a1", share), "key-space/checkout"},
		{replicaSetPod(ns, "checkout-green", "9e8f7a", "a1", share), "key-space/checkout"},
		{mcpPod(ns, "alone", optIn), "Pod/alone"},
	} {
		if err := k8s.Create(ctx, tc.pod); err != nil {
			t.Fatalf("%s: %v", tc.pod.Name, err)
		}
		c, _ := sidecarOf(t, tc.pod)
		if ev := envValue(c, webhook.EnvKeySpace); ev == nil || ev.Value != tc.want {
			t.Errorf("pod %s: %s = %+v, want %q", tc.pod.Name, webhook.EnvKeySpace, ev, tc.want)
		}
		if !strings.Contains(tc.pod.Annotations[webhook.AnnotationStatus], `"keySpace":"`+tc.want+`"`) {
			t.Errorf("pod %s: status annotation %s does not name key space %q", tc.pod.Name, tc.pod.Annotations[webhook.AnnotationStatus], tc.want)
		}
	}
	bad := mcpPod(ns, "bad-space", map[string]string{webhook.AnnotationPolicy: "payments", webhook.AnnotationKeySpace: "Checkout/Blue"})
	err := k8s.Create(ctx, bad)
	if err == nil || !strings.Contains(err.Error(), `idemcp.io/key-space is "Checkout/Blue"`) || !strings.Contains(err.Error(), "DNS label") {
		t.Errorf("pod with key space %q: %v, want a refusal naming the annotation and what it accepts", "Checkout/Blue", err)
	}
}
