//go:build linux

package share_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// TestWaitOnTogether: several goroutines wait for the same buffer, which a
// consumer released stream-ordered, and the ring's Acquire settles it again
// later. Each must wait for the consumer's events (the simulator's are done
// at once, so what this holds is that no settle returns an error, loses a
// reference or races another: run it with -race), and the exporter ends
// clean. A second settle used to return at once, the events being already
// in the first's hands.
func TestWaitOnTogether(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: share.SharingVMM})
	c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamStream, 1), sharetest.EnvParam(sharetest.ParamAfter, 1))
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(2, 4096)
	if err != nil {
		t.Fatal(err)
	}
	const batches = 100
	for i := range uint64(batches) {
		b, err := r.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), i); err != nil {
			t.Fatal(err)
		}
		if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(i)}); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		errs := make(chan error, 3)
		for range 3 {
			wg.Go(func() { errs <- b.WaitOn(ctx, nil) })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("batch %d: WaitOn: %v", i, err)
			}
		}
	}
	shutdown(t, e)
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	checkConsumer(t, &rep, batches)
}

// TestSettleSeesEveryInFlightEvent: while a later settle (not the first)
// waits for events it took from b.after, a settle that comes after the
// first ended must wait for them too. (A first fix let it return at once.)
func TestSettleSeesEveryInFlightEvent(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: share.SharingVMM})
	r, err := e.NewRing(1, 4096)
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.Acquire(sharetest.Ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	ev1, err := env.Ctx.NewEvent(0)
	if err != nil {
		t.Fatal(err)
	}
	defer ev1.Close()
	ev2, err := env.Ctx.NewEvent(0)
	if err != nil {
		t.Fatal(err)
	}
	defer ev2.Close()
	if !share.SettleMissesInFlight(e, b, ev1, ev2) {
		t.Fatal("a settle coming while another waits for an event it took from b.after would not wait for it: it returns at once")
	}
	b.Free()
	shutdown(t, e)
}

// heldSettle runs the case both tests below share: a buffer from take,
// filled and offered to a consumer that releases stream-ordered, is waited
// for (WaitOn) in another goroutine, whose settle is held in its wait with
// the consumer's events taken (settleWaiting). Meanwhile next(b) runs; it
// may take the buffer again. It returns b, what next returned, and how many
// settles ran before the held one was let go.
func heldSettle(t *testing.T, setup func(*share.Exporter) func(context.Context) (*share.Buffer, error),
	next func(context.Context, *share.Buffer) (*share.Buffer, error)) (b, b2 *share.Buffer, settles int32) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: share.SharingVMM})
	c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamStream, 1), sharetest.EnvParam(sharetest.ParamAfter, 1))
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	take := setup(e)
	b, err := take(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), 0); err != nil {
		t.Fatal(err)
	}
	var n atomic.Int32
	waiting, release := make(chan struct{}), make(chan struct{})
	share.SetSettleWaiting(func() {
		if n.Add(1) == 1 {
			close(waiting)
			<-release
		}
	})
	defer share.SetSettleWaiting(nil)
	if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(0)}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- b.WaitOn(ctx, nil) }()
	select {
	case <-waiting:
	case <-time.After(5 * time.Second):
		t.Fatal("WaitOn never reached its settle (did the consumer release stream-ordered?)")
	}
	nctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	b2, err = next(nctx, b)
	cancel()
	settles = n.Load()
	close(release)
	if werr := <-done; werr != nil {
		t.Fatal(werr)
	}
	if err != nil {
		t.Fatal(err)
	}
	b2.Free()
	shutdown(t, e)
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	checkConsumer(t, &rep, 1)
	return b, b2, settles
}

// TestAcquireWaitsForSettleUnderWay: the producer offers a ring buffer and
// WaitOn's it in another goroutine (as TestWaitOnTogether does); the
// consumer releases it stream-ordered, the buffer returns to the ring, and
// the WaitOn's settle takes its events into b.settling and waits. An Acquire
// now gets the same buffer: it must wait for those events too (take used
// to look at b.after only, which the settle under way had emptied).
func TestAcquireWaitsForSettleUnderWay(t *testing.T) {
	var r *share.Ring
	b, b2, settles := heldSettle(t, func(e *share.Exporter) func(context.Context) (*share.Buffer, error) {
		var err error
		if r, err = e.NewRing(1, 4096); err != nil {
			t.Fatal(err)
		}
		return r.Acquire
	}, func(ctx context.Context, _ *share.Buffer) (*share.Buffer, error) { return r.Acquire(ctx) })
	if settles < 2 {
		t.Errorf("Acquire returned buffer (same: %v) without waiting for the events a settle under way holds: the producer may write it under the consumer's GPU work", b2 == b)
	}
}

// TestArenaFreeDuringSettle: as above for an arena: a WaitOn's settle holds
// the buffer's events in b.settling when the producer frees it: the range
// must not return to the arena before they are done (Free used to look at
// b.after only, and the next Alloc handed it out at once).
func TestArenaFreeDuringSettle(t *testing.T) {
	var a *share.Arena
	alloc := func(ctx context.Context) (*share.Buffer, error) { return a.Alloc(ctx, 4096) }
	b, b2, settles := heldSettle(t, func(e *share.Exporter) func(context.Context) (*share.Buffer, error) {
		var err error
		if a, err = e.NewArena(4096); err != nil {
			t.Fatal(err)
		}
		return alloc
	}, func(ctx context.Context, b *share.Buffer) (*share.Buffer, error) {
		if err := b.Free(); err != nil {
			return nil, err
		}
		return alloc(ctx)
	})
	if settles < 2 && b2.Ptr() == b.Ptr() {
		t.Errorf("Alloc handed out the range (offset %d, freed buffer's %d) without waiting for the events a settle under way holds", b2.Ptr(), b.Ptr())
	}
}
