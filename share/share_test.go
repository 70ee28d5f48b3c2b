//go:build linux

package share_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// newExporter starts an exporter on a fresh socket in env's context of
// device 0, shut down at the end of the test.
func newExporter(t testing.TB, env *sharetest.Env) *share.Exporter {
	t.Helper()
	e, err := share.NewExporter(sharetest.Ctx(t), env.Ctx, sharetest.SocketPath(t), share.ExporterConfig{Logger: sharetest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// startConsumer runs the consumer routine against e.
func startConsumer(t testing.TB, e *share.Exporter, params ...string) *sharetest.Child {
	t.Helper()
	c := sharetest.Start(t, "consumer", append([]string{sharetest.EnvParam(sharetest.ParamPath, e.Addr())}, params...)...)
	c.Expect("CONNECTED")
	return c
}

// startConsumers starts n consumers with params and waits until the
// exporter has them all.
func startConsumers(t testing.TB, e *share.Exporter, n int, params ...string) {
	t.Helper()
	for range n {
		startConsumer(t, e, params...)
	}
	if err := e.WaitConsumers(sharetest.Ctx(t), n); err != nil {
		t.Fatal(err)
	}
}

// acquireFilled makes a ring of n 4 KiB buffers and acquires one, its
// batch 0 pattern written and synchronized.
func acquireFilled(t testing.TB, env *sharetest.Env, e *share.Exporter, n int) (*share.Ring, *share.Buffer) {
	t.Helper()
	ctx := sharetest.Ctx(t)
	r, err := e.NewRing(n, 4096)
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
	if err := env.Ctx.Synchronize(); err != nil {
		t.Fatal(err)
	}
	return r, b
}

// offerRing acquires, fills and offers n buffers of r, numbered from first.
func offerRing(t *testing.T, env *sharetest.Env, e *share.Exporter, r *share.Ring, first, n int) {
	t.Helper()
	ctx := sharetest.Ctx(t)
	for i := first; i < first+n; i++ {
		b, err := r.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), uint64(i)); err != nil {
			t.Fatal(err)
		}
		// No event travels, so the bytes must be on the device before the
		// offer (OfferOptions.Stream): a synchronous copy from pageable
		// memory can return before its DMA lands (seen on an H100, in one
		// batch of 78,000).
		if err := env.Ctx.Synchronize(); err != nil {
			t.Fatal(err)
		}
		if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(uint64(i))}); err != nil {
			t.Fatal(err)
		}
	}
}

// shutdown shuts e down and checks that it freed everything.
func shutdown(t testing.TB, e *share.Exporter) share.ExporterStats {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), sharetest.ExpectTimeout)
	defer cancel()
	if err := e.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	s := e.Stats()
	if s.Allocations != 0 || s.Leases != 0 {
		t.Errorf("after Shutdown: %d allocations and %d leases left", s.Allocations, s.Leases)
	}
	return s
}

// checkConsumer checks a consumer's report: every lease right, no error,
// a clean end, nothing left mapped.
func checkConsumer(t *testing.T, rep *sharetest.ConsumerReport, leases int) {
	t.Helper()
	if rep.Leases != leases {
		t.Errorf("consumer got %d leases, want %d", rep.Leases, leases)
	}
	if len(rep.Bad) > 0 || len(rep.Errors) > 0 {
		t.Errorf("consumer: bad leases %q, errors %q", rep.Bad, rep.Errors)
	}
	if !rep.EOF {
		t.Errorf("consumer did not see a goodbye (gone: %q)", rep.Gone)
	}
	if rep.ShutdownErr != "" {
		t.Errorf("consumer's Shutdown: %s", rep.ShutdownErr)
	}
	if rep.Registry.Mappings != 0 || rep.Stats.Mappings != 0 || rep.Stats.Held != 0 {
		t.Errorf("consumer left %d mappings open (%d by its importer), %d leases held",
			rep.Registry.Mappings, rep.Stats.Mappings, rep.Stats.Held)
	}
	if rep.Registry.Opens != rep.Registry.Closes {
		t.Errorf("consumer opened %d mappings and closed %d", rep.Registry.Opens, rep.Registry.Closes)
	}
	if rep.Stats.Leaked != 0 {
		t.Errorf("consumer leaked %d leases", rep.Stats.Leaked)
	}
}

