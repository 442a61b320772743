// Package v1alpha1 contains the idemcp.io/v1alpha1 API: the IdempotencyPolicy
// that users apply with kubectl and that every sidecar enforces.
// +kubebuilder:object:generate=true
// +groupName=idemcp.io
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

var (
	// GroupVersion is the group and version of every kind in this package.
	GroupVersion = schema.GroupVersion{Group: "idemcp.io", Version: "v1alpha1"}

	// SchemeBuilder registers the kinds of this package with a scheme.
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)

	// AddToScheme adds the kinds of this package to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

func addKnownTypes(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion, &IdempotencyPolicy{}, &IdempotencyPolicyList{}, &IdempotentProxy{}, &IdempotentProxyList{})
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
