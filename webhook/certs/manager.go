// Package certs keeps the webhook's serving certificate without
// cert-manager: a CA and a serving certificate live in one Secret, which is
// the source of truth for every manager replica; each replica writes the
// key pair to the webhook server's CertDir and keeps the caBundle of the
// MutatingWebhookConfiguration equal to the CA.
package certs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/manager"
)

// Writes are restricted to the objects of config/default by name; a
// deployment that renames them must widen these rules. Create cannot be
// restricted by name. Reads go through an uncached reader, so neither list
// nor watch is needed.
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;create
// +kubebuilder:rbac:groups="",resources=secrets,verbs=update,resourceNames=idemcp-webhook-server-cert
// +kubebuilder:rbac:groups=admissionregistration.k8s.io,resources=mutatingwebhookconfigurations,verbs=get;update;patch,resourceNames=idemcp-mutating-webhook-configuration

// maxAttempts bounds how often one ensure re-reads the Secret after losing
// a race to another replica.
const maxAttempts = 5

// maxRetryInterval caps the wait after a failed check or while the
// MutatingWebhookConfiguration does not exist yet: pod admission depends
// on the caBundle, so an hour is too long to wait for it.
const maxRetryInterval = 30 * time.Second

// Manager issues, rotates and distributes the webhook's serving
// certificate. Every replica runs one (it needs no leader election).
type Manager struct {
	client client.Client
	reader client.Reader
	opts   Options
	// optsErr is returned by every call: New cannot fail.
	optsErr error

	ready     chan struct{}
	readyOnce sync.Once

	// mu makes EnsureOnce and the loop take turns.
	mu sync.Mutex
	// webhookConfigMissing logs a missing MutatingWebhookConfiguration
	// once, not at every retry.
	webhookConfigMissing bool
}

var (
	_ manager.Runnable               = (*Manager)(nil)
	_ manager.LeaderElectionRunnable = (*Manager)(nil)
)

// New returns a Manager that writes with c and reads with reader. reader
// should be uncached (mgr.GetAPIReader()): EnsureOnce runs before the
// manager's cache starts, and a cache would need list and watch on every
// Secret.
func New(c client.Client, reader client.Reader, o Options) *Manager {
	opts, err := o.complete()
	return &Manager{client: c, reader: reader, opts: opts, optsErr: err, ready: make(chan struct{})}
}

// EnsureOnce makes the Secret, the files in CertDir and the caBundle
// current. Call it before the webhook server starts, so the server has a
// certificate from its first request. A MutatingWebhookConfiguration that
// does not exist yet is not an error: Start patches it when it appears.
func (m *Manager) EnsureOnce(ctx context.Context) error {
	_, err := m.ensure(ctx)
	return err
}

// Start checks again every CheckInterval, sooner after a failure or while
// the MutatingWebhookConfiguration is missing, until ctx ends.
func (m *Manager) Start(ctx context.Context) error {
	if m.optsErr != nil {
		return m.optsErr
	}
	logger := log.FromContext(ctx).WithName("webhook-certs")
	ctx = log.IntoContext(ctx, logger)
	retryInterval := min(m.opts.CheckInterval, maxRetryInterval)

	var delay time.Duration
	select {
	case <-m.ready:
		delay = m.opts.CheckInterval
	default: // EnsureOnce was not called, or failed
	}
	timer := time.NewTimer(delay)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		}
		found, err := m.ensure(ctx)
		delay = m.opts.CheckInterval
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			logger.Error(err, "Checking the webhook serving certificate failed, retrying", "after", retryInterval)
			delay = retryInterval
		case !found:
			delay = retryInterval
		}
		timer.Reset(delay)
	}
}

// NeedLeaderElection is false: every replica serves the webhook, so every
// replica needs the current certificate on its disk.
func (m *Manager) NeedLeaderElection() bool { return false }

// Ready is closed once a serving certificate is in CertDir.
func (m *Manager) Ready() <-chan struct{} { return m.ready }

// ReadyCheck is a healthz.Checker that fails until a serving certificate
// is in CertDir.
func (m *Manager) ReadyCheck(_ *http.Request) error {
	select {
	case <-m.ready:
		return nil
	default:
		return errors.New("the webhook serving certificate is not written yet")
	}
}

// ensure reports whether the MutatingWebhookConfiguration exists.
func (m *Manager) ensure(ctx context.Context) (bool, error) {
	if m.optsErr != nil {
		return false, m.optsErr
	}
	m.mu.Lock()
	defer m.mu.Unlock()

	ctx = log.IntoContext(ctx, log.FromContext(ctx).WithValues("secret", klog.KRef(m.opts.Namespace, m.opts.SecretName)))
	secret, err := m.ensureSecret(ctx)
	if err != nil {
		return false, err
	}
	if err := m.writeFiles(ctx, secret.Data); err != nil {
		return false, err
	}
	m.readyOnce.Do(func() { close(m.ready) })
	return m.ensureCABundle(ctx, secret.Data[caCertKey])
}

