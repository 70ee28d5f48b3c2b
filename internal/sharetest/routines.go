//go:build linux

package sharetest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/share"
)

// Parameters of the child routines, passed as environment entries.
const (
	ParamPath      = "SHARE_PATH"          // socket path
	ParamDevice    = "SHARE_DEVICE"        // device ordinal of the child's context (0)
	ParamCredits   = "SHARE_CREDITS"       // consumer: credits (8)
	ParamHold      = "SHARE_HOLD"          // consumer: hold this many leases, print HELD, release on "release" (0)
	ParamSleep     = "SHARE_SLEEP_US"      // consumer: per lease; producer: per offer (0)
	ParamMax       = "SHARE_MAX"           // consumer: stop after this many leases (0: until the producer ends)
	ParamStream    = "SHARE_STREAM"        // "1": events and a stream
	ParamRing      = "SHARE_RING"          // producer: ring buffers (4)
	ParamSize      = "SHARE_SIZE"          // producer: buffer size (4096)
	ParamCount     = "SHARE_COUNT"         // producer: offers (0: until stdin closes)
	ParamConsumers = "SHARE_CONSUMERS"     // producer: consumers to wait for (1)
	ParamRetire    = "SHARE_RETIRE_AT"     // producer: retire the ring after this many offers, go on with a new one (0)
	ParamBroadcast = "SHARE_BROADCAST"     // producer: "1" broadcasts
	ParamVerify    = "SHARE_VERIFY"        // consumer: "0" skips reading back each lease's bytes
	ParamAfter     = "SHARE_RELEASE_AFTER" // consumer: "1" copies each lease on its stream, releases stream-ordered, then checks the copy
	ParamProfile   = "SHARE_CPUPROFILE"    // any child: write a CPU profile to this file
	ParamSharing   = "SHARE_SHARING"       // producer: "ipc", "vmm" or "auto" (auto)
	ParamLinger    = "SHARE_LINGER"        // consumer: "1": once its connection ends, stay (and keep what it mapped) until stdin closes
	ParamRestart   = "SHARE_RESTART_EVERY" // producer: restart (Exporter.Restart, then a new exporter at the same path) after every this many offers (0)
	ParamRestarts  = "SHARE_RESTARTS"      // producer: with ParamRestart, at most this many restarts (1)
)

// ChildEnv is what a routine gets.
type ChildEnv struct {
	D   *driver.Driver
	Ctx *driver.Context
	In  *bufio.Reader
	Log *slog.Logger
}

var routines = map[string]func(*ChildEnv) error{
	"producer":    producer,
	"consumer":    consumer,
	"rawproducer": rawProducer,
	"rawconsumer": rawConsumer,
	"freeonbye":   freeOnGoodbye,
	"export":      exportHandle,
	"holder":      holder,
	"grabber":     grabber,
	"unsealed":    unsealedProducer,
}

