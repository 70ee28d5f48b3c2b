//go:build linux

package share_test

import (
	"context"
	"encoding/hex"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// BenchmarkHandoff measures handoffs (offer -> consumer in another process
// -> release) per second, pipelined with 64 credits, 4 KiB buffers and 9
// bytes of metadata:
//
//   - ring: 64 reused buffers of one allocation (Ring.Acquire, Offer)
//   - arena: a fresh buffer per handoff, sub-allocated from an arena
//     (Arena.Alloc, Offer, Free)
//   - ring-event: ring, with the buffer's interprocess event recorded on a
//     stream per offer and waited on by the consumer's stream
//
// allocs/op are the producer process's; consumer-allocs/op is what the
// consumer process allocated per lease (Next and Release). The cpu-ns/op
// figures are each process's CPU time (user and system, every thread) per
// handoff: steadier than the rate on a shared machine.
func BenchmarkHandoff(b *testing.B) {
	for _, mode := range []string{"ring", "arena", "ring-event"} {
		b.Run(mode, func(b *testing.B) { benchHandoff(b, mode) })
	}
}

func benchHandoff(b *testing.B, mode string) {
	const (
		credits = 64
		size    = 4096
	)
	env := sharetest.Setup(b)
	e := newExporter(b, env)
	params := []string{sharetest.EnvParam(sharetest.ParamCredits, credits), sharetest.EnvParam(sharetest.ParamVerify, 0)}
	var opts share.OfferOptions
	if mode == "ring-event" {
		params = append(params, sharetest.EnvParam(sharetest.ParamStream, 1))
		s, err := env.Ctx.NewStream(true)
		if err != nil {
			b.Fatal(err)
		}
		defer s.Close()
		opts.Stream = s
	}
	c := startConsumer(b, e, params...)
	ctx := context.Background()
	if err := e.WaitConsumers(ctx, 1); err != nil {
		b.Fatal(err)
	}
	var ring *share.Ring
	var arena *share.Arena
	var err error
	if mode == "arena" {
		arena, err = e.NewArena(2 * credits * size)
	} else {
		ring, err = e.NewRing(credits, size)
	}
	if err != nil {
		b.Fatal(err)
	}
	var room uint64 // the arena's free bytes (VMM rounds it up to the granularity)
	if arena != nil {
		room = arena.Available()
	}
	var meta [9]byte
	b.ReportAllocs()
	b.ResetTimer()
	start, cpu0 := time.Now(), sharetest.CPUTime()
	for i := range b.N {
		var buf *share.Buffer
		if arena != nil {
			buf, err = arena.Alloc(ctx, size)
		} else {
			buf, err = ring.Acquire(ctx)
		}
		if err != nil {
			b.Fatal(err)
		}
		opts.Meta = sharetest.MetaInto(meta[:], uint64(i))
		if err := e.Offer(ctx, buf, opts); err != nil {
			b.Fatal(err)
		}
		if arena != nil {
			buf.Free()
		}
	}
	// The last handoffs end with their release.
	if arena != nil {
		for arena.Available() != room {
			time.Sleep(20 * time.Microsecond)
		}
	} else {
		held := make([]*share.Buffer, credits)
		for i := range held {
			if held[i], err = ring.Acquire(ctx); err != nil {
				b.Fatal(err)
			}
		}
		for _, h := range held {
			h.Free()
		}
	}
	elapsed, cpu := time.Since(start), sharetest.CPUTime()-cpu0
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "handoffs/s")
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "producer-cpu-ns/op")
	shutdown(b, e)
	var rep sharetest.ConsumerReport
	c.Report(&rep)
	c.Wait()
	if rep.Leases != b.N || len(rep.Bad) > 0 {
		b.Fatalf("consumer: %d leases of %d, bad %q", rep.Leases, b.N, rep.Bad)
	}
	b.ReportMetric(rep.AllocsPerLease, "consumer-allocs/op")
	b.ReportMetric(rep.CPUPerLease, "consumer-cpu-ns/op")
}

// BenchmarkRegistryLookup measures the registry: "cached" is a lookup of
// a mapping that is already open (what every lease after the first costs:
// a map lookup under a mutex, no driver call, no allocation); "open" is a
// first open and last close of another process's handle (IpcOpenMemHandle,
// AddressRange, BufferID, IpcCloseMemHandle), what the cache saves.
func BenchmarkRegistryLookup(b *testing.B) {
	env := sharetest.Setup(b)
	c := sharetest.Start(b, "export")
	f := strings.Fields(c.Expect("HANDLE "))
	raw, err := hex.DecodeString(f[0])
	if err != nil || len(raw) != len(driver.IpcMemHandle{}) {
		b.Fatalf("handle %q: %v", f[0], err)
	}
	size, _ := strconv.ParseUint(f[1], 10, 64)
	h := driver.IpcMemHandle(raw)
	dev := env.Ctx.Device().UUID()

	b.Run("cached", func(b *testing.B) {
		p := share.NewRegistryProbe(share.NewRegistry(), int32(c.PID()), dev, dev, h)
		if _, err := p.Acquire(env.Ctx, 1, size); err != nil { // opens; held to the end
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			if _, err := p.Acquire(env.Ctx, 1, size); err != nil {
				b.Fatal(err)
			}
			if err := p.Release(); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		if err := p.Release(); err != nil { // closes
			b.Fatal(err)
		}
	})
	b.Run("open", func(b *testing.B) {
		p := share.NewRegistryProbe(share.NewRegistry(), int32(c.PID()), dev, dev, h)
		b.ReportAllocs()
		for b.Loop() {
			if _, err := p.Acquire(env.Ctx, 1, size); err != nil {
				b.Fatal(err)
			}
			if err := p.Release(); err != nil {
				b.Fatal(err)
			}
		}
	})
	c.Wait()
}
