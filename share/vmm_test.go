//go:build linux

package share_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// TestVMMRingReplacesAbandonedGroup: a ring of 8 x 1 MiB with VMM lies in
// allocations of two buffers each (2 MiB granularity). A consumer lost
// while it holds one buffer does not pin anything: the buffer's allocation
// is replaced with fresh memory, its partner moves over as soon as it is
// idle, the old allocation is retired and freed once nothing but the lost
// consumer maps it, and a good consumer is served throughout with the
// right bytes. The lost consumer still reads what it held.
func TestVMMRingReplacesAbandonedGroup(t *testing.T) {
	env := sharetest.Setup(t)
	mem := env.FreeMemory(t)
	defer env.CheckMemory(t, mem)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: share.SharingVMM})
	if s, _ := e.Sharing(); s != share.SharingVMM {
		t.Fatalf("sharing %s", s)
	}
	lost := sharetest.Start(t, "rawconsumer", sharetest.EnvParam(sharetest.ParamPath, e.Addr()), sharetest.EnvParam(sharetest.ParamHold, 1))
	lost.Expect("CONNECTED")
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(8, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if s := e.Stats(); s.Allocations != 4 {
		t.Fatalf("a ring of 8 x 1 MiB in %d allocations, want 4 of 2 MiB", s.Allocations)
	}
	offerRing(t, env, e, r, 0, 1)
	lost.Expect("HELD 1")
	// The producer holds a buffer of the same allocation while the
	// consumer is lost: it may still offer it, and it moves over after.
	held, err := r.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	lost.Send("disconnect")
	lost.Expect("DISCONNECTED")
	waitUntil(t, "the lost consumer's buffer to be replaced", func() bool { return e.Stats().Replaced == 1 })
	good := startConsumer(t, e)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if err := sharetest.Fill(env.Ctx, held.Ptr(), held.Size(), 1); err != nil {
		t.Fatal(err)
	}
	if err := env.Ctx.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := e.Offer(ctx, held, share.OfferOptions{Meta: sharetest.Meta(1)}); err != nil {
		t.Fatalf("offer of a buffer held across the replacement: %v", err)
	}
	offerRing(t, env, e, r, 2, 200)
	// The old allocation: retired and freed once its other buffer came
	// back, although the lost consumer still maps it.
	waitUntil(t, "the replaced allocation to be freed", func() bool { return e.Stats().Allocations == 4 })
	lost.Send("check")
	lost.Expect("CHECK")
	if s := e.Stats(); s.Abandoned != 1 || s.Replaced != 1 || s.Retired != 1 {
		t.Errorf("exporter stats %+v", s)
	}
	s := shutdown(t, e)
	if s.Offers != 202 || s.Releases != 202 {
		t.Errorf("exporter stats %+v", s)
	}
	var rep sharetest.ConsumerReport
	good.Report(&rep)
	good.Wait()
	checkConsumer(t, &rep, 201)
	lost.Send("exit")
	lost.Wait()
}

// TestVMMArenaAbandonedRange: an arena range a lost consumer held stays
// out of use (it may still read it); the rest of the arena serves on.
func TestVMMArenaAbandonedRange(t *testing.T) {
	env := sharetest.Setup(t)
	mem := env.FreeMemory(t)
	defer env.CheckMemory(t, mem)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: share.SharingVMM})
	lost := sharetest.Start(t, "rawconsumer", sharetest.EnvParam(sharetest.ParamPath, e.Addr()), sharetest.EnvParam(sharetest.ParamHold, 1))
	lost.Expect("CONNECTED")
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	a, err := e.NewArena(4 << 20)
	if err != nil {
		t.Fatal(err)
	}
	size := a.Available()
	b, err := a.Alloc(ctx, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), 0); err != nil {
		t.Fatal(err)
	}
	if err := env.Ctx.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(0)}); err != nil {
		t.Fatal(err)
	}
	b.Free()
	lost.Expect("HELD 1")
	lost.Send("disconnect")
	lost.Expect("DISCONNECTED")
	waitUntil(t, "the range to be abandoned", func() bool { return e.Stats().AbandonedBytes == 1<<20 })
	if got := a.Available(); got != size-1<<20 {
		t.Errorf("arena: %d bytes free, want %d", got, size-1<<20)
	}
	if err := b.Wait(ctx); err == nil {
		t.Errorf("Wait on an abandoned buffer succeeded; want ErrAbandoned")
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := a.Alloc(short, size); err == nil {
		t.Errorf("the whole arena was allocated while a lost consumer may read part of it")
	}
	lost.Send("check")
	lost.Expect("CHECK")
	shutdown(t, e)
	lost.Send("exit")
	lost.Wait()
}

