package controllers_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/webhook"
)

// TestWebhookServesHTTP1Only: HTTP/2 is off on the webhook server.
func TestWebhookServesHTTP1Only(t *testing.T) {
	wh := testEnv.WebhookInstallOptions
	conn, err := tls.Dial("tcp", net.JoinHostPort(wh.LocalServingHost, fmt.Sprint(wh.LocalServingPort)),
		&tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2", "http/1.1"}}) //nolint:gosec // only the protocol is checked
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	if p := conn.ConnectionState().NegotiatedProtocol; p == "h2" {
		t.Errorf("the webhook server negotiated %s", p)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	return freeport.Loopback(t)
}

// TestMetricsNeedAuthorization: /metrics answers only a caller allowed to
// get it, over HTTPS without HTTP/2; /readyz waits for the policy cache.
func TestMetricsNeedAuthorization(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	metricsAddr, probeAddr := freeAddr(t), freeAddr(t)
	mgr, err := manager.New(cfg, manager.Options{
		MetricsAddr: metricsAddr, ProbeAddr: probeAddr, MissingPolicy: "deny", Namespace: "idemcp-system",
		WebhookPort: 0, WebhookCertDir: testEnv.WebhookInstallOptions.LocalServingCertDir,
		Sidecar: webhook.DefaultConfig("ghcr.io/idemcp/idemcp:test"), SecondManager: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = mgr.Start(ctx)
	}()
	defer func() { cancel(); <-done }()

	// A service account bound to a role that may get /metrics, and one
	// that may not.
	ns := newNamespace(t)
	cs := kubernetes.NewForConfigOrDie(cfg)
	token := func(name string) string {
		if _, err := cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		tr, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return tr.Status.Token
	}
	reader, other := token("scraper"), token("nosy")
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{GenerateName: "metrics-reader-"}, Rules: []rbacv1.PolicyRule{{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}}}}
	if err := k8s.Create(ctx, role); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{GenerateName: "metrics-reader-"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role.Name},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: "scraper", Namespace: ns}}}
	if err := k8s.Create(ctx, binding); err != nil {
		t.Fatal(err)
	}

	httpc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		TLSClientConfig:   &tls.Config{InsecureSkipVerify: true}, //nolint:gosec // a self-signed certificate
		ForceAttemptHTTP2: true,
	}}
	get := func(url, token string) (int, string, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := httpc.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer func() { _ = resp.Body.Close() }()
		body, _ := io.ReadAll(resp.Body)
		if resp.ProtoMajor == 2 {
			return 0, "", fmt.Errorf("served over %s", resp.Proto)
		}
		return resp.StatusCode, string(body), nil
	}
	eventually(t, "/readyz with the policy cache synced", func() error {
		code, body, err := get("http://"+probeAddr+"/readyz?verbose", "")
		if err != nil {
			return err
		}
		if code != http.StatusOK || !strings.Contains(body, "policies-synced ok") {
			return fmt.Errorf("readyz %d: %s", code, body)
		}
		return nil
	})
	url := "https://" + metricsAddr + "/metrics"
	for _, tt := range []struct {
		who, token string
		want       int
	}{
		{"anonymous", "", http.StatusUnauthorized},
		{"a service account without the role", other, http.StatusForbidden},
		{"the metrics reader", reader, http.StatusOK},
	} {
		eventually(t, tt.who+" on /metrics", func() error {
			code, body, err := get(url, tt.token)
			if err != nil {
				return err
			}
			if code != tt.want {
				return fmt.Errorf("status %d, want %d: %.200s", code, tt.want, body)
			}
			if code == http.StatusOK && !strings.Contains(body, "controller_runtime_") {
				return fmt.Errorf("no metrics in %.200s", body)
			}
			return nil
		})
	}
}