// TestRingCachedOpen proves the ring case end to end across two
// processes: 200 handoffs of 4 reused buffers arrive with the right bytes
// and metadata, the consumer opens the ring's allocation exactly once,
// and Shutdown retires and frees it after the consumer closed its mapping,
// with no lifetime violation.
func TestRingCachedOpen(t *testing.T) {
	env := sharetest.Setup(t)
	mem := env.FreeMemory(t)
	defer env.CheckMemory(t, mem)
	e := newExporter(t, env)
	c := startConsumer(t, e)
	if err := e.WaitConsumers(sharetest.Ctx(t), 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(4, 4096)
	if err != nil {
		t.Fatal(err)
	}
	offerRing(t, env, e, r, 0, 200)
	s := shutdown(t, e)
	if s.Offers != 200 || s.Releases != 200 || s.Retired != 1 || s.ConsumersLost != 0 {
		t.Errorf("exporter stats %+v", s)
	}
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	checkConsumer(t, &rep, 200)
	if rep.Registry.Opens != 1 {
		t.Errorf("consumer opened the ring %d times, want once", rep.Registry.Opens)
	}
	if rep.Stats.Retired != 1 {
		t.Errorf("consumer confirmed %d retirements, want 1", rep.Stats.Retired)
	}
}

// TestRetireWaitsForLease proves that Retire never frees early: with a
// consumer holding a lease in a registered allocation, Retire waits (and
// gives up with its context, leaving the memory mapped), and completes
// once the lease is released and the consumer has closed its mapping;
// only then may the owner free it. The buffer is registered by an
// interior pointer: the offer carries the base's handle and the offset.
func TestRetireWaitsForLease(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporter(t, env)
	c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamHold, 1))
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	p, err := env.Ctx.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	b, err := e.Register(p+4096, 8192)
	if err != nil {
		t.Fatal(err)
	}
	if b.Ptr() != p+4096 || b.Size() != 8192 {
		t.Fatalf("registered buffer at %#x+%d, want %#x+8192", uint64(b.Ptr()), b.Size(), uint64(p+4096))
	}
	if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), 42); err != nil {
		t.Fatal(err)
	}
	if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(42)}); err != nil {
		t.Fatal(err)
	}
	c.Expect("HELD 1")

	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if err := b.Wait(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait with the buffer leased: %v, want the deadline", err)
	}
	short, cancel = context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if err := e.Retire(short, b); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Retire with a lease held: %v, want the deadline", err)
	}
	if n := b.Leases(); n != 1 {
		t.Fatalf("leases after the failed Retire: %d, want 1", n)
	}
	if err := e.Offer(ctx, b, share.OfferOptions{}); !errors.Is(err, share.ErrRetired) {
		t.Fatalf("Offer while retiring: %v, want ErrRetired", err)
	}
	c.Send("release")
	if err := e.Retire(ctx, b); err != nil {
		t.Fatalf("Retire after the release: %v", err)
	}
	// Retire has returned: no consumer maps the memory, its owner frees it.
	if err := env.Ctx.Free(p); err != nil {
		t.Fatalf("free after Retire: %v", err)
	}
	s := shutdown(t, e)
	if s.Retired != 1 || s.Offers != 1 || s.Releases != 1 {
		t.Errorf("exporter stats %+v", s)
	}
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	checkConsumer(t, &rep, 1)
	if rep.Stats.Retired != 1 {
		t.Errorf("consumer confirmed %d retirements, want 1", rep.Stats.Retired)
	}
}

// TestConsumerKilled proves that a consumer killed with SIGKILL while it
// holds leases loses them and its mappings once its process is gone: a
// retirement waiting on it completes, the ring's buffers come back, and
// the ring is freed, with no lifetime violation (the strict simulator
// refuses a free while a live process maps the memory).
func TestConsumerKilled(t *testing.T) {
	env := sharetest.Setup(t)
	mem := env.FreeMemory(t)
	defer env.CheckMemory(t, mem)
	e := newExporter(t, env)
	c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamHold, 2), sharetest.EnvParam(sharetest.ParamCredits, 2))
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(2, 4096)
	if err != nil {
		t.Fatal(err)
	}
	offerRing(t, env, e, r, 0, 2)
	c.Expect("HELD 2")
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if _, err := r.Acquire(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Acquire with every buffer leased: %v, want the deadline", err)
	}
	retired := make(chan error, 1)
	go func() { retired <- r.Retire(ctx) }()
	select {
	case err := <-retired:
		t.Fatalf("Retire returned (%v) while a live consumer held leases", err)
	case <-time.After(200 * time.Millisecond):
	}
	c.Kill()
	if err := <-retired; err != nil {
		t.Fatalf("Retire after the consumer died: %v", err)
	}
	s := e.Stats()
	if s.ConsumersLost != 1 || s.Leases != 0 || s.Releases != 2 || s.Retired != 1 || s.Consumers != 0 {
		t.Errorf("exporter stats after the kill: %+v", s)
	}
	if _, err := r.Acquire(ctx); !errors.Is(err, share.ErrRetired) {
		t.Errorf("Acquire from the retired ring: %v, want ErrRetired", err)
	}
	shutdown(t, e)
}

