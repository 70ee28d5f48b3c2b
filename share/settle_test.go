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

// TestAcquireWaitsForSettleUnderWay: the producer offers a ring buffer and
// WaitOn's it in another goroutine (as TestWaitOnTogether does); the
// consumer releases it stream-ordered, the buffer returns to the ring, and
// the WaitOn's settle takes its events into b.settling and waits. An Acquire
// now gets the same buffer: it must wait for those events too (take used
// to look at b.after only, which the settle under way had emptied).
func TestAcquireWaitsForSettleUnderWay(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: share.SharingVMM})
	c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamStream, 1), sharetest.EnvParam(sharetest.ParamAfter, 1))
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(1, 4096)
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), 0); err != nil {
		t.Fatal(err)
	}
	var settles atomic.Int32
	waiting, release := make(chan struct{}), make(chan struct{})
	share.SetSettleWaiting(func() {
		if settles.Add(1) == 1 {
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
	actx, cancel := context.WithTimeout(ctx, 3*time.Second)
	b2, err := r.Acquire(actx)
	cancel()
	got := settles.Load()
	close(release)
	if werr := <-done; werr != nil {
		t.Fatal(werr)
	}
	if err != nil {
		t.Fatal(err)
	}
	if got < 2 {
		t.Errorf("Acquire returned buffer (same: %v) without waiting for the events a settle under way holds: the producer may write it under the consumer's GPU work", b2 == b)
	}
	b2.Free()
	shutdown(t, e)
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	checkConsumer(t, &rep, 1)
}

// TestArenaFreeDuringSettle: as above for an arena: a WaitOn's settle holds
// the buffer's events in b.settling when the producer frees it: the range
// must not return to the arena before they are done (Free used to look at
// b.after only, and the next Alloc handed it out at once).
func TestArenaFreeDuringSettle(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: share.SharingVMM})
	c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamStream, 1), sharetest.EnvParam(sharetest.ParamAfter, 1))
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	a, err := e.NewArena(4096)
	if err != nil {
		t.Fatal(err)
	}
	b, err := a.Alloc(ctx, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), 0); err != nil {
		t.Fatal(err)
	}
	var settles atomic.Int32
	waiting, release := make(chan struct{}), make(chan struct{})
	share.SetSettleWaiting(func() {
		if settles.Add(1) == 1 {
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
		t.Fatal("WaitOn never reached its settle")
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	actx, cancel := context.WithTimeout(ctx, 3*time.Second)
	b2, err := a.Alloc(actx, 4096)
	cancel()
	got := settles.Load()
	close(release)
	if werr := <-done; werr != nil {
		t.Fatal(werr)
	}
	if err != nil {
		t.Fatal(err)
	}
	if got < 2 && b2.Ptr() == b.Ptr() {
		t.Errorf("Alloc handed out the range (offset %d, freed buffer's %d) without waiting for the events a settle under way holds", b2.Ptr(), b.Ptr())
	}
	b2.Free()
	shutdown(t, e)
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	checkConsumer(t, &rep, 1)
}
