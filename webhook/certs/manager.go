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
	"io/fs"
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
	// The caBundle first, the files second: the API server must trust a
	// new CA before any replica serves a certificate it signed. ca.crt
	// still holds the replaced CA, so the certificate served until the
	// files change stays trusted meanwhile. If the caBundle cannot be set,
	// the files stay as they are, unless there are none yet.
	found, err := m.ensureCABundle(ctx, secret.Data[caCertKey])
	if err != nil {
		if _, statErr := os.Stat(filepath.Join(m.opts.CertDir, corev1.TLSCertKey)); statErr == nil {
			return found, err
		}
	}
	if err := m.writeFiles(ctx, secret.Data); err != nil {
		return false, err
	}
	m.readyOnce.Do(func() { close(m.ready) })
	return found, err
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
		// A next CA that was promoted or replaced leaves the Secret.
		for _, k := range []string{nextCACertKey, nextCAKeyKey} {
			if _, ok := data[k]; !ok {
				delete(secret.Data, k)
			}
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

// writeFiles makes tls.crt and tls.key in CertDir hold the pair in data.
func (m *Manager) writeFiles(ctx context.Context, data map[string][]byte) error {
	wrote, err := writePair(m.opts.CertDir, data[corev1.TLSCertKey], data[corev1.TLSPrivateKeyKey])
	if err != nil {
		return fmt.Errorf("writing the webhook serving certificate to %s: %w", m.opts.CertDir, err)
	}
	if wrote {
		log.FromContext(ctx).Info("Wrote the webhook serving certificate", "dir", m.opts.CertDir)
	}
	return nil
}

// dataLink is the symlink through which tls.crt and tls.key point at the
// directory holding the current pair, as in a kubelet Secret volume.
const dataLink = "..data"

// writePair replaces tls.crt and tls.key in dir together, unless they
// already hold certPEM and keyPEM. Two files renamed one after the other
// would leave the webhook server's certwatcher, which reloads on every
// change, a moment with a certificate and a key that do not match; so the
// pair is written to a new directory and one rename of the ..data symlink
// switches both (tls.crt -> ..data/tls.crt), the way the kubelet updates a
// Secret volume and certwatcher expects.
func writePair(dir string, certPEM, keyPEM []byte) (bool, error) {
	if sameContent(filepath.Join(dir, corev1.TLSCertKey), certPEM) && sameContent(filepath.Join(dir, corev1.TLSPrivateKeyKey), keyPEM) {
		return false, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return false, err
	}
	next, err := os.MkdirTemp(dir, "..certs-")
	if err != nil {
		return false, err
	}
	if err := os.WriteFile(filepath.Join(next, corev1.TLSCertKey), certPEM, 0o644); err != nil {
		return false, errors.Join(err, os.RemoveAll(next))
	}
	if err := os.WriteFile(filepath.Join(next, corev1.TLSPrivateKeyKey), keyPEM, 0o600); err != nil {
		return false, errors.Join(err, os.RemoveAll(next))
	}
	if err := replaceSymlink(filepath.Join(dir, dataLink), filepath.Base(next)); err != nil {
		return false, errors.Join(err, os.RemoveAll(next))
	}
	for _, name := range []string{corev1.TLSCertKey, corev1.TLSPrivateKeyKey} {
		link, target := filepath.Join(dir, name), filepath.Join(dataLink, name)
		if current, err := os.Readlink(link); err == nil && current == target {
			continue
		}
		// Once per directory: turns a plain file, or nothing, into the link.
		if err := replaceSymlink(link, target); err != nil {
			return false, err
		}
	}
	// The pair just replaced, and any left by a crash between MkdirTemp
	// and the switch; removing the old files is what certwatcher notices.
	old, err := filepath.Glob(filepath.Join(dir, "..certs-*"))
	if err != nil {
		return false, err
	}
	for _, d := range old {
		if d != next {
			if err := os.RemoveAll(d); err != nil {
				return false, err
			}
		}
	}
	return true, nil
}

// replaceSymlink points link at target in one rename.
func replaceSymlink(link, target string) error {
	tmp := link + ".tmp"
	if err := os.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := os.Symlink(target, tmp); err != nil {
		return err
	}
	return os.Rename(tmp, link)
}

func sameContent(path string, content []byte) bool {
	old, err := os.ReadFile(path)
	return err == nil && bytes.Equal(old, content)
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
