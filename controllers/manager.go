package controllers

import (
	"context"
	"flag"
	"fmt"
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

	"github.com/idemcp/idemcp/api/v1alpha1"
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
}

// Flags registers the options on fs.
func (o *ManagerOptions) Flags(fs *flag.FlagSet) {
	fs.StringVar(&o.MetricsAddr, "metrics-bind-address", ":8080", "address of /metrics (0 turns it off)")
	fs.StringVar(&o.ProbeAddr, "health-probe-bind-address", ":8081", "address of /healthz and /readyz")
	fs.BoolVar(&o.LeaderElect, "leader-elect", true, "elect a leader, so only one manager replica reconciles at a time")
	fs.StringVar(&o.LeaderElectionNS, "leader-election-namespace", "", "namespace of the leader election Lease (default: the manager's own)")
	fs.StringVar(&o.RedisImage, "redis-image", DefaultRedisImage, "image of a managed Redis whose policy names none")
	o.Zap.BindFlags(fs)
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
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return nil, err
	}
	if err := mgr.AddReadyzCheck("readyz", healthz.Ping); err != nil {
		return nil, err
	}
	return mgr, nil
}
