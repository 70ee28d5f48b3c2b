//go:build linux

package share_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// What grows besides consumers (README, "Many buffers, small buffers"):
// the allocations a producer offers and a consumer maps, and the device
// memory of small buffers under the allocation granularity. Each
// benchmark sets up once (its sub-benchmark is what b.N repeats), so that
// -benchtime bounds only the repeated part.

// scaleBufSize is the buffer of these benchmarks: a small tensor.
const scaleBufSize = 4096

// BenchmarkRegistered10000 is a producer with 10,000 registered buffers,
// each its own cuMemAlloc allocation (Register offers the caller's memory
// with legacy IPC), offered round robin to one consumer process, against
// the same with 10: ns/op and producer-cpu-ns/op are an offer and its
// release once the consumer maps every allocation, and must not grow with
// the number registered. Set up once: register-ns/buffer (Register,
// cuIpcGetMemHandle included), producer-heap-B/buffer (the exporter's
// record and the caller's *Buffer), producer-heap-B/mapped (what the
// producer holds more once the consumer maps each allocation),
// producer-fds/buffer. The simulator's machine holds fewer allocations
// (4 GiB charged 2 MiB each, 8,192 at most): there "registered" says how
// many.
func BenchmarkRegistered10000(b *testing.B) {
	for _, n := range []int{10, 10000} {
		b.Run(fmt.Sprintf("registered=%d", n), func(b *testing.B) { benchRegistered(b, n) })
	}
}

func benchRegistered(b *testing.B, n int) {
	const credits = 64
	env := sharetest.Setup(b)
	ptrs := allocMany(b, env, n)
	e := newExporter(b, env)
	c := startConsumer(b, e, sharetest.EnvParam(sharetest.ParamCredits, credits), sharetest.EnvParam(sharetest.ParamVerify, 0))
	ctx := context.Background()
	if err := e.WaitConsumers(ctx, 1); err != nil {
		b.Fatal(err)
	}
	bufs := make([]*share.Buffer, len(ptrs))
	heap0, fds0 := heapInUse(), sharetest.OpenFDCount()
	start := time.Now()
	for i, p := range ptrs {
		var err error
		if bufs[i], err = e.Register(p, scaleBufSize); err != nil {
			b.Fatal(err)
		}
	}
	register := time.Since(start)
	heap1, fds1 := heapInUse(), sharetest.OpenFDCount()
	// Every allocation offered once: the consumer maps them all.
	var meta [9]byte
	offers := 0
	offer := func(buf *share.Buffer) {
		if err := e.Offer(ctx, buf, share.OfferOptions{Meta: sharetest.MetaInto(meta[:], uint64(offers))}); err != nil {
			b.Fatal(err)
		}
		offers++
	}
	for _, buf := range bufs {
		offer(buf)
	}
	waitIdle(b, e)
	heap2 := heapInUse()
	per := float64(len(bufs))

	b.Run("offer", func(b *testing.B) {
		b.ResetTimer()
		cpu0 := sharetest.CPUTime()
		for range b.N {
			offer(bufs[offers%len(bufs)])
		}
		waitIdle(b, e)
		cpu := sharetest.CPUTime() - cpu0
		b.StopTimer()
		b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "producer-cpu-ns/op")
		// After the timer's reset, which drops metrics reported before.
		b.ReportMetric(per, "registered")
		b.ReportMetric(float64(register.Nanoseconds())/per, "register-ns/buffer")
		b.ReportMetric(float64(int64(heap1)-int64(heap0))/per, "producer-heap-B/buffer")
		b.ReportMetric(float64(int64(heap2)-int64(heap1))/per, "producer-heap-B/mapped")
		b.ReportMetric(float64(fds1-fds0)/per, "producer-fds/buffer")
	})

	shutdown(b, e)
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	if rep.Leases != offers || len(rep.Bad) > 0 || len(rep.Errors) > 0 {
		b.Fatalf("consumer: %d leases of %d, bad %q, errors %q", rep.Leases, offers, rep.Bad, rep.Errors)
	}
	if rep.Registry.Opens != uint64(len(bufs)) || rep.Registry.Mappings != 0 {
		b.Fatalf("consumer: %d opens for %d allocations, %d mappings left after Shutdown", rep.Registry.Opens, len(bufs), rep.Registry.Mappings)
	}
	for _, p := range ptrs {
		if err := env.Ctx.Free(p); err != nil {
			b.Fatal(err)
		}
	}
}

