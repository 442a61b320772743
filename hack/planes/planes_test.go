// Package planes checks the boundary between idemcp's planes: the data plane
// (the sidecar and wrap, the idemcp-proxy binary, and the Go library) links
// none of the control plane's libraries. The sidecar's image size, memory
// and start-up time depend on it. golangci-lint's depguard rule refuses a
// direct import in those folders; this test also sees one that arrives
// through another package (go list -deps), so make test fails either way.
package planes

import (
	"os/exec"
	"strings"
	"testing"
)

// dataPlane are the packages (with everything under them) that the
// sidecar's binary and the library's users link.
var dataPlane = []string{
	"github.com/idemcp/idemcp/cmd/idemcp-proxy",
	"github.com/idemcp/idemcp/sidecar/...",
	"github.com/idemcp/idemcp/idempotency/...",
	"github.com/idemcp/idemcp/internal/claim",
	"github.com/idemcp/idemcp/internal/engine",
	"github.com/idemcp/idemcp/internal/store/...",
	"github.com/idemcp/idemcp/internal/mcpmsg",
	"github.com/idemcp/idemcp/internal/canonical",
}

// controlPlane are the module paths the data plane must not link.
var controlPlane = []string{
	"sigs.k8s.io/controller-runtime",
	"k8s.io/client-go",
}

func TestDataPlaneLinksNoControlPlaneLibrary(t *testing.T) {
	args := append([]string{"list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}"}, dataPlane...)
	out, err := exec.Command("go", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	pkgs := strings.Fields(string(out))
	if len(pkgs) < 20 {
		t.Fatalf("go list -deps found only %d packages for %v; the data plane's paths have moved: update dataPlane", len(pkgs), dataPlane)
	}
	for _, p := range pkgs {
		for _, c := range controlPlane {
			if p == c || strings.HasPrefix(p, c+"/") {
				why, _ := exec.Command("go", "mod", "why", "-m", c).CombinedOutput()
				t.Errorf("the data plane links %s (a package of %s): the sidecar and the library must stay free of the control plane's libraries\n%s", p, c, why)
			}
		}
	}
}
