//go:build linux

package share_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
)

// TestMisuseSentinels: a buffer of another exporter and Free of a
// registered buffer fail with sentinels a caller can match, not only text.
func TestMisuseSentinels(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	e1, e2 := newExporter(t, env), newExporter(t, env)
	r, err := e2.NewRing(1, 64)
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := e1.Offer(ctx, b, share.OfferOptions{}); !errors.Is(err, share.ErrForeignBuffer) {
		t.Errorf("Offer of another exporter's buffer: %v, want ErrForeignBuffer", err)
	}
	if _, err := e1.Broadcast(ctx, b, share.OfferOptions{}); !errors.Is(err, share.ErrForeignBuffer) {
		t.Errorf("Broadcast of another exporter's buffer: %v, want ErrForeignBuffer", err)
	}
	if err := e1.Retire(ctx, b); !errors.Is(err, share.ErrForeignBuffer) {
		t.Errorf("Retire of another exporter's buffer: %v, want ErrForeignBuffer", err)
	}
	if err := e1.Offer(ctx, nil, share.OfferOptions{}); !errors.Is(err, share.ErrForeignBuffer) {
		t.Errorf("Offer(nil): %v, want ErrForeignBuffer", err)
	}

	p, err := env.Ctx.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer env.Ctx.Free(p)
	rb, err := e1.Register(p, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := rb.Free(); !errors.Is(err, share.ErrRegistered) {
		t.Errorf("Free of a registered buffer: %v, want ErrRegistered", err)
	}
	if err := e1.Retire(ctx, rb); err != nil {
		t.Errorf("Retire of the registered buffer: %v", err)
	}
}

// TestErrClosedIsOneValue: share.ErrClosed, transport.ErrClosed and
// driver.ErrClosed are one value, so a "closed" from any layer, wrapped,
// matches whichever of the three names a caller holds.
func TestErrClosedIsOneValue(t *testing.T) {
	names := map[string]error{"share": share.ErrClosed, "transport": transport.ErrClosed, "driver": driver.ErrClosed}
	for from, err := range names {
		wrapped := fmt.Errorf("%s: something: %w", from, err)
		for name, target := range names {
			if !errors.Is(wrapped, target) {
				t.Errorf("%s.ErrClosed, wrapped (%v), does not match %s.ErrClosed", from, wrapped, name)
			}
		}
	}
}

// TestImporterClosedErrors: after the importer's Close, its calls and its
// leases' calls fail with ErrClosed (one value in every layer), whatever
// the layer below reported (a closed connection, a closed mapping), and
// not with ErrProducerGone: the producer did not go.
func TestImporterClosedErrors(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 2})
	if err != nil {
		t.Fatal(err)
	}
	l, err := im.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := im.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = im.Next(ctx)
	if !errors.Is(err, share.ErrClosed) {
		t.Errorf("Next after Close: %v, want share.ErrClosed", err)
	}
	if errors.Is(err, share.ErrProducerGone) {
		t.Errorf("Next after Close: %v matches share.ErrProducerGone", err)
	}
	buf := make([]byte, 64)
	if _, err := l.CopyToHost(buf); !errors.Is(err, share.ErrClosed) {
		t.Errorf("CopyToHost of a lease after the importer's Close: %v, want share.ErrClosed", err)
	}
	l.Release()
	if err := im.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	p.Wait()
}

// TestConnectionErrorsReachableFromShare: the connection's errors a user
// of share matches are the very values of package transport, under share's
// names, so that a transport error, wrapped, matches the share name and
// the other way round; and a peer's error message is reachable with
// errors.As through share.RemoteError.
func TestConnectionErrorsReachableFromShare(t *testing.T) {
	pairs := map[string][2]error{
		"ErrDisconnected":      {share.ErrDisconnected, transport.ErrDisconnected},
		"ErrWriteTimeout":      {share.ErrWriteTimeout, transport.ErrWriteTimeout},
		"ErrTimeout":           {share.ErrTimeout, transport.ErrTimeout},
		"ErrRemote":            {share.ErrRemote, transport.ErrRemote},
		"ErrPeerRefused":       {share.ErrPeerRefused, transport.ErrPeerRefused},
		"ErrHandshake":         {share.ErrHandshake, transport.ErrHandshake},
		"ErrVersion":           {share.ErrVersion, transport.ErrVersion},
		"ErrUnsafePath":        {share.ErrUnsafePath, transport.ErrUnsafePath},
		"ErrNotSupported":      {share.ErrNotSupported, transport.ErrNotSupported},
		"ErrMalformed":         {share.ErrMalformed, transport.ErrMalformed},
		"ErrUnexpectedMessage": {share.ErrUnexpectedMessage, transport.ErrUnexpectedMessage},
		"ErrUnknownMessage":    {share.ErrUnknownMessage, transport.ErrUnknownMessage},
		"ErrFrameTooLarge":     {share.ErrFrameTooLarge, transport.ErrFrameTooLarge},
		"ErrCredit":            {share.ErrCredit, transport.ErrCredit},
		"ErrLimit":             {share.ErrLimit, transport.ErrLimit},
	}
	for name, p := range pairs {
		if p[0] == nil || !errors.Is(fmt.Errorf("x: %w", p[1]), p[0]) || !errors.Is(fmt.Errorf("x: %w", p[0]), p[1]) {
			t.Errorf("share.%s and transport.%s are not one value", name, name)
		}
	}
	var remote error = fmt.Errorf("x: %w", &transport.RemoteError{Code: 11, Message: "lease held too long", Peer: "producer"})
	var re *share.RemoteError
	if !errors.As(remote, &re) || re.Code != 11 || !errors.Is(remote, share.ErrTimeout) {
		t.Errorf("a peer's timeout error, through share's names: As %v, Is ErrTimeout %v", re, errors.Is(remote, share.ErrTimeout))
	}
}

// TestProducerIsShareType: Importer.Producer describes the producer with
// share's own Peer: its pid (this process started it, so it is visible)
// and the device it offers from, copied so that the caller's changes do
// not reach the importer.
func TestProducerIsShareType(t *testing.T) {
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
	var peer share.Peer = im.Producer()
	if peer.PID <= 0 || len(peer.Devices) != 1 {
		t.Fatalf("Producer() = %+v, want a pid and one device", peer)
	}
	peer.Devices[0] = driver.UUID{}
	if again := im.Producer(); again.Devices[0] == (driver.UUID{}) {
		t.Errorf("a change to Producer().Devices reached the importer: %+v", again)
	}
	if got := peer.String(); got != fmt.Sprintf("pid %d uid %d", peer.PID, peer.UID) {
		t.Errorf("Peer.String() = %q", got)
	}
	// One lease before the end: the producer then has seen this consumer
	// (its WaitConsumers returned), and ends when its input closes;
	// an importer closed before that left it waiting for a consumer.
	l, err := im.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	l.Release()
	im.Close()
	p.Wait()
}
