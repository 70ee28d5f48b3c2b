// Command consumer maps a producer's GPU buffers and uses them in place:
// a pool of workers checks each batch's content on the GPU side and
// releases it, and the consumer reports handoffs per second and latency.
// See internal/app for the code, written to be copied, and -h for the flags
// and exit codes.
//
//	go run ./examples/consumer -workers 2 -verify every
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/seed743c36cf/cudashare/internal/app"
)

func main() {
	// SIGINT and SIGTERM stop the consumer gracefully: it releases what it
	// holds, closes its mappings and says goodbye.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := app.RunConsumer(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
