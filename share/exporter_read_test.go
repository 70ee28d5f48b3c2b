//go:build linux

package share_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// With one consumer connected, a goroutine waiting in Ring.Acquire,
// Arena.Alloc or Offer reads the consumer's connection itself
// (exporter_read.go). These tests make it wait while the consumer holds what
// it waits for, then end the wait every way it can end: the consumer's
// release, room or a buffer freed by another goroutine or another
// consumer's end, the exporter's Close, the context.

// holdingConsumer starts a raw consumer that takes one offer and holds it.
func holdingConsumer(t *testing.T, e *share.Exporter) *sharetest.Child {
	t.Helper()
	c := sharetest.Start(t, "rawconsumer", sharetest.EnvParam(sharetest.ParamPath, e.Addr()))
	c.Expect("CONNECTED")
	return c
}

// heldRing starts an exporter with sharing, a raw consumer, and a ring of
// one 4 KiB buffer, which the consumer takes and holds.
func heldRing(t *testing.T, env *sharetest.Env, sharing share.Sharing) (*share.Exporter, *share.Ring, *sharetest.Child) {
	t.Helper()
	return heldRingWith(t, env, share.ExporterConfig{Sharing: sharing}, 1)
}

// heldRingWith is heldRing with cfg and a ring of n buffers, the first of
// which the consumer holds.
func heldRingWith(t *testing.T, env *sharetest.Env, cfg share.ExporterConfig, n int) (*share.Exporter, *share.Ring, *sharetest.Child) {
	t.Helper()
	e := newExporterWith(t, env, cfg)
	c := holdingConsumer(t, e)
	if err := e.WaitConsumers(sharetest.Ctx(t), 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(n, 4096)
	if err != nil {
		t.Fatal(err)
	}
	offerRing(t, env, e, r, 0, 1)
	c.Expect("HELD 1")
	return e, r, c
}

// acquireAsync calls r.Acquire(ctx) on its own goroutine, once it has had
// the time to wait (the condition under test, not a timing).
func acquireAsync(r *share.Ring, ctx context.Context) <-chan acquired {
	done := make(chan acquired, 1)
	go func() {
		b, err := r.Acquire(ctx)
		done <- acquired{b, err}
	}()
	time.Sleep(20 * time.Millisecond)
	return done
}

type acquired struct {
	b   *share.Buffer
	err error
}

func waitAcquired(t *testing.T, done <-chan acquired) acquired {
	t.Helper()
	select {
	case a := <-done:
		return a
	case <-time.After(sharetest.ExpectTimeout):
		t.Fatal("Acquire did not return")
		return acquired{}
	}
}

func TestAcquireReadsTheConsumer(t *testing.T) {
	eachWay(t, testAcquireReads, []string{"release", "cancel", "close"})
}

func testAcquireReads(t *testing.T, sharing share.Sharing, how string) {
	env := sharetest.Setup(t)
	e, r, a := heldRing(t, env, sharing)
	ctx := sharetest.Ctx(t)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := acquireAsync(r, wctx)
	switch how {
	case "release":
		a.Send("release")
		if got := waitAcquired(t, done); got.err != nil || got.b == nil {
			t.Fatalf("Acquire after the consumer's release: %v", got.err)
		} else if err := got.b.Free(); err != nil {
			t.Fatal(err)
		}
	case "cancel":
		cancel()
		if got := waitAcquired(t, done); !errors.Is(got.err, context.Canceled) {
			t.Fatalf("Acquire whose context ended: %v", got.err)
		}
		// The connection is whole: the release still comes through.
		a.Send("release")
		b, err := r.Acquire(ctx)
		if err != nil {
			t.Fatalf("Acquire after a cancelled one: %v", err)
		}
		b.Free()
	case "close":
		e.Close()
		if got := waitAcquired(t, done); !errors.Is(got.err, share.ErrClosed) {
			t.Fatalf("Acquire during Close: %v, want ErrClosed", got.err)
		}
		a.Send("exit")
		a.Wait()
		return
	}
	a.Send("exit") // without a goodbye: a raw consumer never says one
	a.Wait()
	shutdown(t, e)
}

// TestAcquireWokenByAnotherConsumer: an Acquire reads the one consumer
// connected, which holds its buffer; the other buffer of the ring is held
// by a consumer whose connection ended while its process lives (it may
// still read it). When that process exits, its buffer comes free (or, with
// VMM, fresh memory takes its place) with nothing arriving on the
// connection being read: the Acquire must be woken for it.
func TestAcquireWokenByAnotherConsumer(t *testing.T) {
	bothPaths(t, func(t *testing.T, sharing share.Sharing) {
		env := sharetest.Setup(t)
		e := newExporterWith(t, env, share.ExporterConfig{Sharing: sharing})
		ctx := sharetest.Ctx(t)
		a := holdingConsumer(t, e)
		b := holdingConsumer(t, e)
		if err := e.WaitConsumers(ctx, 2); err != nil {
			t.Fatal(err)
		}
		r, err := e.NewRing(2, 4096)
		if err != nil {
			t.Fatal(err)
		}
		offerRing(t, env, e, r, 0, 2) // one each: the fewest leases first
		a.Expect("HELD 1")
		b.Expect("HELD 1")
		b.Send("disconnect")
		b.Expect("DISCONNECTED")
		waitUntil(t, "the exporter to see the consumer lost", func() bool { return e.Stats().ConsumersLost == 1 })
		done := acquireAsync(r, ctx)
		b.Send("exit")
		b.Wait()
		got := waitAcquired(t, done)
		if got.err != nil {
			t.Fatalf("Acquire once the lost consumer's process exited: %v", got.err)
		}
		got.b.Free()
		a.Send("release")
		a.Expect("RELEASE")
		a.Send("exit")
		a.Wait()
		shutdown(t, e)
	})
}

// eachWay runs test for both sharing paths and each way a wait may end.
func eachWay(t *testing.T, test func(t *testing.T, sharing share.Sharing, how string), hows []string) {
	bothPaths(t, func(t *testing.T, sharing share.Sharing) {
		for _, how := range hows {
			t.Run(how, func(t *testing.T) { test(t, sharing, how) })
		}
	})
}

// asyncWait runs f on its own goroutine, once it has had the time to wait
// (the condition under test, not a timing).
func asyncWait(f func() error) <-chan error {
	done := make(chan error, 1)
	go func() { done <- f() }()
	time.Sleep(20 * time.Millisecond)
	return done
}

// TestAllocReadsTheConsumer: an arena whose first half the one consumer
// holds and whose second half the producer holds, unoffered; Alloc of a
// half waits, reading the consumer's connection. "free" frees the
// producer's half from another goroutine, with nothing arriving on the
// connection being read: the Alloc must be woken for it.
func TestAllocReadsTheConsumer(t *testing.T) {
	eachWay(t, testAllocReads, []string{"release", "free", "cancel", "close"})
}

func testAllocReads(t *testing.T, sharing share.Sharing, how string) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: sharing})
	c := holdingConsumer(t, e)
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	a, err := e.NewArena(8192)
	if err != nil {
		t.Fatal(err)
	}
	half := a.Available() / 2
	offered, err := a.Alloc(ctx, half)
	if err != nil {
		t.Fatal(err)
	}
	kept, err := a.Alloc(ctx, half)
	if err != nil {
		t.Fatal(err)
	}
	if err := sharetest.Fill(env.Ctx, offered.Ptr(), offered.Size(), 0); err != nil {
		t.Fatal(err)
	}
	if err := e.Offer(ctx, offered, share.OfferOptions{Meta: sharetest.Meta(0)}); err != nil {
		t.Fatal(err)
	}
	offered.Free() // its range comes back with the release
	c.Expect("HELD 1")
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var got *share.Buffer
	done := asyncWait(func() (err error) {
		got, err = a.Alloc(wctx, half)
		return err
	})
	switch how {
	case "release", "free":
		if how == "release" {
			c.Send("release")
		} else {
			kept.Free()
		}
		if err := waitErr(t, "Alloc", done); err != nil || got == nil {
			t.Fatalf("Alloc after the %s: %v", how, err)
		}
		got.Free()
	case "cancel":
		cancel()
		if err := waitErr(t, "Alloc", done); !errors.Is(err, context.Canceled) {
			t.Fatalf("Alloc whose context ended: %v", err)
		}
		// The connection is whole: the release still comes through.
		c.Send("release")
		b, err := a.Alloc(ctx, half)
		if err != nil {
			t.Fatalf("Alloc after a cancelled one: %v", err)
		}
		b.Free()
	case "close":
		e.Close()
		if err := waitErr(t, "Alloc", done); !errors.Is(err, share.ErrClosed) {
			t.Fatalf("Alloc during Close: %v, want ErrClosed", err)
		}
		c.Send("exit")
		c.Wait()
		return
	}
	kept.Free()
	c.Send("exit") // without a goodbye: a raw consumer never says one
	c.Wait()
	shutdown(t, e)
}