// allocMany allocates n buffers of scaleBufSize bytes, each its own
// cuMemAlloc allocation, freed at the end of b unless freed before. On the
// simulator it stops short of n where the simulated machine is full, and
// leaves room for a few more allocations.
func allocMany(b *testing.B, env *sharetest.Env, n int) []driver.DevicePtr {
	b.Helper()
	ptrs := make([]driver.DevicePtr, 0, n)
	b.Cleanup(func() {
		for _, p := range ptrs {
			env.Ctx.Free(p) // freed already on success: an error then
		}
	})
	for range n {
		p, err := env.Ctx.Alloc(scaleBufSize)
		if errors.Is(err, driver.ErrOutOfMemory) && env.Sim() && len(ptrs) > 64 {
			const room = 16
			for _, p := range ptrs[len(ptrs)-room:] {
				if err := env.Ctx.Free(p); err != nil {
					b.Fatal(err)
				}
			}
			ptrs = ptrs[:len(ptrs)-room]
			b.Logf("the simulated machine holds %d allocations of %d bytes, not %d", len(ptrs), scaleBufSize, n)
			break
		}
		if err != nil {
			b.Fatalf("allocation %d of %d: %v", len(ptrs), n, err)
		}
		ptrs = append(ptrs, p)
	}
	return ptrs
}

// BenchmarkConsumerMaps1000 is a consumer process that maps 1,000
// allocations, with VMM sharing and with legacy IPC: each a ring of one
// 4 KiB buffer, offered once (the first offer: the producer exports the
// allocation, the consumer imports and maps it), then round robin again
// (the lookup: the consumer's registry finds the mapping open). ns/op,
// producer-cpu-ns/op, consumer-cpu-ns/op and consumer-allocs/op are a
// lookup offer and its release. Measured once, over the 1,000 first
// offers: first-offer-ns (wall time per offer, 64 in flight: the slower
// side's cost), first-producer-cpu-ns and first-consumer-cpu-ns, and
// what the consumer process holds more per mapping: consumer-heap-B,
// consumer-rss-B (the driver's host memory included) and consumer-fds.
// alloc-ns is the producer's allocation of one ring.
func BenchmarkConsumerMaps1000(b *testing.B) {
	for _, s := range []share.Sharing{share.SharingVMM, share.SharingIPC} {
		b.Run("sharing="+s.String(), func(b *testing.B) { benchConsumerMaps(b, s) })
	}
}

