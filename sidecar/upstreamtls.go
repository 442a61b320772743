package sidecar

// How the proxy reaches a remote upstream: its TLS client and the Host it
// sends. An injected sidecar reaches its MCP server over loopback or the
// pod's IP with the client's Host; an IdempotentProxy in front of a remote
// server sends the server's own host, over TLS with the CAs, server name
// and client certificate it is given.

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"

	"github.com/idemcp/idemcp/internal/cli"
)

// Host header modes of --upstream-host-header.
const (
	HostHeaderClient   = "client"
	HostHeaderUpstream = "upstream"
)

// UpstreamTLSOptions configure the TLS client to an https:// upstream.
type UpstreamTLSOptions struct {
	// CAFile holds the PEM of the CAs the upstream's certificate must
	// chain to ("": the system's roots).
	CAFile string
	// ServerName is sent in SNI and checked in the certificate ("": the
	// upstream URL's host).
	ServerName string
	// ClientCertFile and ClientKeyFile are the certificate the proxy
	// presents, read at every handshake so that a renewed Secret is used
	// without a restart.
	ClientCertFile string
	ClientKeyFile  string
}

func (o *UpstreamTLSOptions) flags(fs *flag.FlagSet) {
	fs.StringVar(&o.CAFile, "upstream-ca-file", "", "PEM file of the CAs an https:// upstream's certificate must chain to (default: the system's roots)")
	fs.StringVar(&o.ServerName, "upstream-server-name", "", "name sent in SNI and checked in an https:// upstream's certificate (default: --upstream's host)")
	fs.StringVar(&o.ClientCertFile, "upstream-client-cert-file", "", "PEM certificate the proxy presents to an https:// upstream (with --upstream-client-key-file)")
	fs.StringVar(&o.ClientKeyFile, "upstream-client-key-file", "", "PEM private key of --upstream-client-cert-file")
}

// upstreamFlags registers the remote upstream's flags on fs.
func (o *Options) upstreamFlags(fs *flag.FlagSet) {
	fs.Var(cli.Choice(&o.UpstreamHostHeader, HostHeaderClient, HostHeaderClient, HostHeaderUpstream), "upstream-host-header",
		"Host sent upstream: client (the client's, for a server in the pod) or upstream (--upstream's host, for a remote server)")
	o.UpstreamTLS.flags(fs)
}

// set reports whether any TLS option is given.
func (o UpstreamTLSOptions) set() bool {
	return o.CAFile != "" || o.ServerName != "" || o.ClientCertFile != "" || o.ClientKeyFile != ""
}

// config returns the TLS client configuration for upstream, or nil for
// the transport's default.
func (o UpstreamTLSOptions) config(upstream *url.URL) (*tls.Config, error) {
	if !o.set() {
		return nil, nil
	}
	if upstream.Scheme != "https" {
		return nil, fmt.Errorf("--upstream-ca-file, --upstream-server-name and --upstream-client-*-file apply to an https:// upstream, and --upstream is %s://", upstream.Scheme)
	}
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: o.ServerName}
	if o.CAFile != "" {
		b, err := os.ReadFile(o.CAFile)
		if err != nil {
			return nil, fmt.Errorf("--upstream-ca-file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(b) {
			return nil, fmt.Errorf("--upstream-ca-file %s: no PEM certificate in it", o.CAFile)
		}
		c.RootCAs = pool
	}
	switch {
	case (o.ClientCertFile == "") != (o.ClientKeyFile == ""):
		return nil, errors.New("--upstream-client-cert-file and --upstream-client-key-file go together: give both, or neither")
	case o.ClientCertFile != "":
		if _, err := tls.LoadX509KeyPair(o.ClientCertFile, o.ClientKeyFile); err != nil {
			return nil, fmt.Errorf("--upstream-client-cert-file, --upstream-client-key-file: %w", err)
		}
		cert, key := o.ClientCertFile, o.ClientKeyFile
		c.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			kp, err := tls.LoadX509KeyPair(cert, key)
			if err != nil {
				return nil, fmt.Errorf("reading the upstream client certificate: %w", err)
			}
			return &kp, nil
		}
	}
	return c, nil
}
