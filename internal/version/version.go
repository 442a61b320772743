// Package version says which idemcp this is. Version and Commit are set at
// build time (-ldflags "-X github.com/idemcp/idemcp/internal/version.Version=v0.2.0");
// a plain `go build` falls back to what the Go toolchain recorded.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// Set by the linker; see the Makefile's LDFLAGS.
var (
	Version = ""
	Commit  = ""
)

// Info is the build's identity.
type Info struct {
	Version   string
	Commit    string
	GoVersion string
}

// Get returns the build's identity, from the linker's values or, failing
// those, from the build info the Go toolchain embeds (a VCS build).
func Get() Info {
	i := Info{Version: Version, Commit: Commit, GoVersion: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if i.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			i.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch {
			case s.Key == "vcs.revision" && i.Commit == "":
				i.Commit = s.Value
			case s.Key == "vcs.modified" && s.Value == "true" && i.Commit != "" && Commit == "":
				i.Commit += "-dirty"
			}
		}
	}
	if i.Version == "" {
		i.Version = "dev"
	}
	if i.Commit == "" {
		i.Commit = "unknown"
	}
	return i
}

func (i Info) String() string {
	return fmt.Sprintf("idemcp %s (commit %s, %s)", i.Version, i.Commit, i.GoVersion)
}
