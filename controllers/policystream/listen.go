package policystream

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/certwatcher"
	"sigs.k8s.io/controller-runtime/pkg/log"
)

// Addr returns the address the server listens on, once it does.
func (s *Server) Addr(ctx context.Context) (net.Addr, error) {
	select {
	case a := <-s.addr:
		s.addr <- a
		return a, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (s *Server) listen(ctx context.Context) error {
	logger := log.FromContext(ctx).WithName("policy-stream")
	ctx = log.IntoContext(ctx, logger)
	if err := s.watch(ctx); err != nil {
		return err
	}
	// A replica restarted in the same pod is not the leader (yet), unless
	// it already won the lease: then the label it just set stays.
	s.labelMu.Lock()
	if !s.leading.Load() {
		if err := s.labelSelf(ctx, false); err != nil {
			logger.Error(err, "Removing the leader label from the manager's pod failed")
		}
	}
	s.labelMu.Unlock()
	watcher, err := certwatcher.New(s.opts.CertDir+"/tls.crt", s.opts.CertDir+"/tls.key")
	if err != nil {
		return fmt.Errorf("policy stream: loading the serving certificate from %s: %w", s.opts.CertDir, err)
	}
	s.ticketKey = ticketKeys(watcher.GetCertificate)
	go func() {
		if err := watcher.Start(ctx); err != nil {
			logger.Error(err, "Watching the policy stream's serving certificate failed")
		}
	}()
	ln, err := net.Listen("tcp", s.opts.Addr)
	if err != nil {
		return fmt.Errorf("policy stream: %w", err)
	}
	s.addr <- ln.Addr()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/namespaces/{namespace}/idempotencypolicies/{name}/stream", s.serveStream)
	if s.opts.Routes != nil {
		s.opts.Routes(mux)
	}
	tlsConfig := &tls.Config{GetCertificate: watcher.GetCertificate, MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: handshakeTimeout,
		TLSConfig:         tlsConfig,
		// MaxEncoderHeaderTableSize: the response headers go once a
		// connection, so indexing them (the review ticket) only kept a
		// table of them for as long as the stream. Sidecars' decoders
		// take unindexed fields as they are.
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 4, SendPingTimeout: 30 * time.Second, PingTimeout: 10 * time.Second,
			MaxEncoderHeaderTableSize: 1},
		BaseContext: func(net.Listener) context.Context { return ctx },
	}
	go s.refreshCA(ctx)
	errc := make(chan error, 1)
	// A clone: http.Server changes its TLSConfig as it starts serving.
	go func() { errc <- srv.Serve(newHandshakeListener(ln, tlsConfig.Clone(), handshakeTimeout, logger)) }()
	logger.Info("Serving the policy stream", "addr", ln.Addr().String())
	select {
	case err := <-errc:
		return fmt.Errorf("policy stream: %w", err)
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		_ = srv.Close()
	}
	return nil
}

// handshakeTimeout bounds a connection's TLS handshake and then its
// request's header.
const handshakeTimeout = 10 * time.Second

func (s *Server) refreshCA(ctx context.Context) {
	if s.opts.CABundle == nil {
		return
	}
	t := time.NewTicker(s.opts.CARefresh)
	defer t.Stop()
	for {
		if pem, err := s.opts.CABundle(ctx); err == nil && len(pem) > 0 && string(pem) != *s.ca.Load() {
			v := string(pem)
			s.ca.Store(&v)
			s.notifyAll()
		} else if err != nil && ctx.Err() == nil {
			log.FromContext(ctx).Error(err, "Reading the CA bundle for the policy stream failed")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// listener is the part of the server every replica runs: the port, so the
// Service's endpoints move with the leader label alone.
type listener struct{ s *Server }

func (l listener) NeedLeaderElection() bool { return false }

func (l listener) Start(ctx context.Context) error { return l.s.listen(ctx) }
