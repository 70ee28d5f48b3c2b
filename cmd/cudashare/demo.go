package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"

	"github.com/seed743c36cf/cudashare/internal/app"
)

// envChild marks a child process of the demo. The cudashare binary does
// not need it (its arguments say producer or consumer); a test binary that
// stands in for cudashare reads it to act as the command.
const envChild = "CUDASHARE_DEMO_CHILD"

// runDemo re-runs this executable as the producer and the consumers, with
// the hidden producer and consumer commands. os.Executable is the built
// binary under `go run` too.
func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "cudashare demo: cannot find this executable to run its children: %v\n", err)
		return app.ExitFailure
	}
	return app.RunDemo(ctx, args, stdout, stderr, func(ctx context.Context, role string, args ...string) *exec.Cmd {
		cmd := exec.CommandContext(ctx, exe, append([]string{role}, args...)...)
		cmd.Env = append(os.Environ(), envChild+"=1")
		return cmd
	})
}
