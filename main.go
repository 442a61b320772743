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

	"github.com/idemcp/idemcp/controllers"
	"github.com/idemcp/idemcp/sidecar"
	"github.com/idemcp/idemcp/sidecar/stdio"
)

var commands = map[string]func(ctx context.Context, args []string) error{
	"sidecar": sidecar.Main,
	"wrap":    stdio.Main,
	"manager": controllers.ManagerMain,
}

const usage = `idemcp makes MCP tool calls exactly-once.

Usage:
  idemcp manager [--leader-elect] [--redis-image IMAGE]
  idemcp sidecar --listen ADDR --upstream URL [--policy-file FILE] [--admin-listen ADDR]
  idemcp wrap [--policy-file FILE] [--store memory|redis ...] -- CMD [ARGS...]
  idemcp help

Run 'idemcp COMMAND -h' for a command's flags.
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
		fmt.Fprintf(os.Stderr, "idemcp: unknown command %q\n\n%s", os.Args[1], usage)
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
