// Command idemcp-proxy is idemcp's data plane alone: the in-pod sidecar and
// the stdio wrapper, the same code as `idemcp sidecar` and `idemcp wrap`,
// built from the same commit into the same image. It leaves out the
// manager's Kubernetes client libraries, whose package initialisation and
// memory the sidecar of every MCP pod would otherwise pay: the webhook
// injects this binary (test/bench/results.md has the figures).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemcp/idemcp/internal/version"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/sidecar/stdio"
)

var commands = map[string]func(ctx context.Context, args []string) error{
	"sidecar": sidecar.Main,
	"wrap":    stdio.Main,
	"version": func(context.Context, []string) error {
		fmt.Println(version.Get())
		return nil
	},
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
	if len(os.Args) < 2 || os.Args[1] == "help" || os.Args[1] == "-h" || os.Args[1] == "--help" {
		fmt.Print(usage)
		if len(os.Args) < 2 {
			os.Exit(2)
		}
		return
	}
	run, ok := commands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "idemcp-proxy: unknown command %q (the manager is 'idemcp manager')\n\n%s", os.Args[1], usage)
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
		fmt.Fprintf(os.Stderr, "idemcp-proxy %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}
