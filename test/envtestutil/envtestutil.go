// Package envtestutil starts the real kube-apiserver and etcd that
// hack/setup-envtest.sh builds, the same way for every test suite.
package envtestutil

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/zap/zapcore"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"github.com/idemcp/idemcp/test/poll"
	"github.com/idemcp/idemcp/test/testdeps"
)

// Available reports whether the envtest binaries are there. When they are
// not, a test binary under CI=true exits 1 (a missing dependency is a
// failure there), and elsewhere the caller decides to skip. Under -short
// (make test-unit) it is false.
func Available() bool {
	if testdeps.Short() {
		fmt.Fprintln(os.Stderr, "skipping the envtest tests under -short (make test-unit); make test runs them")
		return false
	}
	if os.Getenv("KUBEBUILDER_ASSETS") != "" {
		return true
	}
	if testdeps.CI() {
		fmt.Fprintln(os.Stderr, "KUBEBUILDER_ASSETS is not set: run through make test, or export KUBEBUILDER_ASSETS=$(hack/setup-envtest.sh)")
		os.Exit(1)
	}
	fmt.Fprintln(os.Stderr, "skipping the envtest tests: export KUBEBUILDER_ASSETS=$(hack/setup-envtest.sh) (make test does)")
	return false
}

// Run starts env, runs body with its config and stops it, returning the
// exit code for TestMain. Controller logs show errors only, unless
// ENVTEST_VERBOSE is set.
func Run(env *envtest.Environment, body func(cfg *rest.Config) int) int {
	level := zapcore.ErrorLevel
	if os.Getenv("ENVTEST_VERBOSE") != "" {
		level = zapcore.DebugLevel
	}
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr), zap.Level(level)))
	cfg, err := env.Start()
	if err != nil {
		fmt.Fprintf(os.Stderr, "starting envtest: %v\n", err)
		return 1
	}
	defer func() { _ = env.Stop() }()
	return body(cfg)
}

// Eventually is poll.Eventually, here for the envtest suites' call sites.
func Eventually(t testing.TB, what string, cond func() error) {
	t.Helper()
	poll.Eventually(t, what, cond)
}
