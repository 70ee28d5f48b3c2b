//go:build linux

package transport

import (
	"errors"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestWriteTimeoutOnlyWhileBlocked proves the write timeout measures only
// a peer that stops reading: a healthy connection left idle for longer
// than WriteTimeout after a batched write still sends, both directly (a
// lone send on an idle connection) and through the writer goroutine.
func TestWriteTimeoutOnlyWhileBlocked(t *testing.T) {
	pcfg := testConfig(RoleProducer, nil)
	pcfg.WriteTimeout = 100 * time.Millisecond
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.AcceptVMM = true
	prod, cons := pair(t, pcfg, ccfg)
	ctx := testCtx(t)
	fd, err := unix.MemfdCreate("batched", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	o := testOffer()
	seq := uint64(0)
	send := func(fds []int) {
		t.Helper()
		seq++
		o.Seq, o.FDs = seq, fds
		if err := prod.SendOffer(ctx, &o); err != nil {
			t.Fatalf("offer %d: %v", seq, err)
		}
	}
	recv := func(want uint64) {
		t.Helper()
		var m Message
		if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindOffer || m.Offer.Seq != want {
			t.Fatalf("consumer: %v seq %d, %v; want offer %d", m.Kind, m.Offer.Seq, err, want)
		}
		closeFDs(m.Offer.FDs)
		if err := cons.SendRelease(ctx, want); err != nil {
			t.Fatal(err)
		}
	}
	// An offer with descriptors always leaves through the writer
	// goroutine's batched write.
	send([]int{fd})
	if err := prod.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	recv(seq)
	for range 3 {
		// Idle past the write timeout: the condition under test, not a
		// measurement.
		time.Sleep(3 * pcfg.WriteTimeout)
		send(nil) // idle: written at once by the sender
		recv(seq)
		send([]int{fd}) // batched
		send(nil)       // right behind it: batched too, or direct
		if err := prod.Flush(ctx); err != nil {
			t.Fatalf("flush on a healthy connection: %v", err)
		}
		recv(seq - 1)
		recv(seq)
	}
}

// TestSlowReaderNotTimedOut proves a peer that reads slowly but steadily
// is not failed, however long the whole of a large queue takes to drain:
// every byte it takes renews the write timeout.
func TestSlowReaderNotTimedOut(t *testing.T) {
	pcfg := testConfig(RoleProducer, nil)
	pcfg.WriteTimeout = 300 * time.Millisecond
	pcfg.MaxQueued = 8 << 20
	prod, p := rawConsumer(t, pcfg, MaxWindow)
	// A small socket buffer, so that the queue drains at the reader's
	// pace whatever the system's default.
	if err := prod.nc.SetWriteBuffer(64 << 10); err != nil {
		t.Fatal(err)
	}
	read := make(chan int64, 1)
	go func() {
		// About 3 MB/s: the queue below takes about a second to drain,
		// with progress every few tens of milliseconds.
		var n int64
		buf := make([]byte, 32<<10)
		for {
			k, err := p.c.Read(buf)
			n += int64(k)
			if err != nil {
				read <- n
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	ctx := testCtx(t)
	o := testOffer()
	o.Meta = mustMarshal(strings.Repeat("x", 4000))
	const offers = 750 // about 3 MB
	for i := range uint64(offers) {
		o.Seq = i
		if err := prod.SendOffer(ctx, &o); err != nil {
			t.Fatalf("offer %d: %v", i, err)
		}
	}
	if err := prod.Flush(ctx); err != nil {
		t.Fatalf("flush to a slow but steady reader: %v", err)
	}
	prod.Close()
	if n := <-read; n < offers*4000 {
		t.Fatalf("reader got %d bytes, want at least %d", n, offers*4000)
	}
}

// TestWriteTimeoutStalledPeer proves a peer that stops reading still fails
// the sender with ErrWriteTimeout, on a connection that was idle for
// longer than the timeout first and through the descriptor path too.
func TestWriteTimeoutStalledPeer(t *testing.T) {
	for _, fds := range []bool{false, true} {
		pcfg := testConfig(RoleProducer, nil)
		pcfg.WriteTimeout = 100 * time.Millisecond
		pcfg.MaxQueued = MinFrameSize
		l := listen(t, pcfg)
		p := rawDial(t, l.Addr())
		p.hello(RoleConsumer, MaxWindow, CapVMM) // and never reads
		prod, err := l.Accept(testCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		defer prod.Close()
		time.Sleep(2 * pcfg.WriteTimeout)
		fd, err := unix.MemfdCreate("stalled", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		o := testOffer()
		o.Meta = mustMarshal(strings.Repeat("x", 4000))
		if fds {
			o.FDs = []int{fd}
		}
		ctx := testCtx(t)
		for i := 0; err == nil; i++ {
			o.Seq = uint64(i)
			err = prod.SendOffer(ctx, &o)
		}
		if !errors.Is(err, ErrWriteTimeout) {
			t.Fatalf("fds %v: SendOffer to a peer that does not read: %v, want ErrWriteTimeout", fds, err)
		}
	}
}
