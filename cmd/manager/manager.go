// Package manager wires `idemcp manager`: the IdempotencyPolicy controller,
// the Pod webhook and its certificates, in one controller-runtime manager.
package manager

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	ctrlwebhook "sigs.k8s.io/controller-runtime/pkg/webhook"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/controllers"
	"github.com/idemcp/idemcp/controllers/keyapi"
	"github.com/idemcp/idemcp/controllers/policystream"
	"github.com/idemcp/idemcp/internal/cli"
	"github.com/idemcp/idemcp/internal/tracing"
	"github.com/idemcp/idemcp/internal/version"
	"github.com/idemcp/idemcp/webhook"
	"github.com/idemcp/idemcp/webhook/certs"
)

// Authenticated metrics: a TokenReview and a SubjectAccessReview for
// each scrape.
// +kubebuilder:rbac:groups=authentication.k8s.io,resources=tokenreviews,verbs=create
// +kubebuilder:rbac:groups=authorization.k8s.io,resources=subjectaccessreviews,verbs=create

// Options are the flags of `idemcp manager`.
type Options struct {
	MetricsAddr      string
	ProbeAddr        string
	LeaderElect      bool
	LeaderElectionNS string
	RedisImage       string
	Zap              zap.Options
	// SecretRecheck overrides how soon a missing Secret is looked for again.
	SecretRecheck time.Duration
	// ProxyUpstreamCheck overrides how often an IdempotentProxy's upstream
	// is dialled (not a flag; tests shorten it).
	ProxyUpstreamCheck time.Duration

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
	// Kubeconfig is the cluster to manage; empty means in-cluster, or
	// $KUBECONFIG, or ~/.kube/config.
	Kubeconfig string

	// InsecureMetrics serves /metrics over plain HTTP without
	// authentication; only for a loopback MetricsAddr.
	InsecureMetrics bool
	// MetricsCertDir holds tls.crt and tls.key for /metrics (default: a
	// self-signed certificate).
	MetricsCertDir string
	// SecondManager lets a test run a second manager in one process.
	SecondManager bool
	// WebhookCertManagement is who keeps the webhook's serving certificate:
	// "self" (webhook/certs: a CA in a Secret, the caBundle patched, the
	// serving certificate rotated), "cert-manager" (config/certmanager), or
	// "" (the caller fills WebhookCertDir, as envtest does).
	WebhookCertManagement string

	// The policy stream (controllers/policystream), served with the
	// webhook's serving certificate.
	PolicyStreamAddr    string
	PolicyStreamService string
	// PolicyStreamCA returns the CA bundle sidecars verify the stream
	// with; nil picks it from the certificate management in use.
	PolicyStreamCA func(context.Context) ([]byte, error)
	// OnPolicyStream, when set, is given the stream server (tests).
	OnPolicyStream func(*policystream.Server)
	// PolicyStreamFlush batches status writes (default 200ms).
	PolicyStreamFlush time.Duration
	// PolicyStreamWriteTimeout bounds writing one snapshot (default 10s).
	PolicyStreamWriteTimeout time.Duration
	// PolicyStreamMaxStreams caps the streams held at once (default 10000).
	PolicyStreamMaxStreams int
	// PolicyStreamTokenReviews limits the TokenReviews a second (default
	// 100, burst twice that) of tokens not reviewed in the last 2 minutes.
	PolicyStreamTokenReviews float64
	// PolicyStreamCARefresh is how often the CA bundle is pushed again if
	// it changed (default 1m).
	PolicyStreamCARefresh time.Duration
	// SkipControllerNameValidation lets one process run several managers
	// (tests of leader failover).
	SkipControllerNameValidation bool
	// Leader election timings; zero takes controller-runtime's defaults.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// PprofAddr serves net/http/pprof ("" or "0": off); for profiling on a
	// loopback address, as the push benchmark does.
	PprofAddr string
	// Tracing traces reconciles and policy pushes, and turns tracing on in
	// every sidecar the webhook injects (docs/tracing.md).
	Tracing bool
}

