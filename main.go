// Command idemcp makes MCP tool calls exactly-once. One binary, three roles:
// the in-pod sidecar proxy, the manager (controller and webhook) and a
// local wrapper for stdio servers.
package main

import (
	"fmt"
	"os"

	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/internal/cli"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/sidecar/stdio"
)

var commands = map[string]cli.Command{
	"sidecar": sidecar.Main,
	"wrap":    stdio.Main,
	"manager": manager.Main,
	"version": cli.Version,
}

const usage = `idemcp makes MCP tool calls exactly-once.

Usage:
  idemcp sidecar --upstream URL [flags]   the dedup proxy in front of an HTTP MCP server
  idemcp wrap [flags] -- CMD [ARGS...]    the dedup proxy in front of a stdio MCP server
  idemcp manager [flags]                  the Kubernetes controller and webhook
  idemcp version                          the version, commit and Go version

Run idemcp COMMAND --help for a command's flags.
`

func main() {
	cli.Program{Name: "idemcp", Usage: usage, Commands: commands, Unknown: func(name string) string {
		return fmt.Sprintf("idemcp: unknown command %q; run idemcp --help for the commands\n", name)
	}}.Main(os.Args)
}
