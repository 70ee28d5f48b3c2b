// Command loader is the producer of the pipeline example: it reads the
// JPEG shards that examples/datagen writes, decodes them on the GPU with
// nvJPEG (batched; the GPU's JPEG engines where it has them) or on the CPU
// with image/jpeg (where nvJPEG is absent, as on the simulator, or with
// -decode cpu), crops each image to -crop x -crop at a random place, and
// lends each batch of -batch images, uint8 NCHW, to a consumer process
// (examples/python/train.py) through cudashare, in place: a ring of GPU
// buffers, the labels, keys and crop offsets in each offer's metadata with
// its dtype and shape (PROTOCOL.md 4.2), offered stream-ordered.
//
//	go run ./examples/datagen -out /tmp/ds -images 2000
//	go run ./examples/loader -data /tmp/ds -socket /tmp/loader.sock &
//	python3 examples/python/train.py --source cudashare --socket /tmp/loader.sock --data /tmp/ds
//
// The last line on stdout is a JSON report: images/s, the process's CPU
// time, the time spent decoding. -consumers 0 decodes with no consumer (the
// loader's own rate); -selfcheck K decodes K images with nvJPEG and with
// image/jpeg and compares them (PASS/FAIL).
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