// TestOfferReadsTheConsumer: the one consumer may hold one lease and
// holds it; an Offer waits for its credit, reading its connection.
func TestOfferReadsTheConsumer(t *testing.T) {
	eachWay(t, testOfferReads, []string{"release", "cancel", "close"})
}

func testOfferReads(t *testing.T, sharing share.Sharing, how string) {
	env := sharetest.Setup(t)
	e, r, c := heldRingWith(t, env, share.ExporterConfig{Sharing: sharing, MaxLeasesPerConsumer: 1}, 2)
	ctx := sharetest.Ctx(t)
	b, err := r.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), 1); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := asyncWait(func() error { return e.Offer(wctx, b, share.OfferOptions{Meta: sharetest.Meta(1)}) })
	switch how {
	case "release":
		c.Send("release")
		if err := waitErr(t, "Offer", done); err != nil {
			t.Fatalf("Offer after the consumer's release: %v", err)
		}
		if got := e.Stats().Leases; got != 1 {
			t.Fatalf("%d leases after the release and the offer, want 1", got)
		}
	case "cancel":
		cancel()
		if err := waitErr(t, "Offer", done); !errors.Is(err, context.Canceled) {
			t.Fatalf("Offer whose context ended: %v", err)
		}
		// The connection is whole: the release still comes through, and
		// the buffer, never offered, is offered now.
		c.Send("release")
		if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(1)}); err != nil {
			t.Fatalf("Offer after a cancelled one: %v", err)
		}
	case "close":
		e.Close()
		if err := waitErr(t, "Offer", done); !errors.Is(err, share.ErrClosed) {
			t.Fatalf("Offer during Close: %v, want ErrClosed", err)
		}
		c.Send("exit")
		c.Wait()
		return
	}
	c.Send("exit")
	c.Wait()
	shutdown(t, e)
}

