package sidecar

import (
	"context"
	"errors"
	"flag"
	"os"

	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/internal/store"
	"github.com/idemcp/idemcp/internal/storeopen"
	"github.com/idemcp/idemcp/sidecar/policysync"
)

// PushOptions reach the manager's policy stream; the webhook sets them.
type PushOptions struct {
	// Endpoint is the stream's https:// URL; empty: the sidecar enforces
	// its snapshot and never asks for another.
	Endpoint string
	// CABundle is the PEM the manager's certificate verifies against.
	CABundle string
	// TokenFile is the projected service account token, audience idemcp.
	TokenFile string
}

// Flags registers the push flags on fs.
func (o *PushOptions) Flags(fs *flag.FlagSet) {
	fs.StringVar(&o.Endpoint, "policy-endpoint", "", "https:// URL of the manager's policy stream (empty: keep the starting policy)")
	fs.StringVar(&o.CABundle, "policy-ca", "", "PEM of the CAs the policy stream's certificate verifies against (default: the system roots)")
	fs.StringVar(&o.TokenFile, "policy-token-file", "/var/run/secrets/idemcp/token", "the projected service account token (audience idemcp) the policy stream authenticates")
}

// startPush runs the policy sync beside the proxy until ctx ends.
func (s *Sidecar) startPush(ctx context.Context) error {
	o := s.opts.Push
	if o.Endpoint == "" {
		return nil
	}
	pol := s.engine.Policy()
	ns, name := pol.Namespace, pol.Name
	if ns == "" {
		ns = os.Getenv("POD_NAMESPACE")
	}
	if name == "" {
		return errors.New("--policy-endpoint needs a policy with a name (the webhook's IDEMCP_POLICY snapshot)")
	}
	var keys store.Inspector
	if s.storeInfo.Kind == "Memory" {
		// Only this sidecar holds its records: the manager asks it.
		keys, _ = store.InspectorOf(s.store)
	}
	c, err := policysync.New(policysync.Options{
		Keys:          keys,
		Endpoint:      o.Endpoint,
		Namespace:     ns,
		Name:          name,
		Token:         policysync.TokenFile(o.TokenFile),
		CABundle:      []byte(o.CABundle),
		Engine:        s.engine,
		StoreIdentity: policywire.StoreIdentity(pol.Spec.Store),
		OnApply:       s.applyStorePolicy,
		Logger:        s.log,
	})
	if err != nil {
		return err
	}
	s.push.Store(c)
	go func() { _ = c.Run(ctx) }()
	return nil
}

// applyStorePolicy gives the store what of a pushed policy applies live:
// Redis's minReplicas and its timeout.
func (s *Sidecar) applyStorePolicy(p *policy.Policy) {
	changed, n, err := storeopen.ApplyReplicas(s.store, s.opts.Store, p)
	switch {
	case err != nil:
		s.log.Error("The policy's store.redis.external.minReplicas could not be applied; the store keeps its setting", "err", err)
	case changed:
		s.log.Info("Applied the policy's minReplicas: every claim and stored result now waits for this many Redis replicas", "minReplicas", n)
	}
}

// The acknowledgement carries the count of unscoped calls.
var _ policysync.UnscopedCounter = (*engine.Engine)(nil)
