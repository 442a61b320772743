// Package envtest_test checks that the envtest control plane built by
// hack/setup-envtest.sh starts and does what the operator's tests rely on:
// it reports the Kubernetes version it was stamped with and it issues and
// reviews audience-bound ServiceAccount tokens.
//
//	export KUBEBUILDER_ASSETS=$(hack/setup-envtest.sh)
//	go test ./test/envtest/ -v -count=1
package envtest_test

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/test/testdeps"
)

const (
	// wantVersion is what hack/setup-envtest.sh builds and stamps.
	wantVersion = "v1.37.2"
	audience    = "idemcp"
)

// startEnv starts kube-apiserver and etcd from $KUBEBUILDER_ASSETS and stops
// them when the test ends. Without the assets it skips, or fails under CI.
func startEnv(t *testing.T) *envtest.Environment {
	t.Helper()
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		testdeps.Missing(t, "KUBEBUILDER_ASSETS is unset; run: export KUBEBUILDER_ASSETS=$(hack/setup-envtest.sh)")
	}
	env := &envtest.Environment{}
	if _, err := env.Start(); err != nil {
		t.Fatalf("starting envtest from KUBEBUILDER_ASSETS=%s: %v", os.Getenv("KUBEBUILDER_ASSETS"), err)
	}
	t.Cleanup(func() {
		if err := env.Stop(); err != nil {
			t.Errorf("stopping envtest: %v", err)
		}
	})
	return env
}

func TestControlPlane(t *testing.T) {
	env := startEnv(t)
	cs, err := kubernetes.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()

	t.Run("version", func(t *testing.T) {
		v, err := cs.Discovery().ServerVersion()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("server version %s (major %q, minor %q, %s)", v.GitVersion, v.Major, v.Minor, v.GoVersion)
		if v.GitVersion != wantVersion {
			t.Errorf("server version %q, want %q: kube-apiserver was built without the version stamp", v.GitVersion, wantVersion)
		}
		if want := strings.Split(strings.TrimPrefix(wantVersion, "v"), "."); v.Major != want[0] || v.Minor != want[1] {
			t.Errorf("server major.minor %q.%q, want %s.%s", v.Major, v.Minor, want[0], want[1])
		}
	})

	ns, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "envtest-smoke-"},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating a namespace: %v", err)
	}
	sa, err := cs.CoreV1().ServiceAccounts(ns.Name).Create(ctx, &corev1.ServiceAccount{
		ObjectMeta: metav1.ObjectMeta{Name: "idemcp-smoke"},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating a service account: %v", err)
	}

	t.Run("token request and review", func(t *testing.T) {
		expiry := int64(3600)
		tr, err := cs.CoreV1().ServiceAccounts(ns.Name).CreateToken(ctx, sa.Name, &authenticationv1.TokenRequest{
			Spec: authenticationv1.TokenRequestSpec{Audiences: []string{audience}, ExpirationSeconds: &expiry},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("TokenRequest: %v", err)
		}
		if tr.Status.Token == "" {
			t.Fatal("TokenRequest returned no token")
		}
		if !slices.Equal(tr.Spec.Audiences, []string{audience}) {
			t.Errorf("TokenRequest audiences %q, want [%s]", tr.Spec.Audiences, audience)
		}

		review := func(audiences ...string) *authenticationv1.TokenReview {
			t.Helper()
			r, err := cs.AuthenticationV1().TokenReviews().Create(ctx, &authenticationv1.TokenReview{
				Spec: authenticationv1.TokenReviewSpec{Token: tr.Status.Token, Audiences: audiences},
			}, metav1.CreateOptions{})
			if err != nil {
				t.Fatalf("TokenReview: %v", err)
			}
			return r
		}

		got := review(audience).Status
		wantUser := "system:serviceaccount:" + ns.Name + ":" + sa.Name
		if !got.Authenticated {
			t.Fatalf("token not authenticated for audience %q: %q", audience, got.Error)
		}
		if got.User.Username != wantUser {
			t.Errorf("token user %q, want %q", got.User.Username, wantUser)
		}
		if got.User.UID != string(sa.UID) {
			t.Errorf("token user UID %q, want the service account's %q", got.User.UID, sa.UID)
		}
		if !slices.Equal(got.Audiences, []string{audience}) {
			t.Errorf("token audiences %q, want [%s]", got.Audiences, audience)
		}
		t.Logf("token reviewed: user %s, groups %q, audiences %q", got.User.Username, got.User.Groups, got.Audiences)

		// The audience is checked, not just the signature.
		if other := review("not-" + audience).Status; other.Authenticated {
			t.Errorf("token for audience %q authenticated for audience %q", audience, "not-"+audience)
		}
	})

	t.Run("kubectl", func(t *testing.T) {
		bin := filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "kubectl")
		if _, err := exec.LookPath(bin); err != nil {
			testdeps.Missing(t, fmt.Sprintf("no kubectl in KUBEBUILDER_ASSETS (hack/setup-envtest.sh builds it unless --no-kubectl): %v", err))
		}
		user, err := env.AddUser(envtest.User{Name: "idemcp-kubectl", Groups: []string{"system:masters"}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		kubectl, err := user.Kubectl()
		if err != nil {
			t.Fatal(err)
		}
		stdout, stderr, err := kubectl.Run("get", "namespace", ns.Name, "-o", "name")
		if err != nil {
			t.Fatalf("kubectl get namespace: %v: %s", err, readAll(t, stderr))
		}
		if got, want := strings.TrimSpace(readAll(t, stdout)), "namespace/"+ns.Name; got != want {
			t.Errorf("kubectl get namespace printed %q, want %q", got, want)
		}
	})
}

func readAll(t *testing.T, r io.Reader) string {
	t.Helper()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
