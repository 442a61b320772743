package sidecar

import (
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestUpstreamTLSOptionsNameTheFlag(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	https, _ := url.Parse("https://mcp.example.com")
	plain, _ := url.Parse("http://mcp.example.com")
	for _, tt := range []struct {
		name string
		o    UpstreamTLSOptions
		up   *url.URL
		want string
	}{
		{"a CA for plain HTTP", UpstreamTLSOptions{CAFile: notPEM}, plain, "apply to an https:// upstream"},
		{"no PEM in the CA file", UpstreamTLSOptions{CAFile: notPEM}, https, "--upstream-ca-file " + notPEM + ": no PEM certificate"},
		{"a missing CA file", UpstreamTLSOptions{CAFile: filepath.Join(dir, "absent")}, https, "--upstream-ca-file"},
		{"a certificate without its key", UpstreamTLSOptions{ClientCertFile: notPEM}, https, "--upstream-client-cert-file and --upstream-client-key-file go together"},
		{"a key pair that does not load", UpstreamTLSOptions{ClientCertFile: notPEM, ClientKeyFile: notPEM}, https, "--upstream-client-cert-file, --upstream-client-key-file"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.o.config(tt.up)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one with %q", err, tt.want)
			}
		})
	}
	c, err := UpstreamTLSOptions{ServerName: "mcp.internal"}.config(https)
	if err != nil || c.ServerName != "mcp.internal" || c.RootCAs != nil {
		t.Errorf("a server name alone: %+v, %v; want that name and the system's roots", c, err)
	}
	if c, err := (UpstreamTLSOptions{}).config(plain); c != nil || err != nil {
		t.Errorf("no options: %v, %v; want the transport's defaults", c, err)
	}
}
