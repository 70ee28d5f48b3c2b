//go:build linux

package share_test

import (
	"context"
	"log"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/share"
)

// A producer that offers a ring of eight 4 MiB buffers to whoever connects,
// each buffer to one consumer, then retires and frees everything once every
// consumer has closed its mappings.
func ExampleExporter() {
	ctx := context.Background()
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
	defer dctx.Close()
	stream, err := dctx.NewStream(true)
	if err != nil {
		log.Fatal(err)
	}
	defer stream.Close()

	e, err := share.NewExporter(ctx, dctx, "/run/user/1000/loader/sock", share.ExporterConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	ring, err := e.NewRing(8, 4<<20)
	if err != nil {
		log.Fatal(err)
	}
	for batch := 0; batch < 1000; batch++ {
		b, err := ring.Acquire(ctx) // a buffer no consumer holds
		if err != nil {
			log.Fatal(err)
		}
		// Write b.Ptr() on stream, then offer: the consumer's stream
		// waits for this stream's work, not the host.
		if err := e.Offer(ctx, b, share.OfferOptions{Stream: stream}); err != nil {
			log.Fatal(err)
		}
	}
	if err := e.Shutdown(ctx); err != nil {
		log.Fatal(err)
	}
}

// A consumer that takes leases until the producer says goodbye.
func ExampleImporter() {
	ctx := context.Background()
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
	defer dctx.Close()
	stream, err := dctx.NewStream(true)
	if err != nil {
		log.Fatal(err)
	}
	defer stream.Close()

	im, err := share.Dial(ctx, "/run/user/1000/loader/sock", dctx, share.ImporterConfig{Credits: 8, Stream: stream})
	if err != nil {
		log.Fatal(err)
	}
	defer im.Close()
	for {
		l, err := im.Next(ctx)
		if err != nil {
			break // share.ErrProducerGone (with io.EOF after a goodbye)
		}
		// Use l.Ptr(), l.Size() and l.Meta() on stream; finish before
		// the release, after which the producer may write the buffer.
		if err := stream.Synchronize(); err != nil {
			log.Fatal(err)
		}
		l.Release()
	}
	if err := im.Shutdown(ctx); err != nil {
		log.Fatal(err)
	}
}
