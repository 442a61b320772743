// Package planes checks the boundary between idemcp's planes: the data plane
// (the sidecar and wrap, the idemcp-proxy binary, and the Go library) links
// none of the control plane's libraries. The sidecar's image size, memory
// and start-up time depend on it. golangci-lint's depguard rule refuses a
// direct import in those folders; this test also sees one that arrives
// through another package (go list -deps), so make test fails either way,
// and that depguard's rule names every package of ours the data plane
// links, so that a package added to it is covered from the start.
package planes

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

const module = "github.com/idemcp/idemcp"

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
	"github.com/idemcp/idemcp/internal/storeopen",
}

// linked are what the idemcp-proxy binary and the library's users link:
// dataPlane without its test helpers (redistest, pgtest, storetest).
var linked = []string{
	"github.com/idemcp/idemcp/cmd/idemcp-proxy",
	"github.com/idemcp/idemcp/idempotency/...",
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

// Every package of ours that the data plane links is one depguard's
// data-plane rule covers: otherwise a control-plane import added to it
// would pass the linter and fail only here, in the slow suite.
func TestDepguardCoversTheDataPlane(t *testing.T) {
	b, err := os.ReadFile("../../.golangci.yml")
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Linters struct {
			Settings struct {
				Depguard struct {
					Rules map[string]struct {
						Files []string `json:"files"`
					} `json:"rules"`
				} `json:"depguard"`
			} `json:"settings"`
		} `json:"linters"`
	}
	if err := yaml.Unmarshal(b, &cfg); err != nil {
		t.Fatal(err)
	}
	var dirs []string
	for _, f := range cfg.Linters.Settings.Depguard.Rules["data-plane"].Files {
		dirs = append(dirs, strings.TrimSuffix(strings.TrimPrefix(f, "**/"), "/**"))
	}
	if len(dirs) == 0 {
		t.Fatal(".golangci.yml has no depguard rule data-plane with files")
	}
	args := append([]string{"list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}"}, linked...)
	out, err := exec.Command("go", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	for _, p := range strings.Fields(string(out)) {
		rel, ok := strings.CutPrefix(p, module+"/")
		if !ok {
			continue
		}
		covered := false
		for _, d := range dirs {
			if rel == d || strings.HasPrefix(rel, d+"/") {
				covered = true
				break
			}
		}
		if !covered {
			t.Errorf("the data plane links %s, which depguard's data-plane rule in .golangci.yml does not name: add \"**/%s/**\" to its files", p, rel)
		}
	}
}