// TestProducerKilled proves the consumer's side of a producer that dies:
// Next returns ErrProducerGone (not a clean end) promptly instead of
// hanging, a lease held across the death stays readable (the mapping keeps
// the memory) until released, and then every mapping is closed.
//
// With VMM the consumer's own mapping keeps the memory: the batch it
// holds reads right after the producer's death on a real GPU too.
func TestProducerKilled(t *testing.T) { bothPaths(t, testProducerKilled) }

func testProducerKilled(t *testing.T, sharing share.Sharing) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path), sharetest.EnvParam(sharetest.ParamSharing, sharing))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	l, err := im.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	n, _ := sharetest.ParseMeta(l.Meta())
	p.Kill()
	for {
		l2, err := im.Next(ctx)
		if err != nil {
			if !errors.Is(err, share.ErrProducerGone) || errors.Is(err, io.EOF) {
				t.Fatalf("Next after the producer died: %v, want ErrProducerGone without a goodbye", err)
			}
			break
		}
		l2.Release() // offers that arrived before the death
	}
	if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), n); err != nil {
		t.Fatalf("lease held across the producer's death: %v", err)
	}
	l.Release()
	l.Release()
	if m := im.Registry().Mappings(); m != 0 {
		t.Errorf("%d mappings open after the producer died and the lease was released", m)
	}
	if err := im.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := im.Next(ctx); !errors.Is(err, share.ErrProducerGone) && !errors.Is(err, share.ErrClosed) {
		t.Errorf("Next after Shutdown: %v", err)
	}
}

// TestBroadcast proves that Broadcast offers every buffer to every
// consumer that keeps up, and to no consumer more than its backlog allows:
// every offer is accounted for as sent or missed, every lease a consumer
// got has the right bytes, and each consumer maps the ring once.
func TestBroadcast(t *testing.T) {
	env := sharetest.Setup(t)
	mem := env.FreeMemory(t)
	defer env.CheckMemory(t, mem)
	e := newExporter(t, env)
	cs := make([]*sharetest.Child, 3)
	for i := range cs {
		cs[i] = startConsumer(t, e)
	}
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, len(cs)); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(4, 4096)
	if err != nil {
		t.Fatal(err)
	}
	const count = 30
	reached := 0
	for i := range count {
		b, err := r.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), uint64(i)); err != nil {
			t.Fatal(err)
		}
		n, err := e.Broadcast(ctx, b, share.OfferOptions{Meta: sharetest.Meta(uint64(i))})
		if err != nil || n < 1 || n > len(cs) {
			t.Fatalf("Broadcast reached %d consumers (%v), want 1 to %d", n, err, len(cs))
		}
		reached += n
	}
	s := shutdown(t, e)
	if s.Offers != uint64(reached) || s.Releases != s.Offers || s.Offers+s.BroadcastMissed != count*uint64(len(cs)) {
		t.Errorf("exporter stats %+v; %d reached", s, reached)
	}
	got := 0
	for _, c := range cs {
		var rep sharetest.ConsumerReport
		c.Report(&rep)
		c.Wait()
		checkConsumer(t, &rep, rep.Leases)
		got += rep.Leases
		if rep.Registry.Opens != 1 {
			t.Errorf("a consumer opened the ring %d times, want once", rep.Registry.Opens)
		}
	}
	if got != reached {
		t.Errorf("consumers got %d leases, Broadcast reached %d", got, reached)
	}
}

// TestCreditsRespected proves that a consumer never holds more leases
// than its credits: an offer waits while the only consumer is full, and
// with a second consumer every offer goes to the one with credit.
func TestCreditsRespected(t *testing.T) {
	env := sharetest.Setup(t)
	mem := env.FreeMemory(t)
	defer env.CheckMemory(t, mem)
	e := newExporter(t, env)
	a := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamCredits, 2), sharetest.EnvParam(sharetest.ParamHold, 2))
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(8, 4096)
	if err != nil {
		t.Fatal(err)
	}
	offerRing(t, env, e, r, 0, 2)
	a.Expect("HELD 2")
	b, err := r.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if err := e.Offer(short, b, share.OfferOptions{Meta: sharetest.Meta(99)}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("third offer to a consumer with 2 credits: %v, want to wait until the deadline", err)
	}
	if err := b.Free(); err != nil { // back to the ring, never offered
		t.Fatal(err)
	}
	bc := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamCredits, 4))
	if err := e.WaitConsumers(ctx, 2); err != nil {
		t.Fatal(err)
	}
	offerRing(t, env, e, r, 2, 20)
	a.Send("release")
	a.Expect("RELEASED")
	shutdown(t, e)
	var ra, rb sharetest.ConsumerReport
	a.Report(&ra)
	bc.Report(&rb)
	a.Wait()
	bc.Wait()
	checkConsumer(t, &ra, 2)
	checkConsumer(t, &rb, 20)
}

