package certs_test

import (
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/idemcp/idemcp/webhook/certs"

	"github.com/idemcp/idemcp/test/testdeps"
)

// TestDefaultsMatchConfigDefault: with no flags, the manager manages the
// objects config/default installs (its RBAC markers name them too).
func TestDefaultsMatchConfigDefault(t *testing.T) {
	objs := kustomize(t, "default")
	var svc corev1.Service
	decode(t, find(t, objs, "Service", certs.DefaultServiceName), &svc)
	if svc.Namespace != "idemcp-system" {
		t.Errorf("Service %s is in %q", svc.Name, svc.Namespace)
	}
	var config admissionregistrationv1.MutatingWebhookConfiguration
	decode(t, find(t, objs, "MutatingWebhookConfiguration", certs.DefaultWebhookConfigName), &config)
	for _, w := range config.Webhooks {
		if s := w.ClientConfig.Service; s == nil || s.Name != certs.DefaultServiceName || s.Namespace != svc.Namespace {
			t.Errorf("webhook %s calls %+v, not Service %s/%s", w.Name, s, svc.Namespace, svc.Name)
		}
	}
}

// TestCertManagerOverlay: config/certmanager hands the certificate to
// cert-manager consistently: the manager stops managing it, reads the
// Certificate's Secret, and the injected CA is that Certificate's.
func TestCertManagerOverlay(t *testing.T) {
	objs := kustomize(t, "certmanager")
	var manager appsv1.Deployment
	decode(t, find(t, objs, "Deployment", "idemcp-manager"), &manager)
	container := manager.Spec.Template.Spec.Containers[0]
	if !slices.Contains(container.Args, "--webhook-cert-management=cert-manager") {
		t.Errorf("manager args %v do not turn its own certificate management off", container.Args)
	}
	certDir := ""
	for _, a := range container.Args {
		if v, ok := strings.CutPrefix(a, "--webhook-cert-dir="); ok {
			certDir = v
		}
	}
	var volumeName string
	for _, m := range container.VolumeMounts {
		if m.MountPath == certDir {
			volumeName = m.Name
		}
	}
	var secretName string
	for _, v := range manager.Spec.Template.Spec.Volumes {
		if v.Name == volumeName {
			if v.EmptyDir != nil || v.Secret == nil {
				t.Errorf("volume %s at %s is not only a Secret: %+v", v.Name, certDir, v.VolumeSource)
			} else {
				secretName = v.Secret.SecretName
			}
		}
	}
	if secretName == "" {
		t.Fatalf("no Secret mounted at --webhook-cert-dir %q", certDir)
	}

	var config admissionregistrationv1.MutatingWebhookConfiguration
	decode(t, find(t, objs, "MutatingWebhookConfiguration", certs.DefaultWebhookConfigName), &config)
	ref := config.Annotations["cert-manager.io/inject-ca-from"]
	ns, name, _ := strings.Cut(ref, "/")
	cert := find(t, objs, "Certificate", name)
	if cert.GetNamespace() != ns {
		t.Errorf("inject-ca-from %q, but the Certificate is in %q", ref, cert.GetNamespace())
	}
	if got, _, _ := unstructured.NestedString(cert.Object, "spec", "secretName"); got != secretName {
		t.Errorf("the Certificate writes Secret %q, the manager mounts %q", got, secretName)
	}
	dnsNames, _, _ := unstructured.NestedStringSlice(cert.Object, "spec", "dnsNames")
	for _, w := range config.Webhooks {
		if s := w.ClientConfig.Service; s == nil || !slices.Contains(dnsNames, s.Name+"."+s.Namespace+".svc") {
			t.Errorf("the Certificate names %v, not the Service webhook %s calls", dnsNames, w.Name)
		}
	}
	issuerName, _, _ := unstructured.NestedString(cert.Object, "spec", "issuerRef", "name")
	find(t, objs, "Issuer", issuerName)
}

// kustomize builds config/<dir> with the kubectl of KUBEBUILDER_ASSETS.
func kustomize(t *testing.T, dir string) []*unstructured.Unstructured {
	t.Helper()
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	if assets == "" {
		testdeps.Missing(t, "no kubectl: export KUBEBUILDER_ASSETS=$(hack/setup-envtest.sh)")
	}
	var stderr bytes.Buffer
	cmd := exec.CommandContext(t.Context(), filepath.Join(assets, "kubectl"), "kustomize", filepath.Join("..", "..", "config", dir))
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kubectl kustomize config/%s: %v\n%s", dir, err, stderr.Bytes())
	}
	var objs []*unstructured.Unstructured
	decoder := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
	for {
		var u unstructured.Unstructured
		if err := decoder.Decode(&u.Object); errors.Is(err, io.EOF) {
			return objs
		} else if err != nil {
			t.Fatal(err)
		}
		if u.Object != nil {
			objs = append(objs, &u)
		}
	}
}

func find(t *testing.T, objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	t.Helper()
	for _, u := range objs {
		if u.GetKind() == kind && u.GetName() == name {
			return u
		}
	}
	t.Fatalf("no %s %s", kind, name)
	return nil
}

func decode(t *testing.T, u *unstructured.Unstructured, into any) {
	t.Helper()
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, into); err != nil {
		t.Fatal(err)
	}
}
