package manager

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSidecarResourceFlags(t *testing.T) {
	parse := func(args ...string) (Options, error) {
		fs := flag.NewFlagSet("idemcp manager", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		var o Options
		o.Flags(fs)
		return o, fs.Parse(args)
	}
	o, err := parse()
	if err != nil {
		t.Fatal(err)
	}
	r := o.Sidecar.Resources
	if got := r.Requests.Cpu().String() + " " + r.Limits.Cpu().String() + " " + r.Requests.Memory().String() + " " + r.Limits.Memory().String(); got != "50m 500m 64Mi 128Mi" {
		t.Errorf("defaults %s, want 50m 500m 64Mi 128Mi", got)
	}
	o, err = parse("--sidecar-cpu-request=100m", "--sidecar-cpu-limit=2", "--sidecar-memory-request=128Mi", "--sidecar-memory-limit=1Gi")
	if err != nil {
		t.Fatal(err)
	}
	r = o.Sidecar.Resources
	if got := r.Requests.Cpu().String() + " " + r.Limits.Cpu().String() + " " + r.Requests.Memory().String() + " " + r.Limits.Memory().String(); got != "100m 2 128Mi 1Gi" {
		t.Errorf("flags gave %s, want 100m 2 128Mi 1Gi", got)
	}
	for _, bad := range []string{"--sidecar-cpu-limit=lots", "--sidecar-memory-limit=0", "--sidecar-memory-request=-1Mi"} {
		if _, err := parse(bad); err == nil || !strings.Contains(err.Error(), "is not a quantity more than 0") {
			t.Errorf("%s: %v, want a refusal", bad, err)
		}
	}
}

// TestKubeconfigClientRate: with --kubeconfig the manager's client gets
// the rate it has in a pod (20/s, burst 30), so TokenReviews of
// connecting sidecars are not throttled at client-go's 5/s.
func TestKubeconfigClientRate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kubeconfig")
	kc := "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: https://127.0.0.1:6443}\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\nusers:\n- name: u\n  user: {token: t}\n"
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := (&Options{Kubeconfig: path}).restConfig()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.QPS != 20 || cfg.Burst != 30 {
		t.Errorf("QPS %v burst %d, want 20 and 30", cfg.QPS, cfg.Burst)
	}
}