// TestArenaFreshBuffers proves the fresh-buffer path: 300 buffers of
// varied sizes sub-allocated from one arena, each freed right after its
// offer, arrive intact; the arena's ranges all come back; and the
// consumer maps the arena once.
func TestArenaFreshBuffers(t *testing.T) {
	env := sharetest.Setup(t)
	mem := env.FreeMemory(t)
	defer env.CheckMemory(t, mem)
	e := newExporter(t, env)
	c := startConsumer(t, e)
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	a, err := e.NewArena(256 << 10)
	if err != nil {
		t.Fatal(err)
	}
	arenaSize := a.Available() // with VMM, rounded up to the granularity
	const count = 300
	for i := range count {
		b, err := a.Alloc(ctx, uint64(24+i*37%20000))
		if err != nil {
			t.Fatal(err)
		}
		if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), uint64(i)); err != nil {
			t.Fatal(err)
		}
		if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(uint64(i))}); err != nil {
			t.Fatal(err)
		}
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
		if err := b.Free(); err != nil {
			t.Fatalf("second Free: %v", err)
		}
	}
	for deadline := time.Now().Add(sharetest.ExpectTimeout); a.Available() != arenaSize; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("arena has %d of %d bytes free after every release", a.Available(), arenaSize)
		}
	}
	if _, err := a.Alloc(ctx, arenaSize+1); err == nil {
		t.Error("Alloc larger than the arena succeeded")
	}
	shutdown(t, e)
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	checkConsumer(t, &rep, count)
	if rep.Registry.Opens != 1 {
		t.Errorf("consumer opened the arena %d times, want once", rep.Registry.Opens)
	}
}

// TestArenaBuffersNotReused: Alloc allocates no object of its own per
// buffer (Buffers come in blocks), and a Buffer kept after Free is never
// handed out again: its second Free, after many Allocs, gives back nothing
// that a later buffer holds.
func TestArenaBuffersNotReused(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporter(t, env)
	ctx := sharetest.Ctx(t)
	a, err := e.NewArena(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	room := a.Available()
	old, err := a.Alloc(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	ptr := old.Ptr()
	if err := old.Free(); err != nil {
		t.Fatal(err)
	}
	held, err := a.Alloc(ctx, 100) // most likely the range old had
	if err != nil {
		t.Fatal(err)
	}
	var fail error
	allocs := testing.AllocsPerRun(500, func() {
		b, err := a.Alloc(ctx, 4096)
		if err == nil {
			err = b.Free()
		}
		if err != nil && fail == nil {
			fail = err
		}
	})
	if fail != nil {
		t.Fatal(fail)
	}
	if allocs != 0 {
		t.Errorf("Alloc and Free: %v allocations each, want 0 (Buffers come in blocks)", allocs)
	}
	if err := old.Free(); err != nil {
		t.Fatalf("second Free of a buffer kept after Free: %v", err)
	}
	if old == held || old.Size() != 100 || old.Ptr() != ptr {
		t.Errorf("a freed Buffer changed: same as a later one %v, size %d, pointer %#x (was %#x)", old == held, old.Size(), old.Ptr(), ptr)
	}
	if got := a.Available(); got == room {
		t.Errorf("the arena is all free (%d bytes) while a buffer is held: the old Buffer's second Free gave back its range", got)
	}
	if err := held.Free(); err != nil {
		t.Fatal(err)
	}
	if got := a.Available(); got != room {
		t.Errorf("arena has %d of %d bytes free after every Free", got, room)
	}
}

// eachDevice runs fn as subtests with the consumer on the producer's
// device ("same", 0) and on the other one ("other", 1: skipped without a
// second device).
func eachDevice(t *testing.T, fn func(t *testing.T, env *sharetest.Env, device int)) {
	for _, tc := range []struct {
		name   string
		device int
	}{{"same", 0}, {"other", 1}} {
		t.Run(tc.name, func(t *testing.T) {
			env := sharetest.Setup(t)
			env.NeedDevices(t, tc.device+1)
			fn(t, env, tc.device)
		})
	}
}

// TestDevices runs the ring with interprocess events and streams, the
// consumer on the producer's device and on the other device (which needs
// peer access, enabled lazily by the open).
func TestDevices(t *testing.T) {
	eachDevice(t, func(t *testing.T, env *sharetest.Env, device int) {
		e := newExporter(t, env)
		c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamDevice, device), sharetest.EnvParam(sharetest.ParamStream, 1))
		ctx := sharetest.Ctx(t)
		if err := e.WaitConsumers(ctx, 1); err != nil {
			t.Fatal(err)
		}
		// Blocking: ordered after Fill's NULL-stream copies (see sharetest).
		s, err := env.Ctx.NewStream(false)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		r, err := e.NewRing(3, 1<<16)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 50 {
			b, err := r.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), uint64(i)); err != nil {
				t.Fatal(err)
			}
			if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(uint64(i)), Stream: s}); err != nil {
				t.Fatal(err)
			}
		}
		shutdown(t, e)
		var rep sharetest.ConsumerReport
		c.Report(&rep)
		c.Wait()
		checkConsumer(t, &rep, 50)
		if rep.Registry.Opens != 1 {
			t.Errorf("consumer opened the ring %d times, want once", rep.Registry.Opens)
		}
	})
}

