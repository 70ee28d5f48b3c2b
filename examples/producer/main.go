// Command producer offers GPU buffers to consumer processes with no copy:
// a ring of reused buffers (or a fresh one per batch from an arena), each
// filled on the GPU with a pattern that encodes its batch number and offered
// over a Unix socket. See internal/app for the code, written to be copied,
// and -h for the flags and exit codes.
//
//	go run ./examples/producer -size 1MiB -ring 8 -duration 10s
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/seed743c36cf/cudashare/internal/app"
)

func main() {
	// SIGINT and SIGTERM end the batches; the producer then shuts down
	// gracefully: it frees its buffers once every consumer has unmapped them.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := app.RunProducer(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