// Flags registers the options on fs.
func (o *Options) Flags(fs *flag.FlagSet) {
	fs.StringVar(&o.Kubeconfig, "kubeconfig", "", "kubeconfig of the cluster to manage (default: in-cluster, then $KUBECONFIG, then ~/.kube/config)")
	fs.StringVar(&o.MetricsAddr, "metrics-bind-address", ":8443", "address of /metrics, served over HTTPS to callers allowed to get the /metrics URL (0 turns it off)")
	fs.BoolVar(&o.InsecureMetrics, "metrics-insecure", false, "serve /metrics over plain HTTP without authentication (only with a loopback --metrics-bind-address)")
	fs.StringVar(&o.MetricsCertDir, "metrics-cert-dir", "", "directory of the metrics server's tls.crt and tls.key (default: a self-signed certificate)")
	fs.StringVar(&o.ProbeAddr, "health-probe-bind-address", ":8081", "address of /healthz and /readyz")
	fs.BoolVar(&o.LeaderElect, "leader-elect", true, "elect a leader, so only one manager replica reconciles at a time")
	fs.StringVar(&o.LeaderElectionNS, "leader-election-namespace", "", "namespace of the leader election Lease (default: the manager's own)")
	fs.StringVar(&o.RedisImage, "redis-image", controllers.DefaultRedisImage, "image of a managed Redis whose policy names none")
	fs.IntVar(&o.WebhookPort, "webhook-port", 9443, "port of the Pod webhook")
	fs.StringVar(&o.WebhookCertDir, "webhook-cert-dir", "/tmp/idemcp-webhook-certs", "directory of the webhook's tls.crt and tls.key")
	fs.StringVar(&o.MissingPolicy, "webhook-missing-policy", string(webhook.MissingPolicyDeny), "an opted-in pod whose IdempotencyPolicy does not exist: deny (it never runs unprotected; its ReplicaSet retries) or admit (it runs without the sidecar)")
	o.Sidecar = webhook.DefaultConfig("")
	fs.StringVar(&o.Sidecar.Image, "sidecar-image", "", "image of the injected sidecar (default: the manager's own image, read from its pod)")
	fs.Func("sidecar-port", "the injected sidecar's proxy port (default 15480)", intFlag(&o.Sidecar.ProxyPort))
	fs.Func("sidecar-admin-port", "the injected sidecar's admin port (default 15481)", intFlag(&o.Sidecar.AdminPort))
	sidecarResourceFlags(fs, &o.Sidecar.Resources)
	fs.StringVar(&o.Namespace, "namespace", os.Getenv("POD_NAMESPACE"), "the manager's own namespace, never injected (default: $POD_NAMESPACE)")
	fs.StringVar(&o.WebhookCertManagement, "webhook-cert-management", "self", "who keeps the webhook's serving certificate: self (the manager keeps a CA in the Secret "+certs.DefaultSecretName+" and sets the caBundle) or cert-manager (config/certmanager)")
	fs.DurationVar(&o.LeaseDuration, "leader-elect-lease-duration", 0, "how long a follower waits before taking over an unrenewed lease (default 15s)")
	fs.DurationVar(&o.RenewDeadline, "leader-elect-renew-deadline", 0, "how long the leader tries to renew before it gives up leading (default 10s)")
	fs.DurationVar(&o.RetryPeriod, "leader-elect-retry-period", 0, "how often leader election is tried (default 2s)")
	fs.StringVar(&o.PolicyStreamAddr, "policy-stream-bind-address", fmt.Sprintf(":%d", policystream.DefaultPort), "address of the policy stream sidecars connect to (0 turns it off)")
	fs.StringVar(&o.PolicyStreamService, "policy-stream-service", policystream.DefaultServiceName, "the Service that selects the leader's pod for the policy stream; its name is in the serving certificate and in the endpoint given to sidecars")
	fs.StringVar(&o.Sidecar.PolicyEndpoint, "policy-stream-url", "", "the policy stream's URL given to injected sidecars (default: https://SERVICE.NAMESPACE.svc:PORT)")
	fs.IntVar(&o.PolicyStreamMaxStreams, "policy-stream-max-streams", 10000, "most policy streams (one per sidecar) held at once; a sidecar beyond it is answered 503 and retries")
	fs.Float64Var(&o.PolicyStreamTokenReviews, "policy-stream-token-reviews-per-second", 100, "most TokenReviews a second for sidecars connecting to the policy stream (a token reviewed in the last 2 minutes, or one with a valid review ticket, needs none); beyond it, 503 and a retry")
	fs.StringVar(&o.PprofAddr, "pprof-bind-address", "0", "address of net/http/pprof, unauthenticated: only ever a loopback address (0 turns it off)")
	fs.BoolVar(&o.Tracing, "tracing", false, "export OpenTelemetry spans of reconciles and policy pushes, and of every tools/call of the sidecars injected from now on, configured by the OTEL_* environment variables; the manager's OTEL_* variables (less OTEL_SERVICE_NAME) are given to injected sidecars either way")
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

// Validate checks the flags that need no cluster.
func (o *Options) Validate() error {
	if o.MissingPolicy != string(webhook.MissingPolicyDeny) && o.MissingPolicy != string(webhook.MissingPolicyAdmit) {
		return fmt.Errorf("--webhook-missing-policy: %q is not one of deny, admit", o.MissingPolicy)
	}
	switch o.WebhookCertManagement {
	case "self", "cert-manager", "":
	default:
		return fmt.Errorf("--webhook-cert-management: %q is not one of self, cert-manager", o.WebhookCertManagement)
	}
	return nil
}

func (o *Options) restConfig() (*rest.Config, error) {
	if o.Kubeconfig == "" {
		return ctrl.GetConfig()
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", o.Kubeconfig)
	if err != nil {
		return nil, err
	}
	// The rate ctrl.GetConfig gives the in-cluster config, not client-go's
	// 5 requests/s, which would throttle TokenReviews when sidecars connect.
	if cfg.QPS == 0 {
		cfg.QPS, cfg.Burst = 20, 30
	}
	return cfg, nil
}

// sidecarResourceFlags registers the defaults of the injected sidecar's
// requests and limits; pods override them with idemcp.io/proxy-*
// annotations.
func sidecarResourceFlags(fs *flag.FlagSet, r *corev1.ResourceRequirements) {
	for _, f := range []struct {
		name string
		list corev1.ResourceList
		res  corev1.ResourceName
	}{
		{"sidecar-cpu-request", r.Requests, corev1.ResourceCPU},
		{"sidecar-cpu-limit", r.Limits, corev1.ResourceCPU},
		{"sidecar-memory-request", r.Requests, corev1.ResourceMemory},
		{"sidecar-memory-limit", r.Limits, corev1.ResourceMemory},
	} {
		def := f.list[f.res]
		fs.Func(f.name, fmt.Sprintf("the injected sidecar's default %s (default %s; the pod annotation idemcp.io/proxy-%s overrides it)", strings.ReplaceAll(strings.TrimPrefix(f.name, "sidecar-"), "-", " "), def.String(), strings.TrimPrefix(f.name, "sidecar-")), func(v string) error {
			q, err := resource.ParseQuantity(v)
			if err != nil || q.Sign() <= 0 {
				return fmt.Errorf("%q is not a quantity more than 0", v)
			}
			f.list[f.res] = q
			return nil
		})
	}
}

// NewScheme returns the scheme of every kind the manager reads or writes.
func NewScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(s))
	utilruntime.Must(v1alpha1.AddToScheme(s))
	return s
}

