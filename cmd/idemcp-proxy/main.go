// Command idemcp-proxy is idemcp's data plane alone: the in-pod sidecar and
// the stdio wrapper, the same code as `idemcp sidecar` and `idemcp wrap`,
// built from the same commit into the same image. It leaves out the
// manager's Kubernetes client libraries, whose package initialisation and
// memory the sidecar of every MCP pod would otherwise pay: the webhook
// injects this binary (test/bench/results.md has the figures).
package main

import (
	"fmt"
	"os"

	"github.com/idemcp/idemcp/internal/cli"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/sidecar/stdio"
)

var commands = map[string]cli.Command{
	"sidecar": sidecar.Main,
	"wrap":    stdio.Main,
	"version": cli.Version,
}

const usage = `idemcp-proxy is idemcp's data plane: the sidecar and the stdio wrapper.

Usage:
  idemcp-proxy sidecar --listen ADDR --upstream URL [--policy-file FILE] [--admin-listen ADDR]
  idemcp-proxy wrap [--policy-file FILE] [--store memory|redis ...] -- CMD [ARGS...]
  idemcp-proxy version
  idemcp-proxy help

The same commands run as 'idemcp sidecar' and 'idemcp wrap'; the manager is 'idemcp manager'.
Run 'idemcp-proxy COMMAND -h' for a command's flags.
`

func main() {
	cli.Program{Name: "idemcp-proxy", Usage: usage, Commands: commands, Unknown: func(name string) string {
		return fmt.Sprintf("idemcp-proxy: unknown command %q (the manager is 'idemcp manager')\n\n%s", name, usage)
	}}.Main(os.Args)
}
