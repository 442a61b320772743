package controllers

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	ctrlwebhook "sigs.k8s.io/controller-runtime/pkg/webhook"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/webhook"
	"github.com/idemcp/idemcp/webhook/certs"
)

// ManagerOptions are the flags of `idemcp manager`.
type ManagerOptions struct {
	MetricsAddr      string
	ProbeAddr        string
	LeaderElect      bool
	LeaderElectionNS string
	RedisImage       string
	Zap              zap.Options
	// SecretRecheck overrides how soon a missing Secret is looked for again.
	SecretRecheck time.Duration

	// The webhook.
	WebhookHost    string
	WebhookPort    int
	WebhookCertDir string
	// MissingPolicy is what happens to an opted-in pod whose policy does
	// not exist: deny (default) or admit.
	MissingPolicy string
	// Sidecar is what the webhook injects; an empty Image is resolved to
	// the manager's own image at startup.
	Sidecar webhook.Config
	// Namespace is the manager's own namespace: never injected.
	Namespace string
	// WebhookCertManagement is who keeps the webhook's serving certificate:
	// "self" (webhook/certs: a CA in a Secret, the caBundle patched, the
	// serving certificate rotated), "cert-manager" (config/certmanager), or
	// "" (the caller fills WebhookCertDir, as envtest does).
	WebhookCertManagement string
}

// Flags registers the options on fs.
func (o *ManagerOptions) Flags(fs *flag.FlagSet) {
	fs.StringVar(&o.MetricsAddr, "metrics-bind-address", ":8080", "address of /metrics (0 turns it off)")
	fs.StringVar(&o.ProbeAddr, "health-probe-bind-address", ":8081", "address of /healthz and /readyz")
	fs.BoolVar(&o.LeaderElect, "leader-elect", true, "elect a leader, so only one manager replica reconciles at a time")
	fs.StringVar(&o.LeaderElectionNS, "leader-election-namespace", "", "namespace of the leader election Lease (default: the manager's own)")
	fs.StringVar(&o.RedisImage, "redis-image", DefaultRedisImage, "image of a managed Redis whose policy names none")
	fs.IntVar(&o.WebhookPort, "webhook-port", 9443, "port of the Pod webhook")
	fs.StringVar(&o.WebhookCertDir, "webhook-cert-dir", "/tmp/idemcp-webhook-certs", "directory of the webhook's tls.crt and tls.key")
	fs.StringVar(&o.MissingPolicy, "webhook-missing-policy", string(webhook.MissingPolicyDeny), "an opted-in pod whose IdempotencyPolicy does not exist: deny (it never runs unprotected; its ReplicaSet retries) or admit (it runs without the sidecar)")
	o.Sidecar = webhook.DefaultConfig("")
	fs.StringVar(&o.Sidecar.Image, "sidecar-image", os.Getenv("IDEMCP_SIDECAR_IMAGE"), "image of the injected sidecar (default: the manager's own image, read from its pod)")
	fs.Func("sidecar-port", "the injected sidecar's proxy port (default 15480)", intFlag(&o.Sidecar.ProxyPort))
	fs.Func("sidecar-admin-port", "the injected sidecar's admin port (default 15481)", intFlag(&o.Sidecar.AdminPort))
	fs.StringVar(&o.Namespace, "namespace", os.Getenv("POD_NAMESPACE"), "the manager's own namespace, never injected (default: $POD_NAMESPACE)")
	fs.StringVar(&o.WebhookCertManagement, "webhook-cert-management", "self", "who keeps the webhook's serving certificate: self (the manager keeps a CA in the Secret "+certs.DefaultSecretName+" and sets the caBundle) or cert-manager (config/certmanager)")
	o.Zap.BindFlags(fs)
}

func intFlag(dst *int32) func(string) error {
	return func(v string) error {
		n, err := strconv.ParseInt(v, 10, 32)
		if err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("%q is not a port from 1 to 65535", v)
		}
		*dst = int32(n)
		return nil
	}
}

// NewScheme returns the scheme of every kind the manager reads or writes.
func NewScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(s))
	utilruntime.Must(v1alpha1.AddToScheme(s))
	return s
}

// ManagerMain runs `idemcp manager ARGS` until ctx ends.
func ManagerMain(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("idemcp manager", flag.ContinueOnError)
	var o ManagerOptions
	o.Flags(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&o.Zap)))
	cfg, err := ctrl.GetConfig()
	if err != nil {
		return fmt.Errorf("finding the cluster: %w", err)
	}
	mgr, err := NewManager(cfg, o)
	if err != nil {
		return err
	}
	return mgr.Start(ctx)
}

