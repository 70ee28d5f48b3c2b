//go:build linux

package share_test

import (
	"context"
	"errors"
	"io"
	"net"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/pool"
	"github.com/seed743c36cf/cudashare/share"
)

// startProducer starts the producer routine at path and waits until it
// listens.
func startProducer(t *testing.T, path string, sharing share.Sharing, params ...string) *sharetest.Child {
	t.Helper()
	p := sharetest.Start(t, "producer", append([]string{sharetest.EnvParam(sharetest.ParamPath, path),
		sharetest.EnvParam(sharetest.ParamSharing, sharing)}, params...)...)
	p.Expect("LISTENING")
	return p
}

// nextGood takes one lease and checks its bytes against its metadata.
func nextGood(t *testing.T, ctx context.Context, im *share.Importer) (*share.Lease, uint64) {
	t.Helper()
	l, err := im.Next(ctx)
	if err != nil {
		t.Fatalf("Next: %v", err)
	}
	n, ok := sharetest.ParseMeta(l.Meta())
	if !ok {
		t.Fatalf("lease %d without the producer's metadata", l.Seq())
	}
	return l, n
}

// TestReconnectAfterKill proves that an importer with a ReconnectPolicy
// outlives its producer's SIGKILL: Next goes on with the leases of the
// producer started in its place, whose bytes are right; a lease held
// across the kill is, with VMM, still valid and right, and with legacy
// IPC says ErrProducerGone (its memory died with the producer), never
// reads and has a 0 pointer; its release goes nowhere and is counted.
// The new producer is a new session: its allocation ids start again, as
// the dead one's did, and the importer maps them anew (the old mapping
// stays the held lease's until it is released, then is closed).
func TestReconnectAfterKill(t *testing.T) { bothPaths(t, testReconnectAfterKill) }

func testReconnectAfterKill(t *testing.T, sharing share.Sharing) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := startProducer(t, path, sharing)
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 4, Reconnect: &share.ReconnectPolicy{Deadline: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	first := im.Producer().Session
	if first == 0 {
		t.Fatal("the producer named no session in its hello-ack")
	}
	held, n := nextGood(t, ctx, im)
	opens := im.Registry().Stats().Opens
	p.Kill()
	p2 := startProducer(t, path, sharing)
	defer p2.Kill()
	// Leases queued before the kill are dropped, never returned: every
	// lease Next returns from here is the new producer's, and the first
	// of those is its batch 0.
	var l *share.Lease
	for {
		var m uint64
		l, m = nextGood(t, ctx, im)
		if im.Stats().Reconnects == 1 && m == 0 && l.Generation() == 1 {
			break
		}
		if im.Stats().Reconnects == 1 {
			t.Fatalf("after the reconnection, batch %d (generation %d) came before the new producer's first", m, l.Generation())
		}
		l.Release() // the old producer's, returned before the kill was seen
	}
	if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), 0); err != nil {
		t.Fatalf("the new producer's first lease: %v", err)
	}
	if s := im.Producer().Session; s == first || s == 0 {
		t.Fatalf("the new producer's session %#x, the old one's %#x: want a new one", s, first)
	}
	if got := im.Registry().Stats().Opens; got <= opens {
		t.Fatalf("the new producer's allocation was not mapped anew (%d opens before, %d after): an old mapping was taken for it", opens, got)
	}
	l.Release()
	switch sharing {
	case share.SharingVMM:
		if err := held.Err(); err != nil {
			t.Fatalf("a VMM lease held across the kill: %v", err)
		}
		if err := sharetest.Check(env.Ctx, held.Ptr(), held.Size(), n); err != nil {
			t.Fatalf("a VMM lease held across the kill: %v", err)
		}
	case share.SharingIPC:
		if err := held.Err(); !errors.Is(err, share.ErrProducerGone) {
			t.Fatalf("Err of a legacy IPC lease held across the kill: %v, want ErrProducerGone", err)
		}
		if _, err := held.CopyToHost(make([]byte, 16)); !errors.Is(err, share.ErrProducerGone) {
			t.Fatalf("CopyToHost of a legacy IPC lease held across the kill: %v, want ErrProducerGone", err)
		}
		if held.Ptr() != 0 {
			t.Fatal("a dead legacy IPC lease has a pointer")
		}
	}
	dropped := im.Stats().ReleasesDropped
	held.Release()
	if got := im.Stats().ReleasesDropped; got != dropped+1 {
		t.Fatalf("ReleasesDropped %d after releasing the held lease, %d before: want one more", got, dropped)
	}
	// The new producer's leases keep coming and are right.
	for range 8 {
		l, m := nextGood(t, ctx, im)
		if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), m); err != nil {
			t.Fatalf("batch %d of the new producer: %v", m, err)
		}
		l.Release()
	}
	if err := im.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if m := im.Registry().Mappings(); m != 0 {
		t.Errorf("%d mappings open after Shutdown", m)
	}
}