// TestLeaseWaitOn: a lease made ready on one stream can be read on
// another after WaitOn, which queues a wait on the producer's event; after
// Release it refuses.
func TestLeaseWaitOn(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path), sharetest.EnvParam(sharetest.ParamStream, 1),
		sharetest.EnvParam(sharetest.ParamCount, 4))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	s1, err := env.Ctx.NewStream(true)
	if err != nil {
		t.Fatal(err)
	}
	defer s1.Close()
	s2, err := env.Ctx.NewStream(true)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 4, Stream: s1})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	for range 4 {
		l, err := im.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.WaitOn(s2); err != nil {
			t.Fatalf("WaitOn: %v", err)
		}
		n, _ := sharetest.ParseMeta(l.Meta())
		if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), n); err != nil {
			t.Fatal(err)
		}
		if err := l.WaitOn(nil); err != nil {
			t.Fatalf("WaitOn(nil): %v", err)
		}
		l.Release()
		if err := l.WaitOn(s2); !errors.Is(err, share.ErrReleased) {
			t.Fatalf("WaitOn after Release: %v, want ErrReleased", err)
		}
	}
	if err := im.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	p.Wait()
}

// TestVMMRepeatedReplacement: consumers lost one after another, each while
// holding a buffer and while the producer holds another of the same
// allocation, so that replacements chain (a successor is replaced before
// it ever entered the ring). The ring keeps all its buffers, every offer
// succeeds, each replaced allocation is freed once idle, and a good
// consumer gets every batch right.
func TestVMMRepeatedReplacement(t *testing.T) {
	env := sharetest.Setup(t)
	mem := env.FreeMemory(t)
	defer env.CheckMemory(t, mem)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: share.SharingVMM})
	good := startConsumer(t, e)
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	const n = 8
	r, err := e.NewRing(n, 1<<20) // four allocations of two buffers
	if err != nil {
		t.Fatal(err)
	}
	batch := 0
	offer := func(b *share.Buffer) {
		t.Helper()
		if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), uint64(batch)); err != nil {
			t.Fatal(err)
		}
		if err := env.Ctx.Synchronize(); err != nil {
			t.Fatal(err)
		}
		if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(uint64(batch))}); err != nil {
			t.Fatalf("offer of batch %d: %v", batch, err)
		}
		batch++
	}
	const rounds = 6
	var held []*share.Buffer
	for round := range rounds {
		lost := sharetest.Start(t, "rawconsumer", sharetest.EnvParam(sharetest.ParamPath, e.Addr()), sharetest.EnvParam(sharetest.ParamHold, 1))
		lost.Expect("CONNECTED")
		if err := e.WaitConsumers(ctx, 2); err != nil {
			t.Fatal(err)
		}
		// Offer until the lost consumer holds one (the good one is picked
		// too: the fewest leases first).
		holds := make(chan struct{})
		go func() { lost.Expect("HELD 1"); close(holds) }()
		for waiting := true; waiting; {
			b, err := r.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			offer(b)
			select {
			case <-holds:
				waiting = false
			case <-time.After(time.Millisecond):
			}
		}
		// Held across two replacements: its successor is replaced before
		// it ever enters the ring.
		b, err := r.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, b)
		lost.Send("disconnect")
		lost.Expect("DISCONNECTED")
		waitUntil(t, "the replacement", func() bool { return e.Stats().Replaced >= uint64(round+1) })
		lost.Send("exit")
		lost.Wait()
		if len(held) == 2 {
			offer(held[0])
			held = held[1:]
		}
		for range 2 * n {
			b, err := r.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			offer(b)
		}
	}
	for _, b := range held {
		offer(b)
	}
	waitUntil(t, "the replaced allocations to be freed", func() bool { return e.Stats().Allocations == 4 })
	s := shutdown(t, e)
	if s.Replaced < rounds || s.Offers != uint64(batch) || s.Releases != uint64(batch) {
		t.Errorf("exporter stats %+v after %d offers", s, batch)
	}
	var rep sharetest.ConsumerReport
	good.Report(&rep)
	good.Wait()
	checkConsumer(t, &rep, rep.Leases)
}

// TestVMMUnsealedAllocationRefused: a producer on the simulator that sends
// an allocation's memfd unsealed (a genuine header, so only the seals can
// tell) could shrink it under the consumer's mapping and kill the consumer
// with SIGBUS at its next read. The consumer refuses it with an error that
// names the cause, releases the offer, and goes on with the next one.
func TestVMMUnsealedAllocationRefused(t *testing.T) {
	env := sharetest.Setup(t)
	if !env.Sim() {
		t.Skip("the simulator's memfds only: the real driver's handles are not files")
	}
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "unsealed", sharetest.EnvParam(sharetest.ParamPath, path))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	l, err := im.Next(ctx)
	if err == nil {
		l.Release()
		t.Fatal("the consumer took an unsealed memfd")
	}
	if !errors.Is(err, driver.ErrUnknown) || !strings.Contains(err.Error(), "not sealed against shrinking and growing") {
		t.Fatalf("offer of the unsealed memfd: %v, want CUDA_ERROR_UNKNOWN naming the missing seals", err)
	}
	t.Logf("refused: %v", err)
	l, err = im.Next(ctx)
	if err != nil {
		t.Fatalf("the genuine allocation after the refused one: %v", err)
	}
	if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), 3); err != nil {
		t.Fatal(err)
	}
	l.Release()
	if _, err := im.Next(ctx); !errors.Is(err, io.EOF) {
		t.Fatalf("Next after the producer's goodbye: %v, want io.EOF", err)
	}
	var rep sharetest.RawReport
	p.Report(&rep)
	p.Wait()
	if rep.Releases != 2 || !rep.Closed {
		t.Errorf("producer: %+v, want both offers released and the genuine allocation closed", rep)
	}
	if err := im.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
}