// ensureSecret returns the Secret after creating or renewing what it holds
// if needed. Replicas race through optimistic concurrency: the loser of a
// Create or an Update reads the winner's Secret and, finding it current,
// adopts it.
func (m *Manager) ensureSecret(ctx context.Context) (*corev1.Secret, error) {
	logger := log.FromContext(ctx)
	key := client.ObjectKey{Namespace: m.opts.Namespace, Name: m.opts.SecretName}
	for attempt := 1; ; attempt++ {
		var secret corev1.Secret
		err := m.reader.Get(ctx, key, &secret)
		exists := err == nil
		if err != nil && !apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("reading the webhook certificate Secret %s: %w", key, err)
		}
		data, reason, err := plan(secret.Data, &m.opts, time.Now())
		if err != nil {
			return nil, fmt.Errorf("issuing the webhook certificate for Secret %s: %w", key, err)
		}
		if data == nil {
			return &secret, nil
		}

		if !exists {
			secret = corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{
					Namespace: key.Namespace,
					Name:      key.Name,
					Labels: map[string]string{
						"app.kubernetes.io/name":       "idemcp",
						"app.kubernetes.io/component":  "webhook",
						"app.kubernetes.io/managed-by": "idemcp",
					},
				},
				Type: corev1.SecretTypeTLS,
				Data: data,
			}
			err = m.client.Create(ctx, &secret)
			switch {
			case err == nil:
				logger.Info("Created the webhook CA and serving certificate")
				return &secret, nil
			case apierrors.IsAlreadyExists(err) && attempt < maxAttempts:
				logger.V(1).Info("Another replica created the Secret first, reading it")
				continue
			}
			return nil, fmt.Errorf("creating the webhook certificate Secret %s: %w", key, err)
		}

		if secret.Data == nil {
			secret.Data = map[string][]byte{}
		}
		maps.Copy(secret.Data, data)
		err = m.client.Update(ctx, &secret)
		switch {
		case err == nil:
			logger.Info("Renewed the webhook certificate", "reason", reason)
			return &secret, nil
		case apierrors.IsConflict(err) && attempt < maxAttempts:
			logger.V(1).Info("Another replica changed the Secret first, reading it again")
			continue
		}
		return nil, fmt.Errorf("renewing the webhook certificate in Secret %s (%s): %w", key, reason, err)
	}
}

// writeFiles writes tls.key and tls.crt to CertDir where they differ.
func (m *Manager) writeFiles(ctx context.Context, data map[string][]byte) error {
	if err := os.MkdirAll(m.opts.CertDir, 0o700); err != nil {
		return fmt.Errorf("creating the webhook certificate directory: %w", err)
	}
	var changed bool
	// Between the two renames the webhook server's certwatcher fails to
	// load the mismatched pair and keeps serving the old one.
	for _, f := range []struct {
		name string
		perm os.FileMode
	}{{corev1.TLSPrivateKeyKey, 0o600}, {corev1.TLSCertKey, 0o644}} {
		wrote, err := writeFileIfChanged(filepath.Join(m.opts.CertDir, f.name), data[f.name], f.perm)
		if err != nil {
			return fmt.Errorf("writing the webhook serving certificate: %w", err)
		}
		changed = changed || wrote
	}
	if changed {
		log.FromContext(ctx).Info("Wrote the webhook serving certificate", "dir", m.opts.CertDir)
	}
	return nil
}

// writeFileIfChanged replaces path by renaming a complete temporary file
// over it, so a reader never sees half a file.
func writeFileIfChanged(path string, content []byte, perm os.FileMode) (bool, error) {
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, content) {
		return false, nil
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return false, err
	}
	defer os.Remove(tmp.Name()) // fails harmlessly once renamed
	if _, err := tmp.Write(content); err != nil {
		_ = tmp.Close()
		return false, err
	}
	if err := tmp.Chmod(perm); err != nil {
		_ = tmp.Close()
		return false, err
	}
	if err := tmp.Close(); err != nil {
		return false, err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return false, err
	}
	return true, nil
}

// ensureCABundle sets caBundle on every webhook of the
// MutatingWebhookConfiguration, and reports whether it exists.
func (m *Manager) ensureCABundle(ctx context.Context, caBundle []byte) (bool, error) {
	logger := log.FromContext(ctx).WithValues("mutatingWebhookConfiguration", klog.KRef("", m.opts.WebhookConfigName))
	var patched int
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var cfg admissionregistrationv1.MutatingWebhookConfiguration
		if err := m.reader.Get(ctx, client.ObjectKey{Name: m.opts.WebhookConfigName}, &cfg); err != nil {
			return err
		}
		before := cfg.DeepCopy()
		patched = 0
		for i := range cfg.Webhooks {
			if !bytes.Equal(cfg.Webhooks[i].ClientConfig.CABundle, caBundle) {
				cfg.Webhooks[i].ClientConfig.CABundle = caBundle
				patched++
			}
		}
		if patched == 0 {
			return nil
		}
		// A merge patch replaces the whole webhooks list: the resourceVersion
		// it carries makes it fail, and be retried, if anyone changed the
		// list in between.
		return m.client.Patch(ctx, &cfg, client.MergeFromWithOptions(before, client.MergeFromWithOptimisticLock{}))
	})
	switch {
	case apierrors.IsNotFound(err):
		if !m.webhookConfigMissing {
			logger.Info("MutatingWebhookConfiguration not found, will set its caBundle when it appears")
		}
		m.webhookConfigMissing = true
		return false, nil
	case err != nil:
		return true, fmt.Errorf("setting caBundle of MutatingWebhookConfiguration %s: %w", m.opts.WebhookConfigName, err)
	}
	m.webhookConfigMissing = false
	if patched > 0 {
		logger.Info("Set caBundle", "webhooks", patched)
	}
	return true, nil
}
