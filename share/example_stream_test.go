//go:build linux

package share_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log"
	"math"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/pool"
	"github.com/seed743c36cf/cudashare/share"
)

// The examples below run on the simulated driver in `go test` (and on a
// GPU the same). A producer and its consumers are different processes
// (CUDA opens no IPC handle in the process that made it), so each example
// is one side and re-runs the test binary as the other (otherSide), the
// way sharetest does.

const (
	envExampleRole   = "CUDASHARE_EXAMPLE_ROLE"
	envExampleSocket = "CUDASHARE_EXAMPLE_SOCKET"
	exampleBatches   = 8
	exampleFloats    = 1024
)

func init() {
	var run func(string) error
	switch os.Getenv(envExampleRole) {
	case "":
		return
	case "consumer":
		run = exampleConsumer
	case "producer":
		run = exampleProducer
	}
	if err := run(os.Getenv(envExampleSocket)); err != nil {
		fmt.Fprintln(os.Stderr, "example child:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// otherSide starts this test binary as the other side of an example. Its
// stdout goes to the example's; wait reaps it.
func otherSide(role, path string) (wait func() error) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envExampleRole+"="+role, envExampleSocket+"="+path)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Start(); err != nil {
		log.Fatal(err)
	}
	return cmd.Wait
}

func openContext() *driver.Context {
	d, err := driver.Open(driver.Config{})
	if err != nil {
		log.Fatal(err)
	}
	dev, err := d.Device(0)
	if err != nil {
		log.Fatal(err)
	}
	dctx, err := dev.RetainPrimaryContext()
	if err != nil {
		log.Fatal(err)
	}
	return dctx
}

// Metadata: a Go value on the producer's side, the same value (and the
// PROTOCOL.md 4.2 view of it) on the consumer's. A Lease has the same
// methods: l.DecodeMeta(&v), l.View().
func ExampleEncodeMeta() {
	meta, err := share.EncodeMeta(share.ViewMeta{
		DType: "float32", Shape: []uint64{4, 256},
		Extra: map[string]any{"batch": 42},
	})
	if err != nil {
		log.Fatal(err)
	}
	// ... share.OfferOptions{Meta: meta} ... and in the consumer:
	var got share.ViewMeta
	if err := share.DecodeMeta(meta, &got); err != nil {
		log.Fatal(err)
	}
	fmt.Println(got.DType, got.Shape, got.Extra["batch"])

	// JSON is the usual mistake; the error says so.
	err = share.DecodeMeta([]byte(`{"dtype":"float32"}`), &got)
	fmt.Println(errors.Is(err, share.ErrMeta), err)
	// Output:
	// float32 [4 256] 42
	// true share: metadata: meta is JSON, not msgpack: use share.EncodeMeta on the producer
}

// A producer whose batches are written by CUDA work of its own, on a
// stream cudashare did not create (a decoder's, a kernel's through cgo):
// it wraps the raw CUstream, queues an async copy from pinned memory on
// it, and offers each buffer with that stream. Offer does not wait for the
// copy: the consumer's stream waits for it on the GPU. The rule: the work
// that writes a buffer is complete when Offer is called, or
// OfferOptions.Stream is the stream it runs on.
func Example_foreignStream() {
	ctx := context.Background()
	dctx := openContext()
	defer dctx.Close()

	// Stand-in for a stream made outside cudashare: only its raw handle
	// crosses over, as from C. Its maker keeps it and destroys it.
	theirs, err := dctx.NewStream(true)
	if err != nil {
		log.Fatal(err)
	}
	defer theirs.Close()
	s, err := dctx.WrapStream(theirs.Handle())
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close() // destroys nothing: the stream is not ours

	dir, err := os.MkdirTemp("", "cudashare-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "producer.sock")
	e, err := share.NewExporter(ctx, dctx, path, share.ExporterConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	consumerDone := otherSide("consumer", path)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		log.Fatal(err)
	}

	ring, err := e.NewRing(4, 4*exampleFloats)
	if err != nil {
		log.Fatal(err)
	}
	staging, err := dctx.AllocHost(4 * exampleFloats) // pinned: the copies are truly async
	if err != nil {
		log.Fatal(err)
	}
	defer staging.Close()
	for batch := range exampleBatches {
		b, err := ring.AcquireOn(ctx, s) // s waits for the consumers' last reads of b
		if err != nil {
			log.Fatal(err)
		}
		// The previous copy from staging must be done before it is
		// rewritten (two staging buffers would overlap them).
		if err := s.Synchronize(); err != nil {
			log.Fatal(err)
		}
		for i := range exampleFloats {
			binary.LittleEndian.PutUint32(staging.Bytes()[4*i:], math.Float32bits(float32(batch*exampleFloats+i)))
		}
		if err := dctx.CopyHtoDAsync(b.Ptr(), staging.Bytes(), s); err != nil {
			log.Fatal(err)
		}
		meta, err := share.EncodeMeta(share.ViewMeta{DType: "float32", Shape: []uint64{exampleFloats}, Extra: map[string]any{"batch": batch}})
		if err != nil {
			log.Fatal(err)
		}
		if err := e.Offer(ctx, b, share.OfferOptions{Meta: meta, Stream: s}); err != nil {
			log.Fatal(err)
		}
	}
	if err := e.Shutdown(ctx); err != nil {
		log.Fatal(err)
	}
	if err := consumerDone(); err != nil {
		log.Fatal(err)
	}
	// Output:
	// consumer: 8 batches of float32 [1024], every value right
}

// A consumer whose four workers each have a stream of their own
// (pool.Config.Context), so that their GPU work overlaps; each lease is
// released after the work its handler queued (ReleaseAfter), with no host
// wait. SIGINT (Ctrl-C) cancels the context: the pool stops taking
// batches, releases what it holds and says goodbye. Here the producer's
// goodbye ends it.
func Example_workerStreams() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	dctx := openContext()
	defer dctx.Close()

	dir, err := os.MkdirTemp("", "cudashare-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "producer.sock")
	producerDone := otherSide("producer", path)

	// The producer may not be up yet: wait for its socket.
	im, err := share.Dial(ctx, path, dctx, share.ImporterConfig{Credits: 8, DialWait: 30 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	scratch, err := dctx.Alloc(4 * 4 * exampleFloats) // one slot per worker
	if err != nil {
		log.Fatal(err)
	}
	defer dctx.Free(scratch)
	var next, batches atomic.Uint64
	err = pool.RunWith(ctx, im, pool.Config{Workers: 4, Context: dctx, ReleaseAfter: true},
		func(ctx context.Context, l *share.Lease) error {
			dtype, shape, err := l.View()
			if err != nil || dtype != "float32" {
				return fmt.Errorf("batch %d: %s %v: %v", l.Seq(), dtype, shape, err)
			}
			// GPU work on the worker's stream: here a copy; in a trainer,
			// the forward pass. The pool releases the lease after it.
			slot := scratch + driver.DevicePtr(next.Add(1)%4*4*exampleFloats)
			batches.Add(1)
			return dctx.CopyDtoDAsync(slot, l.Ptr(), l.Size(), l.Stream())
		})
	if err != nil {
		log.Fatal(err)
	}
	if err := producerDone(); err != nil {
		log.Fatal(err)
	}
	fmt.Println("consumed", batches.Load(), "batches on 4 worker streams")
	// Output:
	// consumed 8 batches on 4 worker streams
}

// An arena gives a fresh buffer, of any size, per batch with no driver
// call, and a consumer maps it once. Free right after the offer: the
// range comes back once the consumer releases it. Here each buffer is
// written by a synchronous memset, so it is complete when Offer is called
// and no stream goes with it.
func ExampleArena() {
	ctx := context.Background()
	dctx := openContext()
	defer dctx.Close()
	dir, err := os.MkdirTemp("", "cudashare-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "producer.sock")
	e, err := share.NewExporter(ctx, dctx, path, share.ExporterConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	consumerDone := otherSide("consumer", path)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		log.Fatal(err)
	}
	arena, err := e.NewArena(64 << 10)
	if err != nil {
		log.Fatal(err)
	}
	for batch := range exampleBatches {
		b, err := arena.Alloc(ctx, 4*exampleFloats)
		if err != nil {
			log.Fatal(err)
		}
		// float32 batch*1024+i, written by the host here for brevity.
		host := make([]byte, 4*exampleFloats)
		for i := range exampleFloats {
			binary.LittleEndian.PutUint32(host[4*i:], math.Float32bits(float32(batch*exampleFloats+i)))
		}
		if err := dctx.CopyHtoD(b.Ptr(), host); err != nil {
			log.Fatal(err)
		}
		if err := dctx.Synchronize(); err != nil { // the copy from pageable memory has landed
			log.Fatal(err)
		}
		meta, err := share.EncodeMeta(share.ViewMeta{DType: "float32", Shape: []uint64{exampleFloats}, Extra: map[string]any{"batch": batch}})
		if err != nil {
			log.Fatal(err)
		}
		if err := e.Offer(ctx, b, share.OfferOptions{Meta: meta}); err != nil {
			log.Fatal(err)
		}
		b.Free()
	}
	if err := e.Shutdown(ctx); err != nil {
		log.Fatal(err)
	}
	if err := consumerDone(); err != nil {
		log.Fatal(err)
	}
	// Output:
	// consumer: 8 batches of float32 [1024], every value right
}

// exampleConsumer is the consumer side of the producer examples: two
// workers with streams of their own, each checking its batch's values on
// the host (CopyElements stays inside the lease), until the goodbye.
func exampleConsumer(path string) error {
	ctx := context.Background()
	dctx := openContext()
	defer dctx.Close()
	im, err := share.Dial(ctx, path, dctx, share.ImporterConfig{Credits: 4, DialWait: 30 * time.Second})
	if err != nil {
		return err
	}
	var n, wrong atomic.Int64
	err = pool.RunWith(ctx, im, pool.Config{Workers: 2, Context: dctx}, func(ctx context.Context, l *share.Lease) error {
		var m struct {
			Batch int `msgpack:"batch"`
		}
		if err := l.DecodeMeta(&m); err != nil {
			return err
		}
		dtype, shape, err := l.View()
		if err != nil || dtype != "float32" || len(shape) != 1 || shape[0] != exampleFloats {
			return fmt.Errorf("batch %d: %s %v %v", m.Batch, dtype, shape, err)
		}
		v := make([]float32, exampleFloats)
		if _, err := share.CopyElements(l, v); err != nil {
			return err
		}
		for i, x := range v {
			if x != float32(m.Batch*exampleFloats+i) {
				wrong.Add(1)
				break
			}
		}
		n.Add(1)
		return nil
	})
	if err != nil {
		return err
	}
	verdict := "every value right"
	if wrong.Load() > 0 {
		verdict = fmt.Sprintf("%d batches wrong", wrong.Load())
	}
	fmt.Printf("consumer: %d batches of float32 [%d], %s\n", n.Load(), exampleFloats, verdict)
	return nil
}

// exampleProducer is the producer side of Example_workerStreams: a ring of
// four buffers, eight batches written on a stream and offered with it.
func exampleProducer(path string) error {
	ctx := context.Background()
	dctx := openContext()
	defer dctx.Close()
	e, err := share.NewExporter(ctx, dctx, path, share.ExporterConfig{})
	if err != nil {
		return err
	}
	defer e.Close()
	if err := e.WaitConsumers(ctx, 1); err != nil {
		return err
	}
	s, err := dctx.NewStream(true)
	if err != nil {
		return err
	}
	defer s.Close()
	ring, err := e.NewRing(4, 4*exampleFloats)
	if err != nil {
		return err
	}
	for batch := range exampleBatches {
		b, err := ring.AcquireOn(ctx, s)
		if err != nil {
			return err
		}
		if err := dctx.MemsetAsync(b.Ptr(), byte(batch), b.Size(), s); err != nil {
			return err
		}
		meta, err := share.EncodeMeta(share.ViewMeta{DType: "float32", Shape: []uint64{exampleFloats}, Extra: map[string]any{"batch": batch}})
		if err != nil {
			return err
		}
		if err := e.Offer(ctx, b, share.OfferOptions{Meta: meta, Stream: s}); err != nil {
			return err
		}
	}
	return e.Shutdown(ctx)
}