// TestAllocStuckConsumer: the one consumer holds the whole arena past the
// lease timeout while an Alloc waits reading its connection. The consumer
// is dropped by the lease clock, not by a message on that connection; the
// Alloc must not hang on it. With legacy IPC its room comes back once the
// consumer's process has exited. With VMM the range is abandoned to the
// lost consumer for good (PROTOCOL.md, section 7.1), so the room can never
// come: the waiting Alloc fails with ErrAbandoned, and so does the next;
// a smaller Alloc from a new arena is served.
func TestAllocStuckConsumer(t *testing.T) {
	bothPaths(t, func(t *testing.T, sharing share.Sharing) {
		env := sharetest.Setup(t)
		e := newExporterWith(t, env, share.ExporterConfig{LeaseTimeout: 300 * time.Millisecond, Sharing: sharing})
		stuck := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamHold, 1))
		ctx := sharetest.Ctx(t)
		if err := e.WaitConsumers(ctx, 1); err != nil {
			t.Fatal(err)
		}
		a, err := e.NewArena(4096)
		if err != nil {
			t.Fatal(err)
		}
		all := a.Available()
		b, err := a.Alloc(ctx, all)
		if err != nil {
			t.Fatal(err)
		}
		if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), 0); err != nil {
			t.Fatal(err)
		}
		if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(0)}); err != nil {
			t.Fatal(err)
		}
		b.Free()
		stuck.Expect("HELD 1")
		var got *share.Buffer
		done := asyncWait(func() (err error) {
			got, err = a.Alloc(ctx, all)
			return err
		})
		waitUntil(t, "the stuck consumer to be dropped", func() bool { return e.Stats().ConsumersDropped == 1 })
		if sharing == share.SharingVMM {
			if err := waitErr(t, "Alloc", done); !errors.Is(err, share.ErrAbandoned) {
				t.Fatalf("Alloc of a VMM arena whose every byte a lost consumer may read: %v, want ErrAbandoned", err)
			}
			if _, err := a.Alloc(ctx, 256); !errors.Is(err, share.ErrAbandoned) {
				t.Fatalf("a second Alloc: %v, want ErrAbandoned", err)
			}
			if s := e.Stats(); s.Abandoned != 1 {
				t.Errorf("exporter stats %+v, want one buffer abandoned", s)
			}
			stuck.Send("release")
			stuck.Wait()
			// What the application does with ErrAbandoned.
			if err := a.Retire(ctx); err != nil {
				t.Fatal(err)
			}
			a2, err := e.NewArena(4096)
			if err != nil {
				t.Fatal(err)
			}
			b2, err := a2.Alloc(ctx, 256)
			if err != nil {
				t.Fatalf("Alloc from a new arena: %v", err)
			}
			b2.Free()
			shutdown(t, e)
			return
		}
		select {
		case err := <-done:
			t.Fatalf("Alloc returned (%v) while a live process may still map its range", err)
		default:
		}
		stuck.Send("release")
		stuck.Wait()
		if err := waitErr(t, "Alloc", done); err != nil {
			t.Fatalf("Alloc after the stuck consumer's exit: %v", err)
		}
		got.Free()
		shutdown(t, e)
	})
}