// TestConsumerDisconnectedAlive proves that a consumer whose connection
// ends without a goodbye while its process lives keeps its mappings as far
// as the producer knows: the retirement waits for the process to exit
// (whose exit unmaps), and never frees while the mapping may be open.
//
// With VMM the retirement does not wait: the consumer's own mapping keeps
// the memory it reads alive, and the producer never writes it again.
func TestConsumerDisconnectedAlive(t *testing.T) {
	bothPaths(t, testConsumerDisconnectedAlive)
}

func testConsumerDisconnectedAlive(t *testing.T, sharing share.Sharing) {
	env := sharetest.Setup(t)
	mem := env.FreeMemory(t)
	defer env.CheckMemory(t, mem)
	e, r, c := heldRing(t, env, sharing)
	ctx := sharetest.Ctx(t)
	c.Send("disconnect")
	c.Expect("DISCONNECTED")
	if sharing == share.SharingVMM {
		waitUntil(t, "the exporter to see the consumer lost", func() bool { return e.Stats().ConsumersLost == 1 })
		if err := r.Retire(ctx); err != nil {
			t.Fatalf("Retire while the disconnected consumer lives: %v", err)
		}
		c.Send("check") // it still reads what it held, from memory the producer freed
		c.Expect("CHECK")
		c.Send("exit")
		c.Wait()
		if s := e.Stats(); s.ConsumersLost != 1 || s.Leases != 0 || s.Abandoned != 1 || s.Allocations != 0 {
			t.Errorf("exporter stats %+v", s)
		}
		shutdown(t, e)
		return
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if err := r.Retire(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Retire while the disconnected consumer lives: %v, want the deadline", err)
	}
	c.Send("exit")
	c.Wait()
	if err := r.Retire(ctx); err != nil {
		t.Fatalf("Retire after the consumer exited: %v", err)
	}
	if s := e.Stats(); s.ConsumersLost != 1 || s.Leases != 0 {
		t.Errorf("exporter stats %+v", s)
	}
	shutdown(t, e)
}

// bothPaths runs test once with legacy IPC and once with VMM.
func bothPaths(t *testing.T, test func(t *testing.T, sharing share.Sharing)) {
	for _, s := range []share.Sharing{share.SharingIPC, share.SharingVMM} {
		t.Run(s.String(), func(t *testing.T) { test(t, s) })
	}
}

// TestStaleHandle proves that the importer never hands out a stale
// mapping: the handle of a mapped allocation offered under another
// allocation id, and a mapped allocation offered under another handle,
// are refused with ErrStaleHandle (and handed back to the producer), the
// importer goes on, and the allocation is closed before the producer
// frees it.
func TestStaleHandle(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "rawproducer", sharetest.EnvParam(sharetest.ParamPath, path))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	l, err := im.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), 7); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if _, err := im.Next(ctx); !errors.Is(err, share.ErrStaleHandle) {
			t.Fatalf("stale offer %d: %v, want ErrStaleHandle", i, err)
		}
	}
	l.Release()
	if _, err := im.Next(ctx); !errors.Is(err, io.EOF) {
		t.Fatalf("Next after the producer's goodbye: %v, want io.EOF", err)
	}
	var rep sharetest.RawReport
	p.Report(&rep)
	p.Wait()
	if rep.Releases != 3 || !rep.Closed || rep.FreeErr != "" {
		t.Errorf("raw producer: %+v", rep)
	}
	if s := im.Registry().Stats(); s.Mappings != 0 || s.Opens != 1 || s.Closes != 1 {
		t.Errorf("registry %+v, want one open and one close", s)
	}
	if err := im.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestLeaseGarbageCollected proves that a lease dropped without Release
