//go:build linux

package share_test

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// The reading of the producer's connection moves between Next and the
// background reader (importer_read.go). These tests run a consumer that calls
// Next back to back, so that Next reads the connection itself, and then
// stops calling it, or stops the importer, or cancels, while a Next reads.

// dialHot connects to a producer and takes n leases back to back,
// releasing each, so that Next has taken the connection over from the
// background reader; it checks the leases came in the producer's order.
func dialHot(t *testing.T, env *sharetest.Env, path string, credits uint32, n int) *share.Importer {
	t.Helper()
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: credits})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { im.Close() })
	for i := range n {
		l, err := im.Next(ctx)
		if err != nil {
			t.Fatalf("lease %d: %v", i, err)
		}
		if got, ok := sharetest.ParseMeta(l.Meta()); !ok || got != uint64(i) {
			t.Fatalf("lease %d carries batch %d (%v): out of order", i, got, ok)
		}
		l.Release()
	}
	st := im.Stats()
	t.Logf("%d of %d leases read by Next itself", st.Direct, st.Leases)
	if st.Direct == 0 {
		t.Errorf("no lease of %d taken back to back was read by Next itself", n)
	}
	return im
}

// TestNextReadsThenBackground: after a run of leases that Next read
// itself, the consumer stops calling Next; the producer then retires its
// ring and says goodbye, which only the background reader can answer. The
// producer's Shutdown must complete with nothing lost, and Next then says
// the producer is gone.
func TestNextReadsThenBackground(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	const n = 300
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path),
		sharetest.EnvParam(sharetest.ParamCount, n))
	p.Expect("LISTENING")
	im := dialHot(t, env, path, 4, n)
	p.Expect("DONE")
	p.Wait() // its Shutdown needs the retires answered and the goodbye read
	var rep sharetest.ProducerReport
	p.Report(&rep)
	if rep.ShutdownErr != "" || rep.Stats.ConsumersLost != 0 || rep.Stats.Allocations != 0 {
		t.Errorf("producer: %+v", rep)
	}
	_, err := im.Next(sharetest.Ctx(t))
	if !errors.Is(err, share.ErrProducerGone) || !errors.Is(err, io.EOF) {
		t.Errorf("Next after the producer's goodbye: %v, want ErrProducerGone and io.EOF", err)
	}
	if st := im.Stats(); st.Retired == 0 || st.Mappings != 0 {
		t.Errorf("importer after the producer's Shutdown: %+v", st)
	}
}

// nextAsync calls Next(ctx) on its own goroutine.
func nextAsync(im *share.Importer, ctx context.Context) <-chan error {
	done := make(chan error, 1)
	go func() {
		l, err := im.Next(ctx)
		if err == nil {
			l.Release()
			err = errors.New("a lease, from a producer that cannot offer")
		}
		done <- err
	}()
	return done
}

// waitErr waits for a blocked call's error; the limit only catches a hang.
func waitErr(t *testing.T, what string, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(sharetest.ExpectTimeout):
		t.Fatalf("%s did not return", what)
		return nil
	}
}

// TestNextReadingStops: a Next that waits for a producer that cannot
// offer (the consumer holds every credit), reading the connection itself,
// returns when its context ends, when the importer shuts down or closes,
// and loses nothing: the connection goes on as before.
func TestNextReadingStops(t *testing.T) {
	for _, how := range []string{"cancel", "shutdown", "close"} {
		t.Run(how, func(t *testing.T) {
			env := sharetest.Setup(t)
			path := sharetest.SocketPath(t)
			p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path))
			p.Expect("LISTENING")
			im := dialHot(t, env, path, 1, 100)
			ctx := sharetest.Ctx(t)
			held, err := im.Next(ctx)
			if err != nil {
				t.Fatal(err)
			}
			wctx, cancel := context.WithCancel(ctx)
			defer cancel()
			done := nextAsync(im, wctx)
			// Let the Next wait: the condition under test, not a timing.
			time.Sleep(20 * time.Millisecond)
			switch how {
			case "cancel":
				cancel()
				if err := waitErr(t, "Next whose context ended", done); !errors.Is(err, context.Canceled) {
					t.Fatalf("Next whose context ended: %v", err)
				}
				// The connection is whole: the next offer comes.
				held.Release()
				l, err := im.Next(ctx)
				if err != nil {
					t.Fatalf("Next after a cancelled one: %v", err)
				}
				l.Release()
				if err := im.Shutdown(ctx); err != nil {
					t.Fatal(err)
				}
			case "shutdown":
				sd := make(chan error, 1)
				go func() { sd <- im.Shutdown(ctx) }()
				if err := waitErr(t, "Next during Shutdown", done); !errors.Is(err, share.ErrClosed) {
					t.Fatalf("Next during Shutdown: %v, want ErrClosed", err)
				}
				held.Release()
				if err := waitErr(t, "Shutdown", sd); err != nil {
					t.Fatalf("Shutdown: %v", err)
				}
			case "close":
				if err := im.Close(); err != nil {
					t.Fatal(err)
				}
				if err := waitErr(t, "Next during Close", done); !errors.Is(err, share.ErrClosed) {
					t.Fatalf("Next during Close: %v, want ErrClosed", err)
				}
				held.Release() // does nothing now
			}
			if m := im.Registry().Mappings(); m != 0 {
				t.Errorf("%d mappings open after the importer ended", m)
			}
			p.Wait()
			var rep sharetest.ProducerReport
			p.Report(&rep)
			if rep.ShutdownErr != "" || rep.Stats.Allocations != 0 {
				t.Errorf("producer: %+v", rep)
			}
			if how != "close" && rep.Stats.ConsumersLost != 0 {
				t.Errorf("producer lost the consumer: %+v", rep)
			}
		})
	}
}

// TestNextManyWorkers: several goroutines call Next at once; whoever reads
// the connection hands what else has come to the others. Every lease
// comes once, and the ring's order holds within each goroutine's share.
func TestNextManyWorkers(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	const n, workers = 2000, 4
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path),
		sharetest.EnvParam(sharetest.ParamCount, n), sharetest.EnvParam(sharetest.ParamRing, 16))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	seen := make(chan uint64, n)
	errs := make(chan error, workers)
	for range workers {
		go func() {
			last := int64(-1)
			for {
				l, err := im.Next(ctx)
				if err != nil {
					errs <- err
					return
				}
				b, _ := sharetest.ParseMeta(l.Meta())
				if int64(b) <= last {
					errs <- errors.New("a worker's leases out of order")
					l.Release()
					return
				}
				last = int64(b)
				seen <- b
				l.Release()
			}
		}()
	}
	got := make(map[uint64]bool, n)
	for range n {
		select {
		case b := <-seen:
			if got[b] {
				t.Fatalf("batch %d handed out twice", b)
			}
			got[b] = true
		case err := <-errs:
			t.Fatalf("a worker stopped early: %v", err)
		}
	}
	p.Wait()
	for range workers {
		if err := waitErr(t, "a worker's Next", errs); !errors.Is(err, share.ErrProducerGone) {
			t.Errorf("a worker's end: %v, want ErrProducerGone", err)
		}
	}
	st := im.Stats()
	t.Logf("%d of %d leases read by Next itself", st.Direct, st.Leases)
	if st.Leases != n || st.Released != n || st.Held != 0 {
		t.Errorf("importer: %+v", st)
	}
}