const intro = `Usage: idemcp manager [flags]

Runs the IdempotencyPolicy controller, the webhook that injects the sidecar
and the policy stream, against the cluster of --kubeconfig (or in-cluster).`

// NewFlagSet returns the flags of `idemcp manager`, bound to o;
// --sidecar-image also reads IDEMCP_SIDECAR_IMAGE.
func NewFlagSet(o *Options) *cli.Set {
	s := cli.New("idemcp manager", intro)
	o.Flags(s.FlagSet)
	s.BindEnv("IDEMCP_", "sidecar-image")
	return s
}

// Main runs `idemcp manager ARGS` until ctx ends.
func Main(ctx context.Context, args []string) error {
	var o Options
	fs := NewFlagSet(&o)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q: idemcp manager takes only flags; run idemcp manager --help for them", fs.Arg(0))
	}
	// Bad flags are reported before anything connects to a cluster.
	if err := o.Validate(); err != nil {
		return fs.Attribute(err)
	}
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&o.Zap)))
	v := version.Get()
	setupLog := ctrl.Log.WithName("setup")
	setupLog.Info("Starting idemcp manager", "version", v.Version, "commit", v.Commit, "go", v.GoVersion)
	cli.SetMemoryLimit(slog.New(logr.ToSlogHandler(setupLog)))
	cfg, err := o.restConfig()
	if err != nil {
		return fmt.Errorf("finding the cluster (set --kubeconfig or $KUBECONFIG): %w", err)
	}
	if o.Tracing {
		tp, shutdown, err := tracing.NewProvider(ctx, "idemcp-manager")
		if err != nil {
			return fmt.Errorf("--tracing: %w", err)
		}
		otel.SetTracerProvider(tp)
		defer func() {
			flush, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = shutdown(flush)
		}()
	}
	mgr, err := New(cfg, o)
	if err != nil {
		return fs.Attribute(err)
	}
	return mgr.Start(ctx)
}

