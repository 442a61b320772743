// Package testdeps decides, in one place, what a test does when a program
// it runs for real (redis-server, node, the envtest binaries) is missing:
// under CI=true that is a failure, never a skip; on a developer's machine
// the test skips and says how to install it.
package testdeps

import (
	"flag"
	"os"
	"testing"
)

// CI reports whether the tests run under CI, where nothing may be skipped.
func CI() bool { return os.Getenv("CI") == "true" }

// Missing ends t because a dependency is missing: Fatal under CI, Skip
// elsewhere. msg says what is missing and how to get it.
func Missing(t testing.TB, msg string) {
	t.Helper()
	Real(t, "needs what is missing here")
	if CI() {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// Real ends t when the tests run with -short (make test-unit, the inner
// loop): t runs real processes (what says which), and make test runs it.
// Under -short nothing real starts, with or without CI.
func Real(t testing.TB, what string) {
	t.Helper()
	if Short() {
		t.Skip("-short (make test-unit): this test " + what + "; make test runs it")
	}
}

// Short is testing.Short, safe to call from TestMain before m.Run has
// parsed the flags.
func Short() bool {
	if !flag.Parsed() {
		flag.Parse()
	}
	return testing.Short()
}