// TestReconnectRestartOnPurpose proves that a producer's Restart sends
// the restarting goodbye: an importer with a ReconnectPolicy goes on with
// the next exporter (its leases all right, a pool's workers kept, none
// failing), and one without ends with ErrProducerRestarting, which is
// ErrProducerGone and not io.EOF (the stream did not end).
func TestReconnectRestartOnPurpose(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	const every, restarts = 16, 3
	p := startProducer(t, path, share.SharingAuto, sharetest.EnvParam(sharetest.ParamRestart, every),
		sharetest.EnvParam(sharetest.ParamRestarts, restarts), sharetest.EnvParam(sharetest.ParamCount, every*(restarts+1)))
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 4, Reconnect: &share.ReconnectPolicy{Deadline: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	var got, bad atomic.Uint64
	err = pool.Run(ctx, im, 2, func(ctx context.Context, l *share.Lease) error {
		n, _ := sharetest.ParseMeta(l.Meta())
		if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), n); err != nil {
			bad.Add(1)
			t.Errorf("batch %d: %v", n, err)
		}
		got.Add(1)
		return nil
	})
	if err != nil {
		t.Fatalf("the pool ended with %v, want nil at the last producer's goodbye", err)
	}
	if g := got.Load(); g != every*(restarts+1) || bad.Load() != 0 {
		t.Fatalf("%d batches handled (%d wrong), want %d, all right", g, bad.Load(), every*(restarts+1))
	}
	if r := im.Stats().Reconnects; r != restarts {
		t.Fatalf("%d reconnections, want %d", r, restarts)
	}
	p.Wait()

	// Without a policy, the restart ends the importer.
	p = startProducer(t, path, share.SharingAuto, sharetest.EnvParam(sharetest.ParamRestart, 1),
		sharetest.EnvParam(sharetest.ParamCount, 2))
	im, err = share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	for {
		l, err := im.Next(ctx)
		if err != nil {
			if !errors.Is(err, share.ErrProducerRestarting) || !errors.Is(err, share.ErrProducerGone) || errors.Is(err, io.EOF) {
				t.Fatalf("Next at a restart without a policy: %v, want ErrProducerRestarting and ErrProducerGone, not io.EOF", err)
			}
			break
		}
		l.Release()
	}
	p.Kill()
}

// TestReconnectDeadline proves that an importer whose producer never
// comes back gives up at its deadline, saying so, and that Next honours
// its context while the importer reconnects.
func TestReconnectDeadline(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := startProducer(t, path, share.SharingAuto)
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 2, Reconnect: &share.ReconnectPolicy{Deadline: 300 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	l, _ := nextGood(t, ctx, im)
	l.Release()
	p.Kill()
	for {
		l, err := im.Next(ctx)
		if err != nil {
			if !errors.Is(err, share.ErrReconnectDeadline) || !errors.Is(err, share.ErrProducerGone) {
				t.Fatalf("Next once no producer came back: %v, want ErrReconnectDeadline and ErrProducerGone", err)
			}
			break
		}
		l.Release() // queued before the kill
	}
	if err := im.Err(); !errors.Is(err, share.ErrReconnectDeadline) {
		t.Fatalf("Err: %v", err)
	}
	select {
	case <-im.Done():
	default:
		t.Fatal("Done is not closed after the deadline")
	}
}

// TestReconnectCloseDuringBackoff proves that Next's context ends a wait
// for a producer that does not come back, and that Close while the
// importer reconnects returns, leaves no goroutine behind, and makes
// Next say ErrClosed.
func TestReconnectCloseDuringBackoff(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := startProducer(t, path, share.SharingAuto)
	ctx := sharetest.Ctx(t)
	before := runtime.NumGoroutine()
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 2, Reconnect: &share.ReconnectPolicy{}}) // no deadline
	if err != nil {
		t.Fatal(err)
	}
	l, _ := nextGood(t, ctx, im)
	l.Release()
	p.Kill()
	for {
		nctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		l, err := im.Next(nctx)
		cancel()
		if err != nil {
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Next while reconnecting: %v, want its context's end", err)
			}
			break
		}
		l.Release() // queued before the kill
	}
	if err := im.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := im.Next(ctx); !errors.Is(err, share.ErrClosed) {
		t.Fatalf("Next after Close: %v, want ErrClosed", err)
	}
	// Goroutines end when they end: wait for the count to come back
	// rather than time anything.
	for runtime.NumGoroutine() > before {
		select {
		case <-ctx.Done():
			buf := make([]byte, 1<<16)
			t.Fatalf("%d goroutines after Close, %d before Dial:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// TestReconnectFirstProducerLate proves that an importer with a
// ReconnectPolicy dialed before any producer listens waits for one.
func TestReconnectFirstProducerLate(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	ctx := sharetest.Ctx(t)
	type dialed struct {
		im  *share.Importer
		err error
	}
	ch := make(chan dialed, 1)
	go func() {
		im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 2, Reconnect: &share.ReconnectPolicy{Deadline: time.Minute}})
		ch <- dialed{im, err}
	}()
	p := startProducer(t, path, share.SharingAuto)
	defer p.Kill()
	d := <-ch
	if d.err != nil {
		t.Fatal(d.err)
	}
	defer d.im.Close()
	l, n := nextGood(t, ctx, d.im)
	if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), n); err != nil {
		t.Fatal(err)
	}
	l.Release()
}

