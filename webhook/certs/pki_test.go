package certs

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

func testOptions(t *testing.T) *Options {
	t.Helper()
	o, err := Options{
		Namespace:     "ns",
		ServiceName:   "svc",
		CertDir:       t.TempDir(),
		CAValidity:    100 * time.Hour,
		CertValidity:  10 * time.Hour,
		RotateBefore:  2 * time.Hour,
		CheckInterval: time.Minute,
	}.complete()
	if err != nil {
		t.Fatal(err)
	}
	return &o
}

// mustPlan is plan that must change something.
func mustPlan(t *testing.T, current map[string][]byte, o *Options, now time.Time) map[string][]byte {
	t.Helper()
	data, reason, err := plan(current, o, now)
	if err != nil {
		t.Fatal(err)
	}
	if data == nil || reason == "" {
		t.Fatalf("plan changed nothing (reason %q)", reason)
	}
	return data
}

func TestPlan(t *testing.T) {
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	o := testOptions(t)
	fresh := mustPlan(t, nil, o, t0)
	otherCA := mustPlan(t, nil, o, t0)
	// CAValidity 100h, RotateBefore 2h, CAOverlap 1h (half of it).
	renewed := mustPlan(t, fresh, o, t0.Add(97*time.Hour)) // its serving certificate ends with the CA
	published := mustPlan(t, renewed, o, t0.Add(98*time.Hour+30*time.Minute))
	rotatedCA := mustPlan(t, published, o, t0.Add(99*time.Hour+30*time.Minute))

	with := func(base map[string][]byte, kv ...any) func() map[string][]byte {
		return func() map[string][]byte {
			d := maps.Clone(base)
			for i := 0; i < len(kv); i += 2 {
				d[kv[i].(string)] = kv[i+1].([]byte)
			}
			return d
		}
	}
	tests := []struct {
		name    string
		current func() map[string][]byte
		service string
		now     time.Time
		// wantReason is part of the reason; "" means nothing changes.
		wantReason   string
		wantSameCA   bool
		wantSameLeaf bool
		wantCAs      int
	}{
		{name: "no Secret", current: func() map[string][]byte { return nil }, now: t0,
			wantReason: "does not exist", wantCAs: 1},
		{name: "current", current: with(fresh), now: t0.Add(7 * time.Hour)},
		{name: "serving certificate near expiry", current: with(fresh), now: t0.Add(8 * time.Hour),
			wantReason: "serving certificate expires", wantSameCA: true, wantCAs: 1},
		{name: "service renamed", current: with(fresh), service: "renamed", now: t0,
			wantReason: "serving certificate names", wantSameCA: true, wantCAs: 1},
		{name: "serving certificate from another CA", now: t0,
			current:    with(fresh, "tls.crt", otherCA["tls.crt"], "tls.key", otherCA["tls.key"]),
			wantReason: "does not verify against the CA", wantSameCA: true, wantCAs: 1},
		{name: "serving key of another certificate", current: with(fresh, "tls.key", otherCA["tls.key"]), now: t0,
			wantReason: "key pair is unusable", wantSameCA: true, wantCAs: 1},
		{name: "CA key of another CA", current: with(fresh, "ca.key", otherCA["ca.key"]), now: t0,
			wantReason: "no usable CA", wantCAs: 1},
		{name: "CA key unreadable", current: with(fresh, "ca.key", []byte("not a key")), now: t0,
			wantReason: "no usable CA", wantCAs: 1},
		{name: "CA near expiry publishes the next CA and serves from the old", current: with(renewed), now: t0.Add(98*time.Hour + 30*time.Minute),
			wantReason: "publishing the next CA", wantSameCA: true, wantSameLeaf: true, wantCAs: 2},
		{name: "next CA published, overlap not over", current: with(published), now: t0.Add(99*time.Hour + 29*time.Minute)},
		{name: "next CA signs after the overlap, the old CA stays trusted", current: with(published), now: t0.Add(99*time.Hour + 30*time.Minute),
			wantReason: "the next CA has been published since", wantCAs: 2},
		{name: "CA expired before the overlap ended: the next CA signs at once", current: with(published), now: t0.Add(100 * time.Hour),
			wantReason: "the CA expired", wantCAs: 1},
		{name: "unusable next CA is published again", current: with(published, "next-ca.key", otherCA["ca.key"]), now: t0.Add(99 * time.Hour),
			wantReason: "publishing the next CA", wantSameCA: true, wantSameLeaf: true, wantCAs: 2},
		{name: "replaced CA expired", current: with(rotatedCA), now: t0.Add(101 * time.Hour),
			wantReason: "a replaced CA has expired", wantSameCA: true, wantSameLeaf: true, wantCAs: 1},
		{name: "rotated CA current", current: with(rotatedCA), now: t0.Add(99*time.Hour + 31*time.Minute)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := *o
			if tt.service != "" {
				o.ServiceName = tt.service
			}
			current := tt.current()
			data, reason, err := plan(current, &o, tt.now)
			if err != nil {
				t.Fatal(err)
			}
			if tt.wantReason == "" {
				if data != nil {
					t.Fatalf("plan changed the Secret: %s", reason)
				}
				return
			}
			if data == nil || !strings.Contains(reason, tt.wantReason) {
				t.Fatalf("reason %q, want one with %q", reason, tt.wantReason)
			}
			if same := bytes.Equal(data["ca.key"], current["ca.key"]); same != tt.wantSameCA {
				t.Errorf("same CA key: %v, want %v", same, tt.wantSameCA)
			}
			if same := bytes.Equal(data["tls.crt"], current["tls.crt"]); same != tt.wantSameLeaf {
				t.Errorf("same serving certificate: %v, want %v", same, tt.wantSameLeaf)
			}
			cas, err := parseCertificates(data["ca.crt"])
			if err != nil {
				t.Fatal(err)
			}
			if len(cas) != tt.wantCAs {
				t.Errorf("ca.crt holds %d CAs, want %d", len(cas), tt.wantCAs)
			}
			verifyLeaf(t, data, o.serverName(), tt.now)
			if again, reason, _ := plan(data, &o, tt.now); again != nil {
				t.Errorf("plan is not idempotent: it changes its own result again: %s", reason)
			}
		})
	}
}

