package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemcp/idemcp/internal/version"
)

// Command runs one subcommand with the arguments after its name.
type Command func(ctx context.Context, args []string) error

// Version is the version command both binaries have.
func Version(context.Context, []string) error {
	fmt.Println(version.Get())
	return nil
}

// Program is a binary of subcommands: idemcp and idemcp-proxy.
type Program struct {
	// Name starts its error messages.
	Name string
	// Usage is printed for help, and with no command (exit 2).
	Usage    string
	Commands map[string]Command
	// Unknown is the message for a command it does not have.
	Unknown func(name string) string
}

// Main runs the command args[1] names until SIGINT or SIGTERM and exits
// the process as the command says: 0, 2 for a usage error, a wrapped
// server's own exit code, else 1 with the error on stderr.
func (p Program) Main(args []string) {
	if len(args) < 2 || args[1] == "help" || args[1] == "-h" || args[1] == "--help" {
		fmt.Print(p.Usage)
		if len(args) < 2 {
			os.Exit(2)
		}
		return
	}
	run, ok := p.Commands[args[1]]
	if !ok {
		fmt.Fprint(os.Stderr, p.Unknown(args[1]))
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, args[2:])
	stop()
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return
	}
	var exit interface{ ExitCode() int }
	if errors.As(err, &exit) {
		os.Exit(exit.ExitCode()) // the wrapped server already said why on stderr
	}
	fmt.Fprintf(os.Stderr, "%s %s: %v\n", p.Name, args[1], err)
	os.Exit(1)
}
