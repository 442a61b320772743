package certs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Defaults of Options. The names are the ones config/default gives the
// objects (its namePrefix is "idemcp-"), and the RBAC markers of this
// package restrict writes to them.
const (
	DefaultSecretName        = "idemcp-webhook-server-cert"
	DefaultServiceName       = "idemcp-webhook-service"
	DefaultWebhookConfigName = "idemcp-mutating-webhook-configuration"
	DefaultCAValidity        = 10 * 365 * 24 * time.Hour
	DefaultCertValidity      = 365 * 24 * time.Hour
	DefaultRotateBefore      = 30 * 24 * time.Hour
	DefaultCAOverlap         = 7 * 24 * time.Hour
	DefaultCheckInterval     = time.Hour
)

// inClusterNamespaceFile holds the namespace of the Pod the manager runs in.
const inClusterNamespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// Options say where the webhook's certificate lives and how long it lasts.
// Zero fields take the defaults.
type Options struct {
	// ExtraDNSNames are added to the serving certificate's names, for a
	// webhook configuration that calls a URL rather than the Service.
	ExtraDNSNames []string

	// Namespace of the Secret and of the webhook Service (default: the
	// namespace the manager runs in).
	Namespace string
	// SecretName is the kubernetes.io/tls Secret that holds the CA (ca.crt,
	// ca.key) and the serving certificate (tls.crt, tls.key): the one
	// source of truth shared by every replica.
	SecretName string
	// ServiceName is the Service the API server calls the webhook through;
	// the serving certificate names it.
	ServiceName string
	// WebhookConfigName is the MutatingWebhookConfiguration whose webhooks
	// get ca.crt as their caBundle.
	WebhookConfigName string
	// CertDir is where tls.crt and tls.key are written for the webhook
	// server (default: controller-runtime's webhook.Options.CertDir default).
	CertDir string
	// CAValidity is how long a new CA lasts.
	CAValidity time.Duration
	// CertValidity is how long a new serving certificate lasts (never past
	// its CA).
	CertValidity time.Duration
	// RotateBefore is how long before expiry a certificate is replaced;
	// it applies to the CA too.
	RotateBefore time.Duration
	// CAOverlap is how long the next CA is trusted (in ca.crt, the
	// caBundle, and the bundle pushed to sidecars) before it signs the
	// serving certificate: a running sidecar holding its stream in that
	// time receives it, and does not lose the manager when the switch
	// comes. The next CA is published RotateBefore the current one ends.
	CAOverlap time.Duration
	// CheckInterval is how often the Secret, the files and the caBundle
	// are checked again.
	CheckInterval time.Duration
}

// DefaultCertDir is where controller-runtime's webhook server looks for
// tls.crt and tls.key when it is given no CertDir.
func DefaultCertDir() string {
	return filepath.Join(os.TempDir(), "k8s-webhook-server", "serving-certs")
}

// complete fills in the defaults and rejects settings under which a
// certificate could expire before it is replaced.
func (o Options) complete() (Options, error) {
	if o.Namespace == "" {
		ns, err := os.ReadFile(inClusterNamespaceFile)
		if err != nil {
			return o, fmt.Errorf("webhook certificates: no Namespace given and not running in a cluster: %w", err)
		}
		o.Namespace = strings.TrimSpace(string(ns))
	}
	setDefault(&o.SecretName, DefaultSecretName)
	setDefault(&o.ServiceName, DefaultServiceName)
	setDefault(&o.WebhookConfigName, DefaultWebhookConfigName)
	setDefault(&o.CertDir, DefaultCertDir())
	setDefault(&o.CAValidity, DefaultCAValidity)
	setDefault(&o.CertValidity, DefaultCertValidity)
	setDefault(&o.RotateBefore, DefaultRotateBefore)
	setDefault(&o.CheckInterval, DefaultCheckInterval)
	setDefault(&o.CAOverlap, min(DefaultCAOverlap, o.RotateBefore/2))

	var errs []error
	if o.CertValidity <= o.RotateBefore {
		errs = append(errs, fmt.Errorf("CertValidity %s must be longer than RotateBefore %s, or every check would reissue the certificate", o.CertValidity, o.RotateBefore))
	}
	if o.CAValidity <= o.RotateBefore {
		errs = append(errs, fmt.Errorf("CAValidity %s must be longer than RotateBefore %s, or every check would replace the CA", o.CAValidity, o.RotateBefore))
	}
	if o.CheckInterval >= o.RotateBefore {
		errs = append(errs, fmt.Errorf("CheckInterval %s must be shorter than RotateBefore %s, or a certificate could expire between two checks", o.CheckInterval, o.RotateBefore))
	}
	if o.CAOverlap+o.CheckInterval >= o.RotateBefore {
		errs = append(errs, fmt.Errorf("CAOverlap %s plus CheckInterval %s must be shorter than RotateBefore %s, or the CA could expire before the next one signs the serving certificate", o.CAOverlap, o.CheckInterval, o.RotateBefore))
	}
	if err := errors.Join(errs...); err != nil {
		return o, fmt.Errorf("webhook certificate options: %w", err)
	}
	return o, nil
}

// dnsNames are the names the API server may use to reach the Service; the
// API server itself dials <svc>.<ns>.svc.
func (o *Options) dnsNames() []string {
	svc, ns := o.ServiceName, o.Namespace
	names := []string{svc, svc + "." + ns, svc + "." + ns + ".svc", svc + "." + ns + ".svc.cluster.local"}
	return append(names, o.ExtraDNSNames...)
}

func (o *Options) serverName() string {
	return o.ServiceName + "." + o.Namespace + ".svc"
}

func setDefault[T comparable](field *T, def T) {
	var zero T
	if *field == zero {
		*field = def
	}
}
