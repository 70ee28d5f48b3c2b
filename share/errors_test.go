//go:build linux

package share_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
)

// TestMisuseSentinels: a buffer of another exporter and Free of a
// registered buffer fail with sentinels a caller can match, not only text.
func TestMisuseSentinels(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	e1, e2 := newExporter(t, env), newExporter(t, env)
	r, err := e2.NewRing(1, 64)
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := e1.Offer(ctx, b, share.OfferOptions{}); !errors.Is(err, share.ErrForeignBuffer) {
		t.Errorf("Offer of another exporter's buffer: %v, want ErrForeignBuffer", err)
	}
	if _, err := e1.Broadcast(ctx, b, share.OfferOptions{}); !errors.Is(err, share.ErrForeignBuffer) {
		t.Errorf("Broadcast of another exporter's buffer: %v, want ErrForeignBuffer", err)
	}
	if err := e1.Retire(ctx, b); !errors.Is(err, share.ErrForeignBuffer) {
		t.Errorf("Retire of another exporter's buffer: %v, want ErrForeignBuffer", err)
	}
	if err := e1.Offer(ctx, nil, share.OfferOptions{}); !errors.Is(err, share.ErrForeignBuffer) {
		t.Errorf("Offer(nil): %v, want ErrForeignBuffer", err)
	}

	p, err := env.Ctx.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer env.Ctx.Free(p)
	rb, err := e1.Register(p, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := rb.Free(); !errors.Is(err, share.ErrRegistered) {
		t.Errorf("Free of a registered buffer: %v, want ErrRegistered", err)
	}
	if err := e1.Retire(ctx, rb); err != nil {
		t.Errorf("Retire of the registered buffer: %v", err)
	}
}

// TestErrClosedIsOneValue: share.ErrClosed, transport.ErrClosed and
// driver.ErrClosed are one value, so a "closed" from any layer, wrapped,
// matches whichever of the three names a caller holds.
func TestErrClosedIsOneValue(t *testing.T) {
	names := map[string]error{"share": share.ErrClosed, "transport": transport.ErrClosed, "driver": driver.ErrClosed}
	for from, err := range names {
		wrapped := fmt.Errorf("%s: something: %w", from, err)
		for name, target := range names {
			if !errors.Is(wrapped, target) {
				t.Errorf("%s.ErrClosed, wrapped (%v), does not match %s.ErrClosed", from, wrapped, name)
			}
		}
	}
}

// TestImporterClosedErrors: after the importer's Close, its calls and its
// leases' calls fail with ErrClosed (one value in every layer), whatever
// the layer below reported (a closed connection, a closed mapping), and
// not with ErrProducerGone: the producer did not go.
func TestImporterClosedErrors(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 2})
	if err != nil {
		t.Fatal(err)
	}
	l, err := im.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := im.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = im.Next(ctx)
	if !errors.Is(err, share.ErrClosed) {
		t.Errorf("Next after Close: %v, want share.ErrClosed", err)
	}
	if errors.Is(err, share.ErrProducerGone) {
		t.Errorf("Next after Close: %v matches share.ErrProducerGone", err)
	}
	buf := make([]byte, 64)
	if _, err := l.CopyToHost(buf); !errors.Is(err, share.ErrClosed) {
		t.Errorf("CopyToHost of a lease after the importer's Close: %v, want share.ErrClosed", err)
	}
	l.Release()
	if err := im.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	p.Wait()
}