// Param returns the integer parameter name, or def.
func Param(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// Env returns "name=value" for Start.
func EnvParam(name string, value any) string { return fmt.Sprintf("%s=%v", name, value) }

func runChild(mode string) int {
	time.AfterFunc(childWatchdog, func() {
		fmt.Fprintln(os.Stderr, "child watchdog fired")
		os.Exit(3)
	})
	f, ok := routines[mode]
	if !ok {
		fmt.Printf("FAIL unknown routine %q\n", mode)
		return 2
	}
	if path := os.Getenv(ParamProfile); path != "" {
		if f, err := os.Create(path); err == nil {
			pprof.StartCPUProfile(f)
			defer func() { pprof.StopCPUProfile(); f.Close() }()
		}
	}
	err := func() error {
		d, err := driver.Open(driver.Config{})
		if err != nil {
			return err
		}
		dev, err := d.Device(Param(ParamDevice, 0))
		if err != nil {
			return err
		}
		ctx, err := dev.RetainPrimaryContext()
		if err != nil {
			return err
		}
		log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		err = f(&ChildEnv{D: d, Ctx: ctx, In: bufio.NewReader(os.Stdin), Log: log})
		return errors.Join(err, ctx.Close())
	}()
	if err != nil {
		fmt.Printf("FAIL %s: %v\n", mode, strings.ReplaceAll(err.Error(), "\n", "; "))
		return 1
	}
	return 0
}

func report(v any) {
	b, _ := json.Marshal(v)
	fmt.Printf("REPORT %s\n", b)
}

// waitLine reads stdin until a line equal to want, or EOF.
func (ce *ChildEnv) waitLine(want string) {
	for {
		line, err := ce.In.ReadString('\n')
		if strings.TrimSpace(line) == want || err != nil {
			return
		}
	}
}

// ProducerReport is what the producer routine reports.
type ProducerReport struct {
	Offers      int
	Stats       share.ExporterStats
	RetireErr   string
	ShutdownErr string
}

// producer offers ring buffers filled with Fill's pattern, numbered from
// 0, with their number as metadata; then shuts down. With ParamCount 0 it
// offers until stdin closes (or it is killed).
func producer(ce *ChildEnv) error {
	ctx := context.Background()
	sharing := share.SharingAuto
	if v := os.Getenv(ParamSharing); v != "" {
		var err error
		if sharing, err = share.ParseSharing(v); err != nil {
			return err
		}
	}
	e, err := share.NewExporter(ctx, ce.Ctx, os.Getenv(ParamPath), share.ExporterConfig{Logger: ce.Log, Sharing: sharing})
	if err != nil {
		return err
	}
	defer func() { e.Close() }() // the last one's
	fmt.Println("LISTENING")
	wctx, cancel := context.WithTimeout(ctx, ExpectTimeout)
	defer cancel()
	if err := e.WaitConsumers(wctx, Param(ParamConsumers, 1)); err != nil {
		return err
	}
	n, size := Param(ParamRing, 4), uint64(Param(ParamSize, 4096))
	count, retireAt := Param(ParamCount, 0), Param(ParamRetire, 0)
	restartEvery, restarts := Param(ParamRestart, 0), Param(ParamRestarts, 1)
	sleep := time.Duration(Param(ParamSleep, 0)) * time.Microsecond
	broadcast := os.Getenv(ParamBroadcast) == "1"
	var opts share.OfferOptions
	if os.Getenv(ParamStream) == "1" {
		// A blocking stream: its work is ordered after work on the legacy NULL
		// stream, where Fill's and Check's synchronous copies run (a copy from
		// pageable memory may return before its DMA lands), so the event the
		// producer records on it, and the consumer's wait on it, order those
		// copies. A non-blocking stream lost the tail of a batch on an H200.
		s, err := ce.Ctx.NewStream(false)
		if err != nil {
			return err
		}
		defer s.Close()
		opts.Stream = s
	}
	ring, err := e.NewRing(n, size)
	if err != nil {
		return err
	}
	loop, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		io.Copy(io.Discard, ce.In)
		stop()
	}()
	var rep ProducerReport
	var retiring sync.WaitGroup
	for i := 0; count == 0 || i < count; i++ {
		// With a stream, consumers' stream-ordered releases are waited
		// for on it; without, on the host.
		b, err := ring.AcquireOn(loop, opts.Stream)
		if err != nil {
			if loop.Err() != nil {
				break
			}
			return err
		}
		if err := Fill(ce.Ctx, b.Ptr(), b.Size(), uint64(i)); err != nil {
			return err
		}
		opts.Meta = Meta(uint64(i))
		if broadcast {
			_, err = e.Broadcast(loop, b, opts)
		} else {
			err = e.Offer(loop, b, opts)
		}
		if err != nil {
			if loop.Err() != nil {
				break
			}
			return err
		}
		rep.Offers++
		if i == 0 {
			fmt.Println("OFFERED")
		}
		if retireAt > 0 && i+1 == retireAt {
			old := ring
			if ring, err = e.NewRing(n, size); err != nil {
				return err
			}
			retiring.Add(1)
			go func() {
				defer retiring.Done()
				if err := old.Retire(ctx); err != nil {
					rep.RetireErr = err.Error()
				}
			}()
			fmt.Println("RETIRING")
		}
		if restartEvery > 0 && (i+1)%restartEvery == 0 && restarts > 0 {
			// A restart on purpose, in this process: the consumers are
			// told to come back, and a new exporter (a new session,
			// whose allocation ids start again) takes the path.
			restarts--
			retiring.Wait()
			rctx, cancel := context.WithTimeout(ctx, ExpectTimeout)
			err := e.Restart(rctx)
			cancel()
			if err != nil {
				return fmt.Errorf("restart: %w", err)
			}
			if e, err = share.NewExporter(ctx, ce.Ctx, os.Getenv(ParamPath), share.ExporterConfig{Logger: ce.Log, Sharing: sharing}); err != nil {
				return err
			}
			fmt.Println("RESTARTED")
			if err := e.WaitConsumers(wctx, Param(ParamConsumers, 1)); err != nil {
				return err
			}
			if ring, err = e.NewRing(n, size); err != nil {
				return err
			}
		}
		if sleep > 0 {
			time.Sleep(sleep)
		}
	}
	retiring.Wait()
	fmt.Println("DONE")
	sctx, cancel2 := context.WithTimeout(ctx, ExpectTimeout)
	defer cancel2()
	if err := e.Shutdown(sctx); err != nil {
		rep.ShutdownErr = err.Error()
	}
	rep.Stats = e.Stats()
	report(rep)
	return nil
}