// is reported (logged, counted) and released on the user's behalf, so its
// credit and its allocation are not held forever.
func TestLeaseGarbageCollected(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path), sharetest.EnvParam(sharetest.ParamCount, 3))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	var log sharetest.SyncBuffer
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 1, Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	dropLease(t, ctx, im)
	for deadline := time.Now().Add(10 * time.Second); im.Stats().Leaked == 0; {
		if time.Now().After(deadline) {
			t.Fatal("the dropped lease was not reported")
		}
		runtime.GC()
		time.Sleep(time.Millisecond)
	}
	// With one credit, the next offers arrive only because the dropped
	// lease was released.
	for range 2 {
		l, err := im.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		l.Release()
	}
	if _, err := im.Next(ctx); !errors.Is(err, io.EOF) {
		t.Fatalf("Next after the producer's goodbye: %v, want io.EOF", err)
	}
	var rep sharetest.ProducerReport
	p.Report(&rep)
	p.Wait()
	if rep.ShutdownErr != "" || rep.Stats.Releases != 3 {
		t.Errorf("producer: %+v", rep)
	}
	if s := im.Stats(); s.Leaked != 1 || s.Released != 3 || s.Held != 0 {
		t.Errorf("importer stats %+v", s)
	}
	if !strings.Contains(log.String(), "garbage-collected without Release") {
		t.Errorf("no report in the log:\n%s", log.String())
	}
}

func dropLease(t *testing.T, ctx context.Context, im *share.Importer) {
	t.Helper()
	if _, err := im.Next(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestRegisterReusedAddress proves that Register tells allocations apart
// by buffer id, not only by address: memory freed and allocated again at
// the same address gets a new allocation id, and buffers of the old
// record can no longer be offered.
func TestRegisterReusedAddress(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporter(t, env)
	p, err := env.Ctx.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	b1, err := e.Register(p+100, 1000)
	if err != nil {
		t.Fatal(err)
	}
	b1b, err := e.Register(p, 10)
	if err != nil {
		t.Fatal(err)
	}
	if b1.AllocID() != b1b.AllocID() || b1.Ptr() != p+100 {
		t.Fatalf("two buffers of one allocation: ids %d and %d, pointer %#x", b1.AllocID(), b1b.AllocID(), uint64(b1.Ptr()))
	}
	if _, err := e.Register(p+(1<<20)-10, 20); !errors.Is(err, driver.ErrInvalidValue) {
		t.Fatalf("Register past the allocation's end: %v, want ErrInvalidValue", err)
	}
	// No consumer ever mapped it, so freeing without Retire is safe here.
	if err := env.Ctx.Free(p); err != nil {
		t.Fatal(err)
	}
	p2, err := env.Ctx.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer env.Ctx.Free(p2)
	if p2 != p {
		t.Skipf("the driver did not reuse the address (%#x, then %#x)", uint64(p), uint64(p2))
	}
	b2, err := e.Register(p2, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if b2.AllocID() == b1.AllocID() {
		t.Fatalf("a new allocation at a reused address kept allocation id %d", b1.AllocID())
	}
	ctx, cancel := context.WithTimeout(sharetest.Ctx(t), 100*time.Millisecond)
	defer cancel()
	if err := e.Offer(ctx, b1, share.OfferOptions{}); !errors.Is(err, share.ErrRetired) {
		t.Errorf("Offer of a buffer of the stale record: %v, want ErrRetired", err)
	}
	shutdown(t, e)
}

// TestPeerAccessUnsupported proves that a consumer on a device that
// cannot reach the producer's gets ErrPeerAccessUnsupported (which also
// matches the driver's error) naming both devices, that the offer goes
// back to the producer, and that the producer can still retire and free.
// It needs the simulator, whose topology can deny peer access.
func TestPeerAccessUnsupported(t *testing.T) {
	env := sharetest.Setup(t)
	env.NeedDevices(t, 2)
	if !env.Sim() {
		t.Skip("needs the simulator's topology to deny peer access")
	}
	t.Setenv("CUDASHARE_SIM_DIR", t.TempDir())
	t.Setenv("CUDASHARE_SIM_TOPOLOGY", `{"devices": 2, "peer": [[0, 0], [0, 0]]}`)
	d, err := driver.Open(driver.Config{Backend: driver.BackendSim})
	if err != nil {
		t.Fatal(err)
	}
	dev0, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	dev1, err := d.Device(1)
	if err != nil {
		t.Fatal(err)
	}
	dctx, err := dev0.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	defer dctx.Close()
	// Legacy IPC: the simulator does not yet refuse a VMM mapping for a
	// device without peer access (what the real driver returns there is
	// unmeasured).
	e, err := share.NewExporter(sharetest.Ctx(t), dctx, sharetest.SocketPath(t), share.ExporterConfig{Sharing: share.SharingIPC})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamDevice, 1))
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
	if err := e.Offer(ctx, b, share.OfferOptions{Meta: sharetest.Meta(0)}); err != nil {
		t.Fatal(err)
	}
	msg := c.Expect("PEERERR ")
	for _, u := range []driver.UUID{dev0.UUID(), dev1.UUID()} {
		if !strings.Contains(msg, u.String()) {
			t.Errorf("error %q does not name %s", msg, u)
		}
	}
	if err := b.Wait(ctx); err != nil {
		t.Fatalf("the refused offer did not come back: %v", err)
	}
	shutdown(t, e)
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	if rep.Leases != 0 || len(rep.Errors) != 1 || !rep.EOF || rep.Registry.Mappings != 0 {
		t.Errorf("consumer: %+v", rep)
	}
	if v, err := d.Violations(); err != nil || len(v) != 0 {
		t.Errorf("violations %v (%v)", v, err)
	}
}

// TestCloseNeverFreesEarly proves that Close, which does not wait, leaves
// an allocation that a consumer maps allocated rather than freeing it
// under the consumer; the consumer sees the producer gone and closes its
// mapping when it releases.
//
// With VMM, Close frees the producer's handle at once: the consumer's own
// mapping keeps the memory it reads.
func TestCloseNeverFreesEarly(t *testing.T) { bothPaths(t, testCloseNeverFreesEarly) }

func testCloseNeverFreesEarly(t *testing.T, sharing share.Sharing) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: sharing})
	c := startConsumer(t, e, sharetest.EnvParam(sharetest.ParamHold, 1))
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(2, 4096)
	if err != nil {
		t.Fatal(err)
	}
	offerRing(t, env, e, r, 0, 1)
	c.Expect("HELD 1")
	if err := e.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := e.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	want := 1
	if sharing == share.SharingVMM {
		want = 0
	}
	if s := e.Stats(); s.Allocations != want {
		t.Errorf("after Close with the ring mapped: %d allocations, want %d", s.Allocations, want)
	}
	if _, err := r.Acquire(ctx); !errors.Is(err, share.ErrClosed) {
		t.Errorf("Acquire after Close: %v, want ErrClosed", err)
	}
	c.Send("release")
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	if rep.Gone == "" || rep.EOF || rep.Registry.Mappings != 0 || len(rep.Bad) > 0 {
		t.Errorf("consumer: %+v", rep)
	}
}

