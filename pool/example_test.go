//go:build linux

package pool_test

import (
	"context"
	"log"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/pool"
	"github.com/seed743c36cf/cudashare/share"
)

// A consumer that runs four workers over the buffers of a producer until
// the producer says goodbye. The pool releases every lease after its
// handler, and closes every mapping before the importer's goodbye.
func Example() {
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
	err = pool.Run(ctx, im, 4, func(ctx context.Context, l *share.Lease) error {
		// Use l.Ptr() and l.Size() on stream; the producer's writes are
		// ordered before that work. Finish with it before returning.
		return stream.Synchronize()
	})
	if err != nil {
		log.Fatal(err)
	}
}
