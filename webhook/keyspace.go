package webhook

import (
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// AnnotationKeySpace names the key space a pod's sidecar uses, when
// several workloads are one MCP server (blue/green): the workloads whose
// pods carry the same value share results. Without it, each workload has
// its own.
const AnnotationKeySpace = v1alpha1.AnnotationKeySpace

// keySpacePrefix sets a named key space apart from a workload's, so that
// no name a user writes can be another workload's key space.
const keySpacePrefix = "key-space/"

// keySpaceOf is the key space of a pod's sidecar (its --key-space): the
// name in idemcp.io/key-space, or the pod's workload as its controller
// names it at admission. Replicas and rollouts of one Deployment or
// StatefulSet share it; two workloads never do unless they say so.
func keySpaceOf(pod *corev1.Pod) (string, error) {
	if v, ok := pod.Annotations[AnnotationKeySpace]; ok {
		if errs := validation.IsDNS1123Label(v); len(errs) > 0 {
			return "", refuse(DenyBadAnnotation, "the pod's annotation %s is %q: %s; give the same DNS label (lowercase letters, digits and '-', at most 63) to the workloads that are one MCP server, such as \"checkout\", or remove it so that each workload keeps its own results",
				AnnotationKeySpace, v, strings.Join(errs, "; "))
		}
		return keySpacePrefix + v, nil
	}
	return workloadOf(pod), nil
}

// workloadOf names the workload a pod belongs to, from its controller
// reference alone (the webhook reads no other object): a ReplicaSet that
// a Deployment (or an Argo Rollout) made is named after it by its
// pod-template-hash.
func workloadOf(pod *corev1.Pod) string {
	ref := metav1.GetControllerOf(pod)
	if ref == nil {
		name := pod.Name
		if name == "" {
			name = pod.GenerateName
		}
		return "Pod/" + name
	}
	if ref.Kind == "ReplicaSet" {
		for label, kind := range map[string]string{"pod-template-hash": "Deployment", "rollouts-pod-template-hash": "Rollout"} {
			if h := pod.Labels[label]; h != "" && strings.HasSuffix(ref.Name, "-"+h) {
				return kind + "/" + strings.TrimSuffix(ref.Name, "-"+h)
			}
		}
	}
	return ref.Kind + "/" + ref.Name
}