// ConsumerReport is what the consumer routine reports.
type ConsumerReport struct {
	Leases         int
	Bad            []string // leases whose bytes were wrong
	Errors         []string // errors from Next other than the end
	Gone           string   // the ErrProducerGone that ended it, if not a goodbye
	EOF            bool     // the producer said goodbye
	Stats          share.ImporterStats
	Registry       share.RegistryStats // after Shutdown
	ShutdownErr    string
	AllocsPerLease float64
	CPUPerLease    float64 // nanoseconds of process CPU time (user and system) per lease
}

// consumer takes leases, checks their bytes against their metadata and
// releases them, until the producer ends or ParamMax leases; then shuts
// down and reports.
func consumer(ce *ChildEnv) error {
	ctx := context.Background()
	cfg := share.ImporterConfig{Credits: uint32(Param(ParamCredits, 8)), Logger: ce.Log}
	if os.Getenv(ParamStream) == "1" {
		// A blocking stream: its work is ordered after work on the legacy NULL
		// stream, where Fill's and Check's synchronous copies run (a copy from
		// pageable memory may return before its DMA lands), so the event the
		// producer records on it, and the consumer's wait on it, order those
		// copies. A non-blocking stream lost the tail of a batch on an H200.
		s, err := ce.Ctx.NewStream(false)
		if err != nil {
			return err
		}
		defer s.Close()
		cfg.Stream = s
	}
	dctx, cancel := context.WithTimeout(ctx, ExpectTimeout)
	defer cancel()
	im, err := share.Dial(dctx, os.Getenv(ParamPath), ce.Ctx, cfg)
	if err != nil {
		return err
	}
	defer im.Close()
	fmt.Println("CONNECTED")
	hold, max, verify := Param(ParamHold, 0), Param(ParamMax, 0), Param(ParamVerify, 1) != 0
	after := os.Getenv(ParamAfter) == "1"
	var busy, scratch driver.DevicePtr
	if after {
		if cfg.Stream == nil {
			return errors.New("SHARE_RELEASE_AFTER needs SHARE_STREAM=1")
		}
		var err error
		if ce.D.Backend() == driver.BackendSim {
			// The sim's work is synchronous: delaying proves nothing.
			busySize, busyRepeats = 64<<10, 1
		}
		if busy, err = ce.Ctx.Alloc(busySize); err != nil {
			return err
		}
		defer ce.Ctx.Free(busy)
		if scratch, err = ce.Ctx.Alloc(1 << 20); err != nil {
			return err
		}
		defer ce.Ctx.Free(scratch)
	}
	sleep := time.Duration(Param(ParamSleep, 0)) * time.Microsecond
	var rep ConsumerReport
	var held []*share.Lease
	var ms runtime.MemStats
	var mallocs uint64
	var cpu0 time.Duration
	for {
		l, err := im.Next(ctx)
		if err != nil {
			switch {
			case errors.Is(err, io.EOF):
				rep.EOF = true
			case errors.Is(err, share.ErrProducerGone):
				rep.Gone = err.Error()
			default:
				rep.Errors = append(rep.Errors, err.Error())
				fmt.Printf("NEXTERR %v\n", err)
				if errors.Is(err, share.ErrPeerAccessUnsupported) && errors.Is(err, driver.ErrPeerAccessUnsupported) {
					fmt.Printf("PEERERR %v\n", err)
				}
				continue
			}
			break
		}
		rep.Leases++
		if rep.Leases == 1 {
			runtime.ReadMemStats(&ms)
			mallocs = ms.Mallocs
			cpu0 = CPUTime()
		}
		n, ok := ParseMeta(l.Meta())
		if !ok {
			rep.Bad = append(rep.Bad, fmt.Sprintf("lease %d: metadata %x", l.Seq(), l.Meta()))
		} else if verify {
			if err := Check(ce.Ctx, l.Ptr(), l.Size(), n); err != nil {
				rep.Bad = append(rep.Bad, err.Error())
			}
		}
		if sleep > 0 {
			time.Sleep(sleep)
		}
		if after {
			// The copy runs after busy work on the stream, so that a
			// producer that did not wait for it would overwrite the
			// buffer first; the check of the copy would then fail.
			if err := releaseAfterCopy(ce.Ctx, l, busy, scratch, n, &rep); err != nil {
				return err
			}
			if max > 0 && rep.Leases >= max {
				break
			}
			continue
		}
		if len(held) < hold {
			held = append(held, l)
			if len(held) == hold {
				fmt.Printf("HELD %d\n", hold)
				ce.waitLine("release")
				for _, h := range held {
					h.Release()
				}
				fmt.Println("RELEASED")
				hold = 0
			}
			continue
		}
		l.Release()
		if max > 0 && rep.Leases >= max {
			break
		}
	}
	if Param(ParamLinger, 0) == 1 {
		// A process that outlives its connection, as a lost consumer
		// that may still read what it mapped does, until the test ends.
		io.Copy(io.Discard, ce.In)
	}
	if rep.Leases > 1 {
		runtime.ReadMemStats(&ms)
		rep.AllocsPerLease = float64(ms.Mallocs-mallocs) / float64(rep.Leases-1)
		rep.CPUPerLease = float64(CPUTime()-cpu0) / float64(rep.Leases-1)
	}
	for _, h := range held {
		h.Release()
	}
	sctx, cancel2 := context.WithTimeout(ctx, ExpectTimeout)
	defer cancel2()
	if err := im.Shutdown(sctx); err != nil {
		rep.ShutdownErr = err.Error()
	}
	rep.Stats = im.Stats()
	rep.Registry = im.Registry().Stats()
	report(rep)
	return nil
}