// New builds the manager with every controller registered.
func New(cfg *rest.Config, o Options) (ctrl.Manager, error) {
	scheme := NewScheme()
	if o.InsecureMetrics && !loopback(o.MetricsAddr) {
		return nil, fmt.Errorf("--metrics-insecure needs a loopback --metrics-bind-address such as 127.0.0.1:8080, not %q: anyone who reaches it reads the metrics", o.MetricsAddr)
	}
	if o.PprofAddr != "" && o.PprofAddr != "0" && !loopback(o.PprofAddr) {
		return nil, fmt.Errorf("--pprof-bind-address needs a loopback address such as 127.0.0.1:6060, not %q: pprof has no authentication", o.PprofAddr)
	}
	metrics := metricsserver.Options{BindAddress: o.MetricsAddr, TLSOpts: []func(*tls.Config){disableHTTP2}}
	if !o.InsecureMetrics {
		// Only callers allowed to get /metrics (a TokenReview and a
		// SubjectAccessReview per request) read it.
		metrics.SecureServing = true
		metrics.FilterProvider = filters.WithAuthenticationAndAuthorization
		metrics.CertDir = o.MetricsCertDir
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		WebhookServer: ctrlwebhook.NewServer(ctrlwebhook.Options{
			Host: o.WebhookHost, Port: o.WebhookPort, CertDir: o.WebhookCertDir,
			TLSOpts: []func(*tls.Config){disableHTTP2},
		}),
		Scheme:                  scheme,
		Metrics:                 metrics,
		HealthProbeBindAddress:  o.ProbeAddr,
		PprofBindAddress:        o.PprofAddr,
		LeaderElection:          o.LeaderElect,
		LeaderElectionID:        "idemcp-manager.idemcp.io",
		LeaderElectionNamespace: o.LeaderElectionNS,
		Cache:                   CacheOptions(),
		Controller:              config.Controller{SkipNameValidation: ptr.To(o.SecondManager || o.SkipControllerNameValidation)},
		// A replica that stops hands the lease on at once: sidecars find
		// the new leader within seconds, not a lease duration later.
		LeaderElectionReleaseOnCancel: true,
		LeaseDuration:                 nonZero(o.LeaseDuration),
		RenewDeadline:                 nonZero(o.RenewDeadline),
		RetryPeriod:                   nonZero(o.RetryPeriod),
		// Secret contents are read one at a time, never cached; the cache
		// holds only the metadata of Secrets opted in to idemcp.
		Client: client.Options{Cache: &client.CacheOptions{DisableFor: []client.Object{&corev1.Secret{}}}},
	})
	if err != nil {
		return nil, fmt.Errorf("creating the manager: %w", err)
	}
	streamOn := o.PolicyStreamAddr != "0" && o.PolicyStreamAddr != ""
	if err := (&controllers.IdempotencyPolicyReconciler{
		Client:        mgr.GetClient(),
		APIReader:     mgr.GetAPIReader(),
		Scheme:        scheme,
		Recorder:      mgr.GetEventRecorder("idemcp"),
		RedisImage:    o.RedisImage,
		SecretRecheck: o.SecretRecheck,
		// Without the stream nobody hears the sidecars: the status says so
		// instead of claiming they are synced.
		SidecarsUnobserved: !streamOn,
	}).SetupWithManager(mgr); err != nil {
		return nil, fmt.Errorf("setting up the IdempotencyPolicy controller: %w", err)
	}
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if o.Sidecar.Image == "" {
		image, err := ownImage(cfg, scheme, o.Namespace)
		if err != nil {
			return nil, fmt.Errorf("finding the image to inject (set --sidecar-image): %w", err)
		}
		o.Sidecar.Image = image
	}
	policyCA := o.PolicyStreamCA
	if streamOn {
		port := policystream.DefaultPort
		if _, p, err := net.SplitHostPort(o.PolicyStreamAddr); err == nil {
			if n, err := strconv.Atoi(p); err == nil && n > 0 {
				port = n
			}
		}
		if o.Sidecar.PolicyEndpoint == "" && o.Namespace != "" {
			o.Sidecar.PolicyEndpoint = policystream.URL(o.PolicyStreamService, o.Namespace, port)
		}
		if policyCA == nil {
			switch o.WebhookCertManagement {
			case "self":
				policyCA = policystream.CABundleFromSecret(mgr.GetAPIReader(), o.Namespace, certs.DefaultSecretName, 30*time.Second)
			default:
				policyCA = policystream.CABundleFromFile(filepath.Join(o.WebhookCertDir, "ca.crt"), 30*time.Second)
			}
		}
	}
	o.Sidecar.Tracing = o.Tracing
	o.Sidecar.OTelEnv = webhook.OTelEnv(os.Environ())
	injector := &webhook.Injector{
		PolicyCA:         policyCA,
		Client:           mgr.GetClient(),
		APIReader:        mgr.GetAPIReader(),
		Config:           o.Sidecar,
		ManagerNamespace: o.Namespace,
		MissingPolicy:    webhook.MissingPolicy(o.MissingPolicy),
		Recorder:         mgr.GetEventRecorder("idemcp-webhook"),
	}
	mgr.GetWebhookServer().Register(webhook.Path, injector.Handler(scheme))
	switch o.WebhookCertManagement {
	case "self":
		certOpts := certs.Options{Namespace: o.Namespace, CertDir: o.WebhookCertDir}
		if streamOn && o.Namespace != "" {
			certOpts.ExtraDNSNames = policystream.DNSNames(o.PolicyStreamService, o.Namespace)
		}
		certManager := certs.New(mgr.GetClient(), mgr.GetAPIReader(), certOpts)
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
	}
	var streams controllers.SyncedPods
	if streamOn {
		// kubectl idemcp keys: served on the stream's listener, which the
		// sidecars of a Memory store answer it through.
		keys := &keyapi.Server{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Recorder: mgr.GetEventRecorder("idemcp-keys")}
		stream := policystream.New(mgr, policystream.Options{Addr: o.PolicyStreamAddr, CertDir: o.WebhookCertDir, CABundle: policyCA, FlushInterval: o.PolicyStreamFlush,
			WriteTimeout: o.PolicyStreamWriteTimeout, MaxStreams: o.PolicyStreamMaxStreams,
			TokenReviewQPS: o.PolicyStreamTokenReviews, CARefresh: o.PolicyStreamCARefresh,
			PodName: os.Getenv("POD_NAME"), PodNamespace: o.Namespace, Routes: keys.Routes,
			Recorder: mgr.GetEventRecorder("idemcp-policy-stream")})
		keys.Stream = stream
		if err := stream.Add(mgr); err != nil {
			return nil, fmt.Errorf("adding the policy stream: %w", err)
		}
		if o.OnPolicyStream != nil {
			o.OnPolicyStream(stream)
		}
		streams = stream
	}
	// IdempotentProxies run the container the webhook injects, so they
	// get its configuration.
	if err := (&controllers.IdempotentProxyReconciler{
		Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Scheme: scheme,
		Config: o.Sidecar, PolicyCA: policyCA, Streams: streams, UpstreamCheck: o.ProxyUpstreamCheck,
	}).SetupWithManager(mgr); err != nil {
		return nil, fmt.Errorf("setting up the IdempotentProxy controller: %w", err)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return nil, err
	}
	if err := mgr.AddReadyzCheck("readyz", mgr.GetWebhookServer().StartedChecker()); err != nil {
		return nil, err
	}
	// The webhook reads policies from the cache: a replica is ready (and
	// gets webhook traffic) only once the policy informer has synced, so
	// its first answers never say "no such policy" for one that exists.
	policies, err := mgr.GetCache().GetInformer(context.Background(), &v1alpha1.IdempotencyPolicy{}, cache.BlockUntilSynced(false))
	if err != nil {
		return nil, fmt.Errorf("starting the policy informer: %w", err)
	}
	if err := mgr.AddReadyzCheck("policies-synced", func(*http.Request) error {
		if !policies.HasSynced() {
			return errors.New("the IdempotencyPolicy cache has not synced yet")
		}
		return nil
	}); err != nil {
		return nil, err
	}
	return mgr, nil
}