// TestImporterShutdownWaitsForLeases proves the consumer's half of
// close-before-free: Shutdown waits for the leases handed out, then closes
// every mapping before its goodbye, so the producer's Shutdown frees with
// no violation and counts no lost consumer.
func TestImporterShutdownWaitsForLeases(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	l, err := im.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- im.Shutdown(ctx) }()
	select {
	case err := <-done:
		t.Fatalf("Shutdown returned (%v) with a lease held", err)
	case <-time.After(200 * time.Millisecond):
	}
	if _, err := im.Next(ctx); !errors.Is(err, share.ErrClosed) {
		t.Errorf("Next during Shutdown: %v, want ErrClosed", err)
	}
	l.Release()
	if err := <-done; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if m := im.Registry().Mappings(); m != 0 {
		t.Errorf("%d mappings open after Shutdown", m)
	}
	p.Wait() // the producer offers until stdin closes, then shuts down
	var rep sharetest.ProducerReport
	p.Report(&rep)
	if rep.ShutdownErr != "" || rep.Stats.ConsumersLost != 0 || rep.Stats.Allocations != 0 {
		t.Errorf("producer: %+v", rep)
	}
}

// TestClosedErrors checks the errors of calls on closed objects and of
// misuse, in one process.
func TestClosedErrors(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporter(t, env)
	ctx := sharetest.Ctx(t)
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if err := e.WaitConsumers(short, 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("WaitConsumers with none coming: %v", err)
	}
	r, err := e.NewRing(1, 64)
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	short, cancel = context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if err := e.Offer(short, b, share.OfferOptions{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Offer with no consumer: %v, want the deadline", err)
	}
	p, err := env.Ctx.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer env.Ctx.Free(p)
	rb, err := e.Register(p, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := rb.Free(); err == nil {
		t.Error("Free of a registered buffer succeeded")
	}
	if _, err := e.NewRing(0, 64); !errors.Is(err, driver.ErrInvalidValue) {
		t.Errorf("NewRing(0): %v", err)
	}
	shutdown(t, e)
	if err := e.Offer(ctx, b, share.OfferOptions{}); !errors.Is(err, share.ErrClosed) {
		t.Errorf("Offer after Shutdown: %v, want ErrClosed", err)
	}
	if _, err := e.NewArena(1 << 20); !errors.Is(err, share.ErrClosed) {
		t.Errorf("NewArena after Shutdown: %v, want ErrClosed", err)
	}
	if _, err := e.Register(p, 64); !errors.Is(err, share.ErrClosed) {
		t.Errorf("Register after Shutdown: %v, want ErrClosed", err)
	}
	if err := e.Shutdown(ctx); err != nil {
		t.Errorf("second Shutdown: %v", err)
	}
}

// TestCloseBeforeGoodbye proves the importer's order: every mapping is
// closed before its goodbye is sent. The producer here frees the
// allocation the instant it reads the goodbye, which the strict simulator
// refuses (and records) if the consumer still maps it. Many rounds make a
// wrong order show up even though it would be a race.
func TestCloseBeforeGoodbye(t *testing.T) {
	env := sharetest.Setup(t)
	const rounds = 30
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "freeonbye", sharetest.EnvParam(sharetest.ParamPath, path), sharetest.EnvParam(sharetest.ParamCount, rounds))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	for i := range rounds {
		im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{})
		if err != nil {
			t.Fatal(err)
		}
		l, err := im.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), 1); err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			l.Release() // Shutdown waits for it
		} else {
			defer l.Release() // Close closes its mapping under it
		}
		var err2 error
		if i%2 == 0 {
			err2 = im.Shutdown(ctx)
		} else {
			err2 = im.Close()
		}
		if err2 != nil {
			t.Fatalf("round %d: %v", i, err2)
		}
	}
	var rep sharetest.FreeOnGoodbyeReport
	p.Report(&rep)
	p.Wait()
	if rep.Rounds != rounds || len(rep.FreeErrs) > 0 {
		t.Errorf("producer: %d rounds, frees refused: %q", rep.Rounds, rep.FreeErrs)
	}
}

