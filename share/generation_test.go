//go:build linux

package share_test

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
)

// TestGenerationGrowsOnReuse: an offer's generation is larger for every
// later offer of the same range of an allocation (PROTOCOL.md section 4,
// offer), an arena's fresh buffers included: they reuse the offsets of
// those freed before them. It was 1 for every arena buffer, so a consumer
// could not tell the second offer of an offset from the first.
func TestGenerationGrowsOnReuse(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	e := newExporterWith(t, env, share.ExporterConfig{})
	defer e.Close() // before the leak check dialIn arms
	r, err := e.NewRing(1, 256)
	if err != nil {
		t.Fatal(err)
	}
	a, err := e.NewArena(256)
	if err != nil {
		t.Fatal(err)
	}
	conn := dialIn(t, e, 1, false)
	defer conn.Close()
	seen := map[[2]uint64]uint64{} // alloc, offset -> last generation
	offerOnce := func(what string, take func() (*share.Buffer, error)) {
		t.Helper()
		b, err := take()
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Offer(ctx, b, share.OfferOptions{}); err != nil {
			t.Fatal(err)
		}
		b.Free()
		var m transport.Message
		if err := conn.Recv(ctx, &m); err != nil || m.Kind != transport.KindOffer {
			t.Fatalf("Recv: %v, %v; want an offer", err, m.Kind)
		}
		for _, fd := range m.Offer.FDs {
			unix.Close(fd)
		}
		o := &m.Offer
		k := [2]uint64{o.AllocID, o.Offset}
		if last, ok := seen[k]; ok && o.Generation <= last {
			t.Errorf("%s: allocation %d offset %d offered again with generation %d, after %d", what, o.AllocID, o.Offset, o.Generation, last)
		}
		if o.Generation == 0 {
			t.Errorf("%s: generation 0, want from 1", what)
		}
		seen[k] = o.Generation
		if err := conn.SendRelease(ctx, o.Seq); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		offerOnce("ring", func() (*share.Buffer, error) { return r.Acquire(ctx) })
		offerOnce("arena", func() (*share.Buffer, error) { return a.Alloc(ctx, 256) })
	}
}