// TestReconnectPoolNeverHandsDeadLease proves that a pool's handler never
// gets a legacy IPC lease of a producer gone: while the only worker holds
// a lease, the producer is killed with more leases queued for it, and a
// new one starts; the held lease then says ErrProducerGone, and every
// lease the handler gets after it is the new producer's, alive and right,
// from its first batch on.
func TestReconnectPoolNeverHandsDeadLease(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := startProducer(t, path, share.SharingIPC)
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 4, Reconnect: &share.ReconnectPolicy{Deadline: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	holding, resume := make(chan struct{}), make(chan struct{})
	var calls int
	var firstErr error
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ran := make(chan error, 1)
	go func() {
		ran <- pool.Run(pctx, im, 1, func(_ context.Context, l *share.Lease) error {
			calls++
			if calls == 1 {
				close(holding)
				<-resume
				firstErr = l.Err()
				return nil
			}
			if err := l.Err(); err != nil {
				t.Errorf("handler call %d got a lease that is not alive: %v", calls, err)
				return nil
			}
			n, _ := sharetest.ParseMeta(l.Meta())
			if calls == 2 && (n != 0 || l.Generation() != 1) {
				t.Errorf("the first lease after the reconnection is batch %d, generation %d: want the new producer's first", n, l.Generation())
			}
			if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), n); err != nil {
				t.Errorf("batch %d: %v", n, err)
			}
			if calls == 10 {
				cancel()
			}
			return nil
		})
	}()
	<-holding
	// The producer goes on offering up to the credits while the worker
	// holds its lease: those it killed with are queued, or in flight.
	p.Kill()
	p2 := startProducer(t, path, share.SharingIPC)
	defer p2.Kill()
	for im.Stats().Reconnects == 0 {
		select {
		case <-ctx.Done():
			t.Fatal("no reconnection")
		case <-time.After(time.Millisecond):
		}
	}
	close(resume)
	if err := <-ran; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("pool: %v", err)
	}
	if !errors.Is(firstErr, share.ErrProducerGone) {
		t.Fatalf("the lease held across the kill: Err %v, want ErrProducerGone", firstErr)
	}
	if calls < 10 {
		t.Fatalf("%d handler calls, want 10", calls)
	}
}

// TestReconnectFirstProducerDiesInHandshake: an importer with a
// ReconnectPolicy whose first dial meets a producer that goes away in
// the middle of the handshake (it restarts, or crashes, at that moment)
// waits for the next one, as it does when it meets none: the policy
// covers the first producer too.
func TestReconnectFirstProducerDiesInHandshake(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	ctx := sharetest.Ctx(t)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	type dialed struct {
		im  *share.Importer
		err error
	}
	ch := make(chan dialed, 1)
	go func() {
		im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 2, Reconnect: &share.ReconnectPolicy{Deadline: time.Minute}})
		ch <- dialed{im, err}
	}()
	// The dying producer: it reads the consumer's hello, then is gone.
	c, err := ln.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	c.Read(make([]byte, 512))
	c.Close()
	ln.Close() // unlinks the path, as a listener that closes does
	var early *dialed
	select {
	case d := <-ch:
		early = &d // before the fix: at once, with the handshake's error
	default:
	}
	p := startProducer(t, path, share.SharingAuto)
	defer p.Kill()
	d := early
	if d == nil {
		got := <-ch
		d = &got
	}
	if d.err != nil {
		t.Fatalf("Dial with a ReconnectPolicy gave up on a producer gone during the handshake: %v", d.err)
	}
	defer d.im.Close()
	l, n := nextGood(t, ctx, d.im)
	if err := sharetest.Check(env.Ctx, l.Ptr(), l.Size(), n); err != nil {
		t.Fatal(err)
	}
	l.Release()
}