// TestLostConsumerMappingNothing proves that a consumer lost without a
// goodbye while its process lives holds up nothing it does not map:
// Shutdown retires and frees everything without waiting for its exit.
func TestLostConsumerMappingNothing(t *testing.T) {
	env := sharetest.Setup(t)
	mem := env.FreeMemory(t)
	defer env.CheckMemory(t, mem)
	e := newExporter(t, env)
	c := sharetest.Start(t, "rawconsumer", sharetest.EnvParam(sharetest.ParamPath, e.Addr()), sharetest.EnvParam(sharetest.ParamHold, 0))
	c.Expect("HELD 0")
	ctx := sharetest.Ctx(t)
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := e.NewRing(2, 4096); err != nil {
		t.Fatal(err)
	}
	c.Send("disconnect")
	c.Expect("DISCONNECTED")
	for deadline := time.Now().Add(sharetest.ExpectTimeout); e.Consumers() != 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the exporter did not notice the disconnection")
		}
	}
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := e.Shutdown(sctx); err != nil {
		t.Fatalf("Shutdown with a lost consumer that maps nothing: %v", err)
	}
	if s := e.Stats(); s.Allocations != 0 || s.ConsumersLost != 1 {
		t.Errorf("exporter stats %+v", s)
	}
	c.Send("exit")
	c.Wait()
}

// TestCancelledContextStops: a producer loop bounded only by its context
// ends, even when a buffer, room and credit are all available.
func TestCancelledContextStops(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var r share.Ring
	if _, err := r.Acquire(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Ring.Acquire(cancelled) = %v, want context.Canceled", err)
	}
	var a share.Arena
	if _, err := a.Alloc(ctx, 1); !errors.Is(err, context.Canceled) {
		t.Errorf("Arena.Alloc(cancelled) = %v, want context.Canceled", err)
	}
	var e share.Exporter
	if err := e.Offer(ctx, nil, share.OfferOptions{}); !errors.Is(err, context.Canceled) {
		t.Errorf("Offer(cancelled) = %v, want context.Canceled", err)
	}
	if _, err := e.Broadcast(ctx, nil, share.OfferOptions{}); !errors.Is(err, context.Canceled) {
		t.Errorf("Broadcast(cancelled) = %v, want context.Canceled", err)
	}
}