func benchConsumerMaps(b *testing.B, sharing share.Sharing) {
	const (
		n       = 1000
		credits = 64
	)
	env := sharetest.Setup(b)
	e, err := share.NewExporter(sharetest.Ctx(b), env.Ctx, sharetest.SocketPath(b), share.ExporterConfig{Logger: sharetest.Logger(b), Sharing: sharing})
	if errors.Is(err, driver.ErrNotSupported) {
		b.Skipf("sharing %s: %v", sharing, err)
	}
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { e.Close() })
	c := sharetest.Start(b, "mapper", sharetest.EnvParam(sharetest.ParamPath, e.Addr()),
		sharetest.EnvParam(sharetest.ParamCredits, credits), sharetest.EnvParam(sharetest.ParamCount, n))
	c.Expect("CONNECTED")
	ctx := context.Background()
	if err := e.WaitConsumers(ctx, 1); err != nil {
		b.Fatal(err)
	}
	rings := make([]*share.Ring, n)
	start := time.Now()
	for i := range rings {
		if rings[i], err = e.NewRing(1, scaleBufSize); err != nil {
			b.Fatal(err)
		}
	}
	alloc := time.Since(start)
	var meta [9]byte
	offers := 0
	offer := func(r *share.Ring) {
		buf, err := r.Acquire(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if err := e.Offer(ctx, buf, share.OfferOptions{Meta: sharetest.MetaInto(meta[:], uint64(offers))}); err != nil {
			b.Fatal(err)
		}
		offers++
	}
	start, cpu0 := time.Now(), sharetest.CPUTime()
	for _, r := range rings {
		offer(r)
	}
	var mapped sharetest.MappedReport
	if err := json.Unmarshal([]byte(c.Expect("MAPPED ")), &mapped); err != nil {
		b.Fatal(err)
	}
	first, firstCPU := time.Since(start), sharetest.CPUTime()-cpu0
	waitIdle(b, e)
	if mapped.Mappings != n {
		b.Fatalf("the consumer maps %d allocations after %d first offers", mapped.Mappings, n)
	}

	b.Run("lookup", func(b *testing.B) {
		s0 := snap(b, c)
		b.ResetTimer()
		cpu0 := sharetest.CPUTime()
		for range b.N {
			offer(rings[offers%n])
		}
		waitIdle(b, e)
		cpu := sharetest.CPUTime() - cpu0
		b.StopTimer()
		s1 := snap(b, c)
		if s1.Leases-s0.Leases != b.N {
			b.Fatalf("the consumer took %d leases of %d", s1.Leases-s0.Leases, b.N)
		}
		b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "producer-cpu-ns/op")
		b.ReportMetric(float64((s1.CPU-s0.CPU).Nanoseconds())/float64(b.N), "consumer-cpu-ns/op")
		b.ReportMetric(float64(s1.Mallocs-s0.Mallocs)/float64(b.N), "consumer-allocs/op")
		// After the timer's reset, which drops metrics reported before.
		b.ReportMetric(float64(alloc.Nanoseconds())/n, "alloc-ns")
		b.ReportMetric(float64(first.Nanoseconds())/n, "first-offer-ns")
		b.ReportMetric(float64(firstCPU.Nanoseconds())/n, "first-producer-cpu-ns")
		b.ReportMetric(mapped.CPUPerLease, "first-consumer-cpu-ns")
		b.ReportMetric(mapped.HeapPerMapping, "consumer-heap-B/mapping")
		b.ReportMetric(mapped.RSSPerMapping, "consumer-rss-B/mapping")
		b.ReportMetric(mapped.FDsPerMapping, "consumer-fds/mapping")
	})

	shutdown(b, e)
	var rep sharetest.MapperReport
	c.Report(&rep)
	c.Wait()
	if rep.Leases != offers || len(rep.Bad) > 0 || len(rep.Errors) > 0 || !rep.EOF || rep.ShutdownErr != "" {
		b.Fatalf("consumer: %d leases of %d, bad %q, errors %q, goodbye %v, shutdown %q", rep.Leases, offers, rep.Bad, rep.Errors, rep.EOF, rep.ShutdownErr)
	}
	if rep.Registry.Opens != n || rep.Registry.Mappings != 0 {
		b.Fatalf("consumer: %d opens for %d allocations, %d mappings left after Shutdown", rep.Registry.Opens, n, rep.Registry.Mappings)
	}
}

// snap asks the mapper what it has spent so far.
func snap(b *testing.B, c *sharetest.Child) sharetest.Snap {
	b.Helper()
	c.Send("snap")
	s, err := sharetest.ParseSnap(c.Expect("SNAP "))
	if err != nil {
		b.Fatal(err)
	}
	return s
}

// BenchmarkSmallBuffers is the device memory of 1,000 buffers of 4 KiB in
// each layout: each buffer its own allocation (a ring of one), one ring
// of 1,000, or 1,000 Allocs from one arena; with VMM sharing and with
// legacy IPC. An op makes the 1,000 buffers and frees them. B/buffer is
// what the exporter's allocations hold (VMM rounds each up to the
// allocation granularity; a cuMemAlloc is recorded as asked), device-B/buffer
// what the device's free memory fell by (the driver's own rounding, and
// anything else on the device meanwhile), allocations/op the allocations
// made: the exports and mappings a consumer pays for on first offers.
func BenchmarkSmallBuffers(b *testing.B) {
	const n = 1000
	for _, sharing := range []share.Sharing{share.SharingVMM, share.SharingIPC} {
		for _, layout := range []string{"each", "ring", "arena"} {
			b.Run(fmt.Sprintf("sharing=%s/%s", sharing, layout), func(b *testing.B) {
				env := sharetest.Setup(b)
				e, err := share.NewExporter(sharetest.Ctx(b), env.Ctx, sharetest.SocketPath(b), share.ExporterConfig{Logger: sharetest.Logger(b), Sharing: sharing})
				if errors.Is(err, driver.ErrNotSupported) {
					b.Skipf("sharing %s: %v", sharing, err)
				}
				if err != nil {
					b.Fatal(err)
				}
				defer e.Close()
				var held, device uint64
				var allocs int
				for b.Loop() {
					free0 := freeMemory(b, env)
					retire := smallBuffers(b, e, layout, n)
					held, allocs = share.AllocatedBytes(e), e.Stats().Allocations
					device = free0 - freeMemory(b, env)
					if err := retire(); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(held)/n, "B/buffer")
				b.ReportMetric(float64(int64(device))/n, "device-B/buffer")
				b.ReportMetric(float64(allocs), "allocations/op")
			})
		}
	}
}

