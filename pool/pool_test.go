//go:build linux

package pool_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/pool"
	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
)

// TestMain runs the tests, or a producer routine when the test binary is
// re-run as a child; it fails the run on a leaked descriptor or goroutine
// of this package.
func TestMain(m *testing.M) { sharetest.Main(m, "cudashare/pool.") }

// dial starts a producer child with params and connects an importer to it.
func dial(t *testing.T, env *sharetest.Env, credits uint32, params ...string) (*sharetest.Child, *share.Importer) {
	t.Helper()
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "producer", append([]string{sharetest.EnvParam(sharetest.ParamPath, path)}, params...)...)
	p.Expect("LISTENING")
	im, err := share.Dial(sharetest.Ctx(t), path, env.Ctx, share.ImporterConfig{Credits: credits})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { im.Close() })
	return p, im
}

// checkImporter checks that the pool left nothing held or mapped.
func checkImporter(t *testing.T, im *share.Importer) {
	t.Helper()
	if s := im.Stats(); s.Held != 0 || s.Mappings != 0 || s.Leases != s.Released {
		t.Errorf("importer after the pool: %+v", s)
	}
	if s := im.Registry().Stats(); s.Mappings != 0 || s.Opens != s.Closes {
		t.Errorf("registry after the pool: %+v", s)
	}
}

// producerDone ends the producer child (if it offers until stdin closes)
// and checks that its Shutdown freed everything with no lost consumer:
// the pool's importer closed its mappings and said goodbye.
func producerDone(t *testing.T, p *sharetest.Child) sharetest.ProducerReport {
	t.Helper()
	p.Wait()
	var rep sharetest.ProducerReport
	p.Report(&rep)
	if rep.ShutdownErr != "" || rep.RetireErr != "" || rep.Stats.ConsumersLost != 0 || rep.Stats.Allocations != 0 {
		t.Errorf("producer: %+v", rep)
	}
	return rep
}

// TestRun proves the normal case: four workers process every lease of a
// producer with the right bytes, Run returns nil at the producer's
// goodbye, and every lease is released and every mapping closed.
func TestRun(t *testing.T) {
	env := sharetest.Setup(t)
	p, im := dial(t, env, 8, sharetest.EnvParam(sharetest.ParamCount, 100))
	var n, bad atomic.Int32
	err := pool.Run(sharetest.Ctx(t), im, 4, func(ctx context.Context, l *share.Lease) error {
		seq, _ := sharetest.ParseMeta(l.Meta())
		if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), seq); err != nil {
			bad.Add(1)
		}
		n.Add(1)
		return nil
	})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n.Load() != 100 || bad.Load() != 0 {
		t.Errorf("handled %d leases (%d bad), want 100", n.Load(), bad.Load())
	}
	checkImporter(t, im)
	if rep := producerDone(t, p); rep.Stats.Releases != 100 {
		t.Errorf("producer saw %d releases, want 100", rep.Stats.Releases)
	}
}

// TestHandlerError proves that the first handler error ends the pool:
// Run returns it, the leases in flight are released, and the importer's
// shutdown lets the producer free everything.
func TestHandlerError(t *testing.T) {
	env := sharetest.Setup(t)
	p, im := dial(t, env, 8)
	boom := errors.New("boom")
	var n atomic.Int32
	err := pool.Run(sharetest.Ctx(t), im, 3, func(ctx context.Context, l *share.Lease) error {
		if n.Add(1) == 5 {
			return boom
		}
		return nil
	})
	if !errors.Is(err, boom) {
		t.Fatalf("Run: %v, want the handler's error", err)
	}
	checkImporter(t, im)
	producerDone(t, p)
}

// TestHandlerPanic proves that a panicking handler does not crash the
// process: Run returns a *PanicError with the value and the stack, and the
// lease is released.
func TestHandlerPanic(t *testing.T) {
	env := sharetest.Setup(t)
	p, im := dial(t, env, 8)
	err := pool.Run(sharetest.Ctx(t), im, 2, func(ctx context.Context, l *share.Lease) error {
		panicInHandler()
		return nil
	})
	var pe *pool.PanicError
	if !errors.As(err, &pe) {
		t.Fatalf("Run: %v, want a *PanicError", err)
	}
	if pe.Value != "kaboom" || !strings.Contains(string(pe.Stack), "panicInHandler") {
		t.Errorf("panic error: value %v, stack:\n%s", pe.Value, pe.Stack)
	}
	checkImporter(t, im)
	producerDone(t, p)
}

