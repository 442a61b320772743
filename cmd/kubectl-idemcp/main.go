// Command kubectl-idemcp is the kubectl plugin of idemcp: kubectl idemcp
// analyze | check-inject | status | keys. The logic is in internal/plugin.
package main

import (
	"os"

	"github.com/idemcp/idemcp/internal/plugin"
)

func main() {
	os.Exit(plugin.Main(os.Args[1:], os.Stdout, os.Stderr))
}
