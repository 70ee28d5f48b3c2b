// Command cudashare is the project's command line: the demo, and a look at
// the devices and peer topology the driver reports.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/seed743c36cf/cudashare/internal/app"
)

const usage = `usage: cudashare <command> [flags]

commands:
  demo      run a producer and two consumer processes for a few seconds, verify
            every batch and report (on the simulated driver without a GPU)
  devices   list the devices, their peer access, P2P attributes and atomic capabilities
  top       attach to a running producer's socket and show who holds what (-once -json for scripts)

Every command takes -driver auto|cuda|sim (CUDASHARE_DRIVER overrides it).
`

// Exit codes that scripts can use: the same as the producer's and the
// consumer's (see app.Exit*).
const (
	exitOK       = app.ExitOK
	exitFailure  = app.ExitFailure
	exitUsage    = app.ExitUsage
	exitNoDriver = app.ExitNoDriver
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	switch args[0] {
	case "demo":
		return runDemo(ctx, args[1:], stdout, stderr)
	case "devices":
		return runDevices(args[1:], stdout, stderr)
	case "top":
		return runTop(ctx, args[1:], stdout, stderr)
	// Hidden: the demo re-runs this binary as its producer and consumers.
	// They are examples/producer and examples/consumer (-h explains them).
	case "producer":
		return app.RunProducer(ctx, args[1:], stdout, stderr)
	case "consumer":
		return app.RunConsumer(ctx, args[1:], stdout, stderr)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return exitOK
	default:
		fmt.Fprintf(stderr, "cudashare: unknown command %q\n\n%s", args[0], usage)
		return exitUsage
	}
}

func newFlagSet(name string, stderr io.Writer) (*flag.FlagSet, *string) {
	fs := flag.NewFlagSet("cudashare "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	backend := fs.String("driver", "auto", "driver backend: auto (a GPU if there is one, else the simulator), cuda or sim")
	return fs, backend
}
