// Command idemcp makes MCP tool calls exactly-once. One binary, three roles:
// the in-pod sidecar proxy, the manager (controller and webhook) and a
// local wrapper for stdio servers.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/internal/version"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/sidecar/stdio"
)

var commands = map[string]func(ctx context.Context, args []string) error{
	"sidecar": sidecar.Main,
	"wrap":    stdio.Main,
	"manager": manager.Main,
	"version": func(context.Context, []string) error {
		fmt.Println(version.Get())
		return nil
	},
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
	if len(os.Args) < 2 || os.Args[1] == "help" || os.Args[1] == "-h" || os.Args[1] == "--help" {
		fmt.Print(usage)
		if len(os.Args) < 2 {
			os.Exit(2)
		}
		return
	}
	run, ok := commands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "idemcp: unknown command %q; run idemcp --help for the commands\n", os.Args[1])
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[2:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		var exit interface{ ExitCode() int }
		if errors.As(err, &exit) {
			os.Exit(exit.ExitCode()) // the wrapped server already said why on stderr
		}
		fmt.Fprintf(os.Stderr, "idemcp %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}
