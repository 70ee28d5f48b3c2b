//go:build linux

package transport_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"os"
	"path/filepath"

	"github.com/seed743c36cf/cudashare/transport"
)

// A producer listens, a consumer dials; the producer offers a buffer and
// the consumer releases it. In real use the two are separate processes.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "cudashare-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "run", "producer.sock") // run/ is made 0700

	l, err := transport.Listen(ctx, path, transport.DefaultConfig(transport.RoleProducer))
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()

	consumer, err := transport.Dial(ctx, path, transport.DefaultConfig(transport.RoleConsumer))
	if err != nil {
		log.Fatal(err)
	}
	defer consumer.Close()
	producer, err := l.Accept(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer producer.Close()

	offer := transport.Offer{Seq: 1, AllocID: 7, AllocSize: 1 << 20, Size: 4096}
	if err := producer.SendOffer(ctx, &offer); err != nil {
		log.Fatal(err)
	}

	var m transport.Message
	if err := consumer.Recv(ctx, &m); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("consumer got %s seq %d: %d bytes of allocation %d\n", m.Kind, m.Offer.Seq, m.Offer.Size, m.Offer.AllocID)
	if err := consumer.SendRelease(ctx, m.Offer.Seq); err != nil {
		log.Fatal(err)
	}

	if err := producer.Recv(ctx, &m); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("producer got %s of %v\n", m.Kind, m.Seqs)

	producer.Shutdown(ctx, "done")
	consumer.Recv(ctx, &m)
	fmt.Printf("consumer got %s: %s\n", m.Kind, m.Reason)
	fmt.Println(consumer.Recv(ctx, &m) == io.EOF)
	// Output:
	// consumer got offer seq 1: 4096 bytes of allocation 7
	// producer got release of [1]
	// consumer got goodbye: done
	// true
}