// smallBuffers makes n buffers of scaleBufSize bytes in layout and returns
// what retires them.
func smallBuffers(b *testing.B, e *share.Exporter, layout string, n int) func() error {
	b.Helper()
	ctx := context.Background()
	switch layout {
	case "each":
		rings := make([]*share.Ring, n)
		for i := range rings {
			var err error
			if rings[i], err = e.NewRing(1, scaleBufSize); err != nil {
				b.Fatal(err)
			}
		}
		return func() error {
			for _, r := range rings {
				if err := r.Retire(ctx); err != nil {
					return err
				}
			}
			return nil
		}
	case "ring":
		r, err := e.NewRing(n, scaleBufSize)
		if err != nil {
			b.Fatal(err)
		}
		return func() error { return r.Retire(ctx) }
	}
	a, err := e.NewArena(uint64(n) * scaleBufSize)
	if err != nil {
		b.Fatal(err)
	}
	bufs := make([]*share.Buffer, n)
	for i := range bufs {
		if bufs[i], err = a.Alloc(ctx, scaleBufSize); err != nil {
			b.Fatal(err)
		}
	}
	return func() error {
		for _, buf := range bufs {
			if err := buf.Free(); err != nil {
				return err
			}
		}
		return a.Retire(ctx)
	}
}

// TestSmallBuffersPacked: a 4 KiB buffer that is its own VMM allocation
// holds a whole granularity of device memory, and buffers packed in a
// ring or an arena share one: 8 rings of one buffer hold 8 granules, a
// ring of 8 and an arena of 8 buffers one each.
func TestSmallBuffersPacked(t *testing.T) {
	env := sharetest.Setup(t)
	e, err := share.NewExporter(sharetest.Ctx(t), env.Ctx, sharetest.SocketPath(t), share.ExporterConfig{Logger: sharetest.Logger(t), Sharing: share.SharingVMM})
	if errors.Is(err, driver.ErrNotSupported) {
		t.Skipf("VMM: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	gran, _, err := env.Ctx.Device().AllocationGranularity()
	if err != nil {
		t.Fatal(err)
	}
	ctx := sharetest.Ctx(t)
	const n = 8
	var rings []*share.Ring
	for range n {
		r, err := e.NewRing(1, scaleBufSize)
		if err != nil {
			t.Fatal(err)
		}
		rings = append(rings, r)
	}
	if got, allocs := share.AllocatedBytes(e), e.Stats().Allocations; got != n*gran || allocs != n {
		t.Errorf("%d rings of one %d-byte buffer: %d allocations of %d bytes in all, want %d of %d", n, scaleBufSize, allocs, got, n, n*gran)
	}
	for _, r := range rings {
		if err := r.Retire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	r, err := e.NewRing(n, scaleBufSize)
	if err != nil {
		t.Fatal(err)
	}
	if got, allocs := share.AllocatedBytes(e), e.Stats().Allocations; got != gran || allocs != 1 {
		t.Errorf("a ring of %d buffers of %d bytes: %d allocations of %d bytes in all, want 1 of %d", n, scaleBufSize, allocs, got, gran)
	}
	if err := r.Retire(ctx); err != nil {
		t.Fatal(err)
	}
	a, err := e.NewArena(n * scaleBufSize)
	if err != nil {
		t.Fatal(err)
	}
	for range n {
		buf, err := a.Alloc(ctx, scaleBufSize)
		if err != nil {
			t.Fatal(err)
		}
		defer buf.Free()
	}
	if got, allocs := share.AllocatedBytes(e), e.Stats().Allocations; got != gran || allocs != 1 {
		t.Errorf("an arena of %d buffers of %d bytes: %d allocations of %d bytes in all, want 1 of %d", n, scaleBufSize, allocs, got, gran)
	}
}

// waitIdle waits until no lease is out: the last offers' releases are
// part of what is measured.
func waitIdle(b *testing.B, e *share.Exporter) {
	b.Helper()
	for deadline := time.Now().Add(sharetest.ExpectTimeout); e.Stats().Leases > 0; time.Sleep(20 * time.Microsecond) {
		if time.Now().After(deadline) {
			b.Fatalf("%d leases still out", e.Stats().Leases)
		}
	}
}

// heapInUse is the process's Go heap in use, after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// freeMemory is the device's free memory.
func freeMemory(b *testing.B, env *sharetest.Env) uint64 {
	b.Helper()
	free, _, err := env.Ctx.MemInfo()
	if err != nil {
		b.Fatal(err)
	}
	return free
}
