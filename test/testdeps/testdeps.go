// Package testdeps decides, in one place, what a test does when a program
// it runs for real (redis-server, node, the envtest binaries) is missing:
// under CI=true that is a failure, never a skip; on a developer's machine
// the test skips and says how to install it.
package testdeps

import (
	"os"
	"testing"
)

// CI reports whether the tests run under CI, where nothing may be skipped.
func CI() bool { return os.Getenv("CI") == "true" }

// Missing ends t because a dependency is missing: Fatal under CI, Skip
// elsewhere. msg says what is missing and how to get it.
func Missing(t testing.TB, msg string) {
	t.Helper()
	if CI() {
		t.Fatal(msg)
	}
	t.Skip(msg)
}