// NewManager builds the manager with every controller registered.
func NewManager(cfg *rest.Config, o ManagerOptions) (ctrl.Manager, error) {
	scheme := NewScheme()
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		WebhookServer:           ctrlwebhook.NewServer(ctrlwebhook.Options{Host: o.WebhookHost, Port: o.WebhookPort, CertDir: o.WebhookCertDir}),
		Scheme:                  scheme,
		Metrics:                 metricsserver.Options{BindAddress: o.MetricsAddr},
		HealthProbeBindAddress:  o.ProbeAddr,
		LeaderElection:          o.LeaderElect,
		LeaderElectionID:        "idemcp-manager.idemcp.io",
		LeaderElectionNamespace: o.LeaderElectionNS,
		// Secrets are read one at a time, never cached: the manager may
		// only get and create them, not list or watch every Secret.
		Client: client.Options{Cache: &client.CacheOptions{DisableFor: []client.Object{&corev1.Secret{}}}},
	})
	if err != nil {
		return nil, fmt.Errorf("creating the manager: %w", err)
	}
	if err := (&IdempotencyPolicyReconciler{
		Client:        mgr.GetClient(),
		APIReader:     mgr.GetAPIReader(),
		Scheme:        scheme,
		Recorder:      mgr.GetEventRecorder("idemcp"),
		RedisImage:    o.RedisImage,
		SecretRecheck: o.SecretRecheck,
	}).SetupWithManager(mgr); err != nil {
		return nil, fmt.Errorf("setting up the IdempotencyPolicy controller: %w", err)
	}
	if o.MissingPolicy != string(webhook.MissingPolicyDeny) && o.MissingPolicy != string(webhook.MissingPolicyAdmit) {
		return nil, fmt.Errorf("--webhook-missing-policy: %q is not one of deny, admit", o.MissingPolicy)
	}
	if o.Sidecar.Image == "" {
		image, err := ownImage(cfg, scheme, o.Namespace)
		if err != nil {
			return nil, fmt.Errorf("finding the image to inject (set --sidecar-image): %w", err)
		}
		o.Sidecar.Image = image
	}
	injector := &webhook.Injector{
		Client:           mgr.GetClient(),
		Config:           o.Sidecar,
		ManagerNamespace: o.Namespace,
		MissingPolicy:    webhook.MissingPolicy(o.MissingPolicy),
		Recorder:         mgr.GetEventRecorder("idemcp-webhook"),
	}
	mgr.GetWebhookServer().Register(webhook.Path, injector.Handler(scheme))
	switch o.WebhookCertManagement {
	case "self":
		certManager := certs.New(mgr.GetClient(), mgr.GetAPIReader(), certs.Options{Namespace: o.Namespace, CertDir: o.WebhookCertDir})
		// Now, not only as a runnable: the webhook server loads CertDir when
		// it starts, before the manager starts its other runnables.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := certManager.EnsureOnce(ctx); err != nil {
			return nil, fmt.Errorf("issuing the webhook serving certificate: %w", err)
		}
		if err := mgr.Add(certManager); err != nil {
			return nil, fmt.Errorf("adding the webhook certificate manager: %w", err)
		}
	case "cert-manager", "":
	default:
		return nil, fmt.Errorf("--webhook-cert-management: %q is not one of self, cert-manager", o.WebhookCertManagement)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return nil, err
	}
	if err := mgr.AddReadyzCheck("readyz", mgr.GetWebhookServer().StartedChecker()); err != nil {
		return nil, err
	}
	return mgr, nil
}

// ownImage reads the manager's own image from its pod, so the sidecar it
// injects is always the same version.
func ownImage(cfg *rest.Config, scheme *runtime.Scheme, namespace string) (string, error) {
	name := os.Getenv("POD_NAME")
	if name == "" || namespace == "" {
		return "", errors.New("POD_NAME and POD_NAMESPACE are not set")
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return "", err
	}
	var pod corev1.Pod
	if err := c.Get(context.Background(), client.ObjectKey{Namespace: namespace, Name: name}, &pod); err != nil {
		return "", fmt.Errorf("reading pod %s/%s: %w", namespace, name, err)
	}
	for _, c := range pod.Spec.Containers {
		if c.Name == "manager" {
			return c.Image, nil
		}
	}
	return "", fmt.Errorf("pod %s/%s has no container named manager", namespace, name)
}