func panicInHandler() { panic("kaboom") }

// TestCancelDrains proves that cancelling the context stops the pool from
// taking new leases and waits for the handlers in flight (each finishes,
// and its lease is released) before Run returns the context's error.
func TestCancelDrains(t *testing.T) {
	env := sharetest.Setup(t)
	p, im := dial(t, env, 8)
	ctx, cancel := context.WithCancel(sharetest.Ctx(t))
	defer cancel()
	var started, finished atomic.Int32
	err := pool.Run(ctx, im, 4, func(_ context.Context, l *share.Lease) error {
		if started.Add(1) == 8 {
			cancel()
		}
		time.Sleep(20 * time.Millisecond) // ignores ctx: the pool must wait
		finished.Add(1)
		return nil
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v, want context.Canceled", err)
	}
	if s, f := started.Load(), finished.Load(); s != f || s < 8 {
		t.Errorf("%d handlers started, %d finished", s, f)
	}
	checkImporter(t, im)
	producerDone(t, p)
}

// TestProducerGone proves that a producer killed mid-stream ends the pool
// with ErrProducerGone (not a clean end) and leaves nothing mapped.
func TestProducerGone(t *testing.T) {
	env := sharetest.Setup(t)
	p, im := dial(t, env, 4)
	var n atomic.Int32
	err := pool.Run(sharetest.Ctx(t), im, 2, func(ctx context.Context, l *share.Lease) error {
		if n.Add(1) == 10 {
			p.Kill()
		}
		return nil
	})
	if !errors.Is(err, share.ErrProducerGone) || errors.Is(err, io.EOF) {
		t.Fatalf("Run: %v, want ErrProducerGone without a goodbye", err)
	}
	checkImporter(t, im)
}

// holdUntilEnd is a handler that runs enter, then holds its lease until its
// context ends (counted in cancelled) or 10 s pass, and returns nil or, with
// ret "ctx.Err", its context's error, as handlers usually do.
func holdUntilEnd(ret string, cancelled *atomic.Int32, enter func()) pool.Handler {
	return func(ctx context.Context, l *share.Lease) error {
		enter()
		select {
		case <-ctx.Done():
			cancelled.Add(1)
			if ret == "ctx.Err" {
				return ctx.Err()
			}
		case <-time.After(10 * time.Second):
		}
		return nil
	}
}

// TestProducerGoneEndsHandlers: every worker holds a lease in a handler
// that waits for its context, so none is in Next to see the producer die:
// the handlers' context must end with it, and Run return ErrProducerGone,
// whether the handlers then return nil or, as is usual, ctx.Err().
func TestProducerGoneEndsHandlers(t *testing.T) {
	for _, ret := range []string{"nil", "ctx.Err"} {
		t.Run(ret, func(t *testing.T) {
			env := sharetest.Setup(t)
			p, im := dial(t, env, 4)
			const workers = 2
			var in, cancelled atomic.Int32
			err := pool.Run(sharetest.Ctx(t), im, workers, holdUntilEnd(ret, &cancelled, func() {
				if in.Add(1) == workers {
					p.Kill()
				}
			}))
			if !errors.Is(err, share.ErrProducerGone) || errors.Is(err, io.EOF) {
				t.Fatalf("Run: %v, want ErrProducerGone without a goodbye", err)
			}
			if n := cancelled.Load(); n != workers {
				t.Fatalf("%d of %d handlers saw their context end when the producer died", n, workers)
			}
			checkImporter(t, im)
		})
	}
}

// inproc starts an exporter in this process with cfg, a ring of 4, and an
// importer connected to it.
func inproc(t *testing.T, env *sharetest.Env, cfg share.ExporterConfig, credits uint32) (*share.Exporter, *share.Ring, *share.Importer) {
	t.Helper()
	path := sharetest.SocketPath(t)
	cfg.Logger = sharetest.Logger(t)
	e, err := share.NewExporter(sharetest.Ctx(t), env.Ctx, path, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	r, err := e.NewRing(4, 4096)
	if err != nil {
		t.Fatal(err)
	}
	im, err := share.Dial(sharetest.Ctx(t), path, env.Ctx, share.ImporterConfig{Credits: credits, Logger: sharetest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { im.Close() })
	if err := e.WaitConsumers(sharetest.Ctx(t), 1); err != nil {
		t.Fatal(err)
	}
	return e, r, im
}

// offerN offers n of r's buffers.
func offerN(t *testing.T, e *share.Exporter, r *share.Ring, n int) {
	for i := range n {
		b, err := r.Acquire(sharetest.Ctx(t))
		if err != nil {
			t.Error(err)
			return
		}
		if err := e.Offer(sharetest.Ctx(t), b, share.OfferOptions{Meta: sharetest.Meta(uint64(i))}); err != nil {
			t.Error(err)
			return
		}
	}
}

// TestDroppedEndsHandlers: dropped for a lease held past the producer's
// lease timeout, the handlers see their context end, and Run returns the
// drop, whatever they return.
func TestDroppedEndsHandlers(t *testing.T) {
	for _, ret := range []string{"nil", "ctx.Err"} {
		t.Run(ret, func(t *testing.T) {
			env := sharetest.Setup(t)
			e, r, im := inproc(t, env, share.ExporterConfig{LeaseTimeout: 300 * time.Millisecond}, 4)
			go offerN(t, e, r, 2)
			var cancelled atomic.Int32
			err := pool.Run(sharetest.Ctx(t), im, 2, holdUntilEnd(ret, &cancelled, func() {}))
			if !errors.Is(err, share.ErrProducerGone) || !errors.Is(err, transport.ErrTimeout) || errors.Is(err, io.EOF) {
				t.Fatalf("Run: %v, want the drop for a timeout (ErrProducerGone, ErrTimeout)", err)
			}
			if n := cancelled.Load(); n != 2 {
				t.Fatalf("%d of 2 handlers saw their context end at the drop", n)
			}
		})
	}
}

// TestGoodbyeKeepsHandlers: a goodbye while every handler holds a lease
// does not end their context (the producer's Shutdown waits for them), and
// Run returns nil.
func TestGoodbyeKeepsHandlers(t *testing.T) {
	env := sharetest.Setup(t)
	e, r, im := inproc(t, env, share.ExporterConfig{}, 4)
	offerN(t, e, r, 2)
	var in, cancelled atomic.Int32
	shut := make(chan error, 1)
	err := pool.Run(sharetest.Ctx(t), im, 2, func(ctx context.Context, l *share.Lease) error {
		if in.Add(1) == 2 {
			go func() { shut <- e.Shutdown(sharetest.Ctx(t)) }()
		}
		select {
		case <-ctx.Done():
			cancelled.Add(1)
		case <-time.After(500 * time.Millisecond):
		}
		return nil
	})
	if err != nil || cancelled.Load() != 0 {
		t.Fatalf("Run: %v, %d handlers cancelled at a goodbye", err, cancelled.Load())
	}
	if err := <-shut; err != nil {
		t.Fatal(err)
	}
}

// TestCloseBeforeFree is the cross-process ordering end to end: the
// producer retires its first ring while the pool's slow handlers hold
// leases in it, goes on with a second ring, and shuts down; the retirement
// waits for the handlers, the consumer closes each mapping before
// confirming, the pool's shutdown closes everything before its goodbye,
// and the strict simulator records no violation.
func TestCloseBeforeFree(t *testing.T) {
	env := sharetest.Setup(t)
	p, im := dial(t, env, 6,
		sharetest.EnvParam(sharetest.ParamCount, 40),
		sharetest.EnvParam(sharetest.ParamRetire, 10),
		sharetest.EnvParam(sharetest.ParamStream, 1))
	var n atomic.Int32
	err := pool.Run(sharetest.Ctx(t), im, 3, func(ctx context.Context, l *share.Lease) error {
		time.Sleep(2 * time.Millisecond)
		seq, _ := sharetest.ParseMeta(l.Meta())
		if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), seq); err != nil {
			return err
		}
		n.Add(1)
		return nil
	})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n.Load() != 40 {
		t.Errorf("handled %d leases, want 40", n.Load())
	}
	checkImporter(t, im)
	if s := im.Stats(); s.Retired != 2 {
		t.Errorf("importer confirmed %d retirements, want 2 (the first ring, then the second at shutdown)", s.Retired)
	}
	if rep := producerDone(t, p); rep.Stats.Retired != 2 || rep.Stats.Releases != 40 {
		t.Errorf("producer: %+v", rep)
	}
}

// TestWorkerStreamsReleaseAfter: with Config.Context each worker's leases
// are ready on a stream of its own, four distinct streams for four
// workers, and with ReleaseAfter every lease goes back stream-ordered
// after the copy its handler queued there; the producer refills with
// AcquireOn and every copy holds its own batch.
func TestWorkerStreamsReleaseAfter(t *testing.T) {
	env := sharetest.Setup(t)
	p, im := dial(t, env, 8, sharetest.EnvParam(sharetest.ParamCount, 200), sharetest.EnvParam(sharetest.ParamStream, 1))
	const workers = 4
	scratch := make([]driver.DevicePtr, 0, workers)
	for range workers {
		d, err := env.Ctx.Alloc(4096)
		if err != nil {
			t.Fatal(err)
		}
		defer env.Ctx.Free(d)
		scratch = append(scratch, d)
	}
	var mu sync.Mutex
	streams := map[*driver.Stream]driver.DevicePtr{}
	var n, bad atomic.Int32
	err := pool.RunWith(sharetest.Ctx(t), im, pool.Config{Workers: workers, Context: env.Ctx, ReleaseAfter: true},
		func(ctx context.Context, l *share.Lease) error {
			s := l.Stream()
			if s == nil {
				return errors.New("a lease without its worker's stream")
			}
			mu.Lock()
			d, ok := streams[s]
			if !ok {
				d = scratch[len(streams)%workers]
				streams[s] = d
			}
			mu.Unlock()
			seq, _ := sharetest.ParseMeta(l.Meta())
			if err := env.Ctx.CopyDtoDAsync(d, l.Ptr(), l.Size(), s); err != nil {
				return err
			}
			// What the copy read, checked once it has run.
			if err := s.Synchronize(); err != nil {
				return err
			}
			if err := sharetest.Check(env.Ctx, d, l.Size(), seq); err != nil {
				bad.Add(1)
			}
			n.Add(1)
			return nil
		})
	if err != nil {
		t.Fatalf("RunWith: %v", err)
	}
	rep := producerDone(t, p)
	if n.Load() != 200 || bad.Load() != 0 || len(streams) != workers {
		t.Errorf("%d leases (%d wrong) on %d streams, want 200 on %d", n.Load(), bad.Load(), len(streams), workers)
	}
	if rep.Stats.OrderedReleases != 200 {
		t.Errorf("producer saw %d stream-ordered releases of 200", rep.Stats.OrderedReleases)
	}
	checkImporter(t, im)
}

// TestConfigRefused: a pool with a negative worker count fails, saying so.
func TestConfigRefused(t *testing.T) {
	env := sharetest.Setup(t)
	p, im := dial(t, env, 8, sharetest.EnvParam(sharetest.ParamCount, 1))
	p.Expect("OFFERED")
	err := pool.RunWith(sharetest.Ctx(t), im, pool.Config{Workers: -1}, func(context.Context, *share.Lease) error { return nil })
	if err == nil || !strings.Contains(err.Error(), "-1 workers") {
		t.Fatalf("RunWith with -1 workers: %v", err)
	}
	im.Close()
	p.Wait()
}

// TestNextCancelledWithLeasesReady: Next on a cancelled context returns
// the context's error even while leases are queued, so a worker loop
// bounded by its context ends under a producer that never stops offering.
func TestNextCancelledWithLeasesReady(t *testing.T) {
	env := sharetest.Setup(t)
	p, im := dial(t, env, 8, sharetest.EnvParam(sharetest.ParamCount, 4))
	p.Expect("OFFERED")
	l, err := im.Next(sharetest.Ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	l.Release()
	ctx, cancel := context.WithCancel(sharetest.Ctx(t))
	cancel()
	// Leases 2 to 4 are queued or on their way; none may come out.
	for range 50 {
		if l, err := im.Next(ctx); !errors.Is(err, context.Canceled) {
			if l != nil {
				l.Release()
			}
			t.Fatalf("Next on a cancelled context: %v, want context.Canceled", err)
		}
		time.Sleep(time.Millisecond)
	}
	if err := im.Shutdown(sharetest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	producerDone(t, p)
}
