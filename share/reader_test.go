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

// TestNextReadingStops proves that a Next waiting for an offer, which
// reads the connection itself, returns promptly when its context ends (and
// the connection stays usable: the next Next gets the next offer) and when
// the importer is shut down.
func TestNextReadingStops(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	const gap = 600 * time.Millisecond // between the producer's offers
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path),
		sharetest.EnvParam(sharetest.ParamSleep, int(gap/time.Microsecond)))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	next := func(ctx context.Context) {
		t.Helper()
		l, err := im.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Release(); err != nil {
			t.Fatal(err)
		}
	}
	next(ctx)
	for range 2 {
		short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
		start := time.Now()
		_, err := im.Next(short)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Next with a short context between offers: %v, want context.DeadlineExceeded", err)
		}
		if d := time.Since(start); d > gap/2 {
			t.Fatalf("Next with a 20ms context returned after %v", d)
		}
		next(ctx)
	}

	// Shutdown waits for a lease held; meanwhile a Next reading returns.
	held, err := im.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := im.Next(ctx)
		done <- err
	}()
	time.Sleep(20 * time.Millisecond) // Next is reading, most likely
	shut := make(chan error, 1)
	go func() { shut <- im.Shutdown(ctx) }()
	select {
	case err := <-done:
		if !errors.Is(err, share.ErrClosed) {
			t.Errorf("Next during Shutdown: %v, want ErrClosed", err)
		}
	case err := <-shut:
		t.Fatalf("Shutdown returned (%v) with a lease held", err)
	case <-time.After(gap / 2):
		t.Fatal("Next reading did not return on Shutdown")
	}
	if err := held.Release(); err != nil {
		t.Fatal(err)
	}
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	p.Wait()
}
