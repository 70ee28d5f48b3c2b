//go:build linux

package share_test

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// TestShutdownRacesNext: Next hands leases out without the importer's
// lock, so Shutdown, which waits for every lease handed out, must not miss
// one that a worker is handing out at that moment. Workers take and
// release leases back to back while Shutdown begins, many times over: when
// Shutdown returns, every lease Next returned has been released, and no
// Next returns a lease after it.
func TestShutdownRacesNext(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	p, first, path := startAndDial(t, env, false)
	first.Close()
	const rounds, workers = 40, 4
	for round := range rounds {
		im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 8})
		if err != nil {
			t.Fatal(err)
		}
		var (
			out, taken atomic.Int64 // leases returned by Next and not yet released; in all
			after      atomic.Bool  // Shutdown has returned
			late       atomic.Int64 // leases Next returned after that
			wg         sync.WaitGroup
		)
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					l, err := im.Next(ctx)
					if err != nil {
						if !errors.Is(err, share.ErrClosed) {
							t.Errorf("round %d: Next: %v, want ErrClosed", round, err)
						}
						return
					}
					if after.Load() {
						late.Add(1)
					}
					out.Add(1)
					taken.Add(1)
					runtime.Gosched()
					out.Add(-1) // before Release: Shutdown cannot have returned yet
					l.Release()
				}
			}()
		}
		// Shutdown after a number of leases that moves from round to
		// round, so that it begins at different points of a handoff.
		for taken.Load() < int64(50+round*7) {
			if err := ctx.Err(); err != nil {
				t.Fatal(err)
			}
		}
		if err := im.Shutdown(ctx); err != nil {
			t.Fatalf("round %d: Shutdown: %v", round, err)
		}
		n := out.Load()
		after.Store(true)
		wg.Wait()
		if n != 0 || late.Load() != 0 {
			t.Fatalf("round %d: Shutdown returned with %d leases not released; %d leases handed out after it", round, n, late.Load())
		}
		if st := im.Stats(); st.Held != 0 || st.Mappings != 0 || st.Leases != st.Released {
			t.Fatalf("round %d: importer after Shutdown: %+v", round, st)
		}
		im.Close()
	}
	waitProducerClean(t, p)
}

// TestShutdownWhileHandingOut: Shutdown begins while a Next is handing a
// lease out, after it counted the lease and before it looked whether the
// importer had stopped. Shutdown waits for that lease; Next drops it (the
// producer gets it back) and says the importer is closed; nothing is
// left held or mapped.
func TestShutdownWhileHandingOut(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	p, im, _ := startAndDial(t, env, false)
	shut := make(chan error, 1)
	var once sync.Once
	var during share.ImporterStats
	share.SetHandingOut(func() {
		once.Do(func() {
			go func() { shut <- im.Shutdown(ctx) }()
			<-im.Done()
			during = im.Stats() // the lease is counted for Shutdown, not handed out
		})
	})
	defer share.SetHandingOut(nil)
	if l, err := im.Next(ctx); !errors.Is(err, share.ErrClosed) {
		t.Fatalf("Next while Shutdown began: lease %v, error %v; want ErrClosed", l != nil, err)
	}
	select {
	case err := <-shut:
		if err != nil {
			t.Fatalf("Shutdown: %v", err)
		}
	case <-time.After(sharetest.ExpectTimeout):
		t.Fatalf("Shutdown still waits after Next dropped the lease it was handing out: %+v", im.Stats())
	}
	if during.Held != 0 || during.Leases != 0 {
		t.Errorf("importer while Next was handing out: %+v, want nothing held or handed out", during)
	}
	if st := im.Stats(); st.Held != 0 || st.Leases != 0 || st.Mappings != 0 {
		t.Errorf("importer after Shutdown: %+v", st)
	}
	waitProducerClean(t, p)
}