// RawReport is what the raw producer reports.
type RawReport struct {
	Releases int
	Closed   bool
	FreeErr  string
}

// busySize and busyRepeats are the memsets that delay a stream-ordered
// consumer's copy: long enough that the release reaches the producer (it
// is pushed within releaseDelay, 100 µs) well before the copy runs, so
// that a producer that did not wait for it would overwrite the buffer
// first. One memset of 64 MiB, about 25 µs on an H100, was not: a producer
// whose refill did not wait passed TestStreamOrderedRelease on two H100s
// (2026-11-26). 32 of them take about 1 ms.
var (
	busySize    uint64 = 64 << 20
	busyRepeats        = 32
)

// releaseAfterCopy queues, on the lease's stream, busy work and then a copy
// of the lease into scratch, releases the lease stream-ordered, and checks
// the copy once the stream is done: it holds batch n's bytes only if the
// producer waited for the copy before it wrote the buffer again.
func releaseAfterCopy(ctx *driver.Context, l *share.Lease, busy, scratch driver.DevicePtr, n uint64, rep *ConsumerReport) error {
	s := l.Stream()
	if s == nil {
		return errors.New("a lease without a stream")
	}
	size := min(l.Size(), 1<<20)
	for range busyRepeats {
		if err := ctx.MemsetAsync(busy, byte(n), busySize, s); err != nil {
			return err
		}
	}
	if err := ctx.CopyDtoDAsync(scratch, l.Ptr(), size, s); err != nil {
		return err
	}
	if err := l.ReleaseAfter(s); err != nil {
		return err
	}
	if err := s.Synchronize(); err != nil {
		return err
	}
	if err := Check(ctx, scratch, size, n); err != nil {
		rep.Bad = append(rep.Bad, "after a stream-ordered release: "+err.Error())
	}
	return nil
}

// CPUTime is the CPU time (user and system) this process has used.
func CPUTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
