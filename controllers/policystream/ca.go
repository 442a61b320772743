package policystream

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// DefaultServiceName is the Service sidecars reach the stream through
// (config/default's namePrefix makes it idemcp-policy-stream); the
// serving certificate names it.
const DefaultServiceName = "idemcp-policy-stream"

// DefaultPort is the stream's port.
const DefaultPort = 9444

// DNSNames are the names a sidecar may use to reach the stream's Service.
func DNSNames(service, namespace string) []string {
	return []string{service, service + "." + namespace, service + "." + namespace + ".svc", service + "." + namespace + ".svc.cluster.local"}
}

// URL is the endpoint the webhook gives sidecars.
func URL(service, namespace string, port int) string {
	return fmt.Sprintf("https://%s.%s.svc:%d", service, namespace, port)
}

// CABundleFromSecret reads ca.crt of the webhook certificate Secret (every
// unexpired CA, current first: webhook/certs keeps the replaced ones), at
// most every ttl.
func CABundleFromSecret(reader client.Reader, namespace, name string, ttl time.Duration) func(context.Context) ([]byte, error) {
	return cached(ttl, func(ctx context.Context) ([]byte, error) {
		var s corev1.Secret
		if err := reader.Get(ctx, client.ObjectKey{Namespace: namespace, Name: name}, &s); err != nil {
			return nil, fmt.Errorf("reading the CA of Secret %s/%s: %w", namespace, name, err)
		}
		if len(s.Data["ca.crt"]) == 0 {
			return nil, fmt.Errorf("secret %s/%s has no ca.crt", namespace, name)
		}
		return s.Data["ca.crt"], nil
	})
}

// CABundleFromFile reads a PEM file (cert-manager's ca.crt beside the
// serving pair), at most every ttl.
func CABundleFromFile(path string, ttl time.Duration) func(context.Context) ([]byte, error) {
	return cached(ttl, func(context.Context) ([]byte, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("reading the policy stream's CA bundle: %w", err)
		}
		if len(b) == 0 {
			return nil, errors.New("the policy stream's CA bundle " + path + " is empty")
		}
		return b, nil
	})
}

func cached(ttl time.Duration, read func(context.Context) ([]byte, error)) func(context.Context) ([]byte, error) {
	var mu sync.Mutex
	var last []byte
	var at time.Time
	return func(ctx context.Context) ([]byte, error) {
		mu.Lock()
		defer mu.Unlock()
		if last != nil && time.Since(at) < ttl {
			return last, nil
		}
		b, err := read(ctx)
		if err != nil {
			return nil, err
		}
		last, at = b, time.Now()
		return b, nil
	}
}