// TestCloseWhileWaitingOnEvent: Close runs while a Next, which handed its
// lease out, is about to make its stream wait on the producer's event.
// Close returns without waiting for it and leaves the event alone: the
// Next returns its lease (whose pointer Close has made invalid, as it does
// any lease's), not a failed wait on a destroyed event, and then destroys
// the producer's events itself.
func TestCloseWhileWaitingOnEvent(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	p, im, _ := startAndDial(t, env, true)
	s, err := env.Ctx.NewStream(true)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var left atomic.Bool
	var once sync.Once
	share.SetEventWaiting(func() {
		once.Do(func() {
			if err := im.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		})
	})
	share.SetCloseLeavesEvents(func() { left.Store(true) })
	defer share.SetEventWaiting(nil)
	defer share.SetCloseLeavesEvents(nil)
	l, err := im.NextOn(ctx, s)
	if err != nil {
		t.Fatalf("Next while Close ran: %v, want its lease", err)
	}
	if !left.Load() {
		t.Errorf("Close did not leave the producer's events to the Next about to wait on one")
	}
	if n := share.ProducerEvents(im); n != 0 {
		t.Errorf("%d of the producer's events open after Close and the Next, want 0", n)
	}
	l.Release()
	if st := im.Stats(); st.Held != 0 || st.Leases != 1 || st.Released != 1 || st.Mappings != 0 {
		t.Errorf("importer after Close: %+v", st)
	}
	p.Wait()
}

// TestShutdownBoundedWhileNextWaitsOnProducer: a Next with no stream waits
// on the host for the producer's GPU work (here, work that does not end
// until the test says). A Shutdown whose context ends meanwhile closes the
// importer and returns: it does not wait for the GPU.
func TestShutdownBoundedWhileNextWaitsOnProducer(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	p, im, _ := startAndDial(t, env, true)
	gpu, waiting, nextDone := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	share.SetEventWaiting(func() { close(waiting); <-gpu })
	defer share.SetEventWaiting(nil)
	go func() {
		l, err := im.Next(ctx)
		if err == nil {
			l.Release()
		}
		nextDone <- err
	}()
	<-waiting
	sctx, cancel := context.WithCancel(ctx)
	cancel() // Shutdown cannot wait for the lease: it closes at once
	shut := make(chan error, 1)
	go func() { shut <- im.Shutdown(sctx) }()
	select {
	case err := <-shut:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Shutdown: %v, want context.Canceled", err)
		}
	case <-time.After(sharetest.ExpectTimeout):
		t.Errorf("Shutdown still runs while a Next waits for the producer's GPU work")
		close(gpu)
		<-shut
		return
	}
	if n := share.ProducerEvents(im); n == 0 {
		t.Errorf("Close destroyed the producer's events while a Next waited on one")
	}
	close(gpu)
	if err := <-nextDone; err != nil {
		t.Errorf("Next: %v, want its lease", err)
	}
	if n := share.ProducerEvents(im); n != 0 {
		t.Errorf("%d of the producer's events open once the Next is done, want 0", n)
	}
	p.Wait()
}

// TestReleaseAfterClose: a lease released stream-ordered after the
// importer's Close creates no release event: Close destroyed the others,
// and nothing would destroy a new one.
func TestReleaseAfterClose(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	p, im, _ := startAndDial(t, env, true)
	s, err := env.Ctx.NewStream(true)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	l, err := im.NextOn(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if err := im.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.ReleaseAfter(s); err != nil {
		t.Errorf("ReleaseAfter after Close: %v", err)
	}
	if n := share.ReleaseEvents(im); n != 0 {
		t.Errorf("%d release events after Close and a ReleaseAfter, want 0", n)
	}
	if st := im.Stats(); st.Held != 0 || st.Released != 1 {
		t.Errorf("importer: %+v", st)
	}
	p.Wait()
}

// startAndDial starts the test producer, offering with events if events,
// and dials it with 2 credits; the importer is closed at the test's end.
func startAndDial(t *testing.T, env *sharetest.Env, events bool) (*sharetest.Child, *share.Importer, string) {
	t.Helper()
	path := sharetest.SocketPath(t)
	params := []string{sharetest.EnvParam(sharetest.ParamPath, path)}
	if events {
		params = append(params, sharetest.EnvParam(sharetest.ParamStream, 1))
	}
	p := sharetest.Start(t, "producer", params...)
	p.Expect("LISTENING")
	im, err := share.Dial(sharetest.Ctx(t), path, env.Ctx, share.ImporterConfig{Credits: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { im.Close() })
	return p, im, path
}

// waitProducerClean ends the test producer and checks that it shut down
// with every allocation freed and no consumer lost.
func waitProducerClean(t *testing.T, p *sharetest.Child) {
	t.Helper()
	p.Wait()
	var rep sharetest.ProducerReport
	p.Report(&rep)
	if rep.ShutdownErr != "" || rep.Stats.ConsumersLost != 0 || rep.Stats.Allocations != 0 {
		t.Errorf("producer: %+v", rep)
	}
}