// TestPlanSwitchesToThePublishedCA: the CA that signs after the overlap is
// the one every bundle got ahead of time, not a new one.
func TestPlanSwitchesToThePublishedCA(t *testing.T) {
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	o := testOptions(t)
	fresh := mustPlan(t, nil, o, t0)
	published := mustPlan(t, mustPlan(t, fresh, o, t0.Add(97*time.Hour)), o, t0.Add(98*time.Hour+30*time.Minute))
	if len(published["next-ca.key"]) == 0 || !bytes.Contains(published["ca.crt"], published["next-ca.crt"]) {
		t.Fatal("the next CA is not published in ca.crt")
	}
	oldBundle := x509.NewCertPool()
	oldBundle.AppendCertsFromPEM(published["ca.crt"])
	for _, at := range []time.Duration{99*time.Hour + 30*time.Minute, 100 * time.Hour} {
		switched := mustPlan(t, published, o, t0.Add(at))
		if !bytes.Equal(switched["ca.key"], published["next-ca.key"]) {
			t.Fatalf("at +%s the serving certificate is signed by a CA nobody was given ahead", at)
		}
		if _, ok := switched["next-ca.crt"]; ok {
			t.Fatalf("at +%s the promoted CA is still published as the next", at)
		}
		leaf := verifyLeaf(t, switched, o.serverName(), t0.Add(at))
		// A sidecar holding the bundle of before the switch verifies it.
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: o.serverName(), Roots: oldBundle, CurrentTime: t0.Add(at)}); err != nil {
			t.Fatalf("at +%s the bundle published before the switch does not verify the new serving certificate: %v", at, err)
		}
	}
}

// TestPlanServingCertificateNeverOutlivesCA: a CA with less left than
// CertValidity signs a certificate that ends with it.
func TestPlanServingCertificateNeverOutlivesCA(t *testing.T) {
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	o := testOptions(t)
	data := mustPlan(t, mustPlan(t, nil, o, t0), o, t0.Add(95*time.Hour))
	ca := mustAuthority(t, data)
	leaf := verifyLeaf(t, data, o.serverName(), t0.Add(95*time.Hour))
	if !leaf.NotAfter.Equal(ca.cert.NotAfter) {
		t.Errorf("serving certificate ends %s, its CA %s", leaf.NotAfter, ca.cert.NotAfter)
	}
}

func TestPlanNames(t *testing.T) {
	o := testOptions(t)
	leaf := verifyLeaf(t, mustPlan(t, nil, o, time.Now()), "svc.ns.svc", time.Now())
	want := []string{"svc", "svc.ns", "svc.ns.svc", "svc.ns.svc.cluster.local"}
	if !slices.Equal(sorted(leaf.DNSNames), sorted(want)) {
		t.Errorf("DNS names %v, want %v", leaf.DNSNames, want)
	}
	if len(leaf.IPAddresses) != 0 || len(leaf.URIs) != 0 || len(leaf.EmailAddresses) != 0 {
		t.Errorf("unexpected SANs: %v %v %v", leaf.IPAddresses, leaf.URIs, leaf.EmailAddresses)
	}
}