// disableHTTP2 serves HTTP/1.1 only: HTTP/2's stream handling has had
// denial-of-service flaws (CVE-2023-44487, CVE-2023-39325) that a webhook
// or metrics endpoint need not risk.
func disableHTTP2(c *tls.Config) { c.NextProtos = []string{"http/1.1"} }

// CacheOptions scope what the manager caches to what it needs: pods that
// use a policy, the objects it creates, and the metadata of Secrets opted
// in to idemcp; managed fields are dropped from everything.
func CacheOptions() cache.Options {
	managed := labels.SelectorFromSet(labels.Set{"app.kubernetes.io/managed-by": "idemcp"})
	usesPolicy, err := labels.Parse(v1alpha1.LabelPolicy)
	utilruntime.Must(err)
	return cache.Options{
		DefaultTransform: cache.TransformStripManagedFields(),
		ByObject: map[client.Object]cache.ByObject{
			&corev1.Pod{}:                   {Label: usesPolicy},
			&appsv1.StatefulSet{}:           {Label: managed},
			&appsv1.Deployment{}:            {Label: managed},
			&corev1.Service{}:               {Label: managed},
			&policyv1.PodDisruptionBudget{}: {Label: managed},
			&networkingv1.NetworkPolicy{}:   {Label: managed},
			&corev1.Secret{}: {
				Label:     labels.SelectorFromSet(labels.Set{v1alpha1.LabelCredentials: "true"}),
				Transform: stripSecretMetadata,
			},
		},
	}
}

// stripSecretMetadata keeps what the Secret watch needs: no managed
// fields, no annotations (kubectl's last-applied-configuration holds the
// data itself).
func stripSecretMetadata(in any) (any, error) {
	if obj, err := meta.Accessor(in); err == nil {
		obj.SetManagedFields(nil)
		obj.SetAnnotations(nil)
	}
	return in, nil
}

func loopback(addr string) bool {
	if addr == "0" {
		return true
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return host == "localhost" || (ip != nil && ip.IsLoopback())
}

func nonZero(d time.Duration) *time.Duration {
	if d == 0 {
		return nil
	}
	return &d
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