func TestOptionsComplete(t *testing.T) {
	o, err := Options{Namespace: "ns"}.complete()
	if err != nil {
		t.Fatal(err)
	}
	want := Options{
		Namespace: "ns", SecretName: DefaultSecretName, ServiceName: DefaultServiceName,
		WebhookConfigName: DefaultWebhookConfigName, CertDir: DefaultCertDir(),
		CAValidity: DefaultCAValidity, CertValidity: DefaultCertValidity,
		RotateBefore: DefaultRotateBefore, CheckInterval: DefaultCheckInterval, CAOverlap: DefaultCAOverlap,
	}
	if !reflect.DeepEqual(o, want) {
		t.Errorf("defaults %+v, want %+v", o, want)
	}

	for _, tt := range []struct {
		name string
		o    Options
		want string
	}{
		{"serving certificate shorter than RotateBefore", Options{Namespace: "ns", CertValidity: time.Hour, RotateBefore: time.Hour}, "CertValidity"},
		{"CA shorter than RotateBefore", Options{Namespace: "ns", CAValidity: time.Hour, CertValidity: time.Hour, RotateBefore: 2 * time.Hour}, "CAValidity"},
		{"check slower than RotateBefore", Options{Namespace: "ns", CheckInterval: 31 * 24 * time.Hour}, "CheckInterval"},
		{"overlap as long as RotateBefore", Options{Namespace: "ns", CAOverlap: 30 * 24 * time.Hour}, "CAOverlap"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := tt.o.complete(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one about %s", err, tt.want)
			}
		})
	}

	if _, err := os.Stat(inClusterNamespaceFile); err != nil {
		if _, err := (Options{}).complete(); err == nil {
			t.Error("no Namespace outside a cluster: no error")
		}
	}
}

func TestWritePair(t *testing.T) {
	dir := t.TempDir()
	// A plain pair, as an older manager or a person may have left it.
	for _, name := range []string{"tls.crt", "tls.key"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("plain"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for i, tt := range []struct {
		cert, key string
		wantWrote bool
	}{{"cert1", "key1", true}, {"cert1", "key1", false}, {"cert1", "key2", true}, {"cert3", "key3", true}} {
		wrote, err := writePair(dir, []byte(tt.cert), []byte(tt.key))
		if err != nil {
			t.Fatal(err)
		}
		if wrote != tt.wantWrote {
			t.Errorf("write %d: wrote %v, want %v", i, wrote, tt.wantWrote)
		}
		for name, want := range map[string]string{"tls.crt": tt.cert, "tls.key": tt.key} {
			if got, _ := os.ReadFile(filepath.Join(dir, name)); string(got) != want {
				t.Errorf("write %d: %s holds %q, want %q", i, name, got, want)
			}
		}
	}
	fi, err := os.Stat(filepath.Join(dir, "tls.key"))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("tls.key mode %v, want 0600", fi.Mode().Perm())
	}
	pairs, _ := filepath.Glob(filepath.Join(dir, "..certs-*"))
	leftovers, _ := filepath.Glob(filepath.Join(dir, "*.tmp"))
	if len(pairs) != 1 || len(leftovers) != 0 {
		t.Errorf("old pairs or temporary links left behind: %v %v", pairs, leftovers)
	}
}

// verifyLeaf checks that tls.crt verifies against ca.crt for serverName at
// now, and that tls.key is its key.
func verifyLeaf(t *testing.T, data map[string][]byte, serverName string, now time.Time) *x509.Certificate {
	t.Helper()
	leaf, err := parseCertificates(data[corev1.TLSCertKey])
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(data["ca.crt"]) {
		t.Fatal("ca.crt holds no certificate")
	}
	if _, err := leaf[0].Verify(x509.VerifyOptions{DNSName: serverName, Roots: roots, CurrentTime: now}); err != nil {
		t.Fatalf("tls.crt does not verify against ca.crt: %v", err)
	}
	if _, err := tls.X509KeyPair(data[corev1.TLSCertKey], data[corev1.TLSPrivateKeyKey]); err != nil {
		t.Fatalf("tls.key is not the key of tls.crt: %v", err)
	}
	return leaf[0]
}

func mustAuthority(t *testing.T, data map[string][]byte) *authority {
	t.Helper()
	ca, _, err := parseAuthority(data)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}
