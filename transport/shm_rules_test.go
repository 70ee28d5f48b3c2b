//go:build linux

package transport

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// offerUnread queues on prod an offer that cons leaves in its lane, and
// then one that carries a descriptor, which the producer sends only once
// the lane is read to its end: the producer's writer waits for cons.
func offerUnread(t *testing.T, prod *Conn) {
	t.Helper()
	ctx := testCtx(t)
	o := testOffer()
	o.Seq = 100
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	if err := prod.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.MemfdCreate("cudashare-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	o.Seq, o.FDs = 101, []int{fd}
	err = prod.SendOffer(ctx, &o)
	unix.Close(fd)
	if err != nil {
		t.Fatal(err)
	}
}

// recvUntilError reads cons until it fails, closing any descriptors, and
// returns the error.
func recvUntilError(t *testing.T, cons *Conn) error {
	t.Helper()
	ctx := testCtx(t)
	var m Message
	for {
		if err := cons.Recv(ctx, &m); err != nil {
			return err
		}
		if m.Kind == KindOffer {
			closeFDs(m.Offer.FDs)
		}
	}
}

// TestShmPausedReaderKept: a consumer that stops reading its lane for
// three times the producer's write timeout, with a lane nearly empty (a
// trainer saving a checkpoint), while the producer must send it a
// descriptor, is not dropped: the write deadline runs only while a lane
// is full (PROTOCOL.md sections 2.3 and 7). Once it reads again, it gets
// the offer it left and the one with the descriptor.
func TestShmPausedReaderKept(t *testing.T) {
	checkNoFDLeak(t)
	pcfg, ccfg := shmConfigs(t)
	pcfg.WriteTimeout = 300 * time.Millisecond
	prod, cons := pair(t, pcfg, ccfg)
	exchange(t, prod, cons, 10)
	offerUnread(t, prod)
	time.Sleep(3 * pcfg.WriteTimeout) // the pause under test, not a synchronisation
	if err := prod.Err(); err != nil {
		t.Fatalf("the producer dropped a consumer that paused with room in its lane: %v", err)
	}
	ctx := testCtx(t)
	var m Message
	for _, want := range []struct {
		seq uint64
		fds int
	}{{100, 0}, {101, 1}} {
		if err := cons.Recv(ctx, &m); err != nil {
			t.Fatalf("after the pause: %v", err)
		}
		closeFDs(m.Offer.FDs)
		if m.Kind != KindOffer || m.Offer.Seq != want.seq || len(m.Offer.FDs) != want.fds {
			t.Fatalf("after the pause: %v seq %d with %d descriptors, want offer %d with %d", m.Kind, m.Offer.Seq, len(m.Offer.FDs), want.seq, want.fds)
		}
	}
	if err := prod.Flush(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestShmStoppedReaderBehindDescriptor: a consumer that stops reading
// (SIGSTOP) while the producer's writer waits for it to read its lane
// before a descriptor, with more offers queued behind that one than the
// room it left in the lane, is dropped after the write timeout, as it
// would be were the lane full: those offers would have filled it. The
// writer waited without a deadline, and with the lease deadline off the
// consumer was never dropped. Reading again, it gets the producer's error
// (code 11, timeout) after the offer it left in the lane.
func TestShmStoppedReaderBehindDescriptor(t *testing.T) {
	checkNoFDLeak(t)
	pcfg, ccfg := shmConfigs(t)
	pcfg.WriteTimeout = 300 * time.Millisecond
	ccfg.Credits = MaxWindow
	prod, cons := pair(t, pcfg, ccfg)
	exchange(t, prod, cons, 10)
	offerUnread(t, prod) // offer 100 left in the lane, 101 with a descriptor waiting
	ctx := testCtx(t)
	o := testOffer()
	o.Meta = mustMarshal(strings.Repeat("x", 2000))
	for i := range 2 * laneSize / 2000 {
		o.Seq = uint64(102 + i)
		if err := prod.SendOffer(ctx, &o); err != nil {
			t.Fatalf("offer %d: %v", o.Seq, err)
		}
	}
	// The hang guard only: the drop comes after the write timeout.
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err := prod.Flush(fctx)
	cancel()
	if !errors.Is(err, ErrWriteTimeout) {
		t.Fatalf("the producer, with a stopped consumer and a lane's worth of offers behind a descriptor: %v, want ErrWriteTimeout", err)
	}
	var m Message
	if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindOffer || m.Offer.Seq != 100 {
		t.Fatalf("the consumer, reading again: %v %v seq %d, want the offer left in its lane, 100", err, m.Kind, m.Offer.Seq)
	}
	if err := recvUntilError(t, cons); !errors.Is(err, ErrRemote) || !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "shm lane") {
		t.Fatalf("the consumer got %v, want the producer's error: a timeout, naming the shm lane", err)
	}
}

// TestShmHeadFlips: a consumer whose lane head flips back and forth
// while the producer waits for it to read the lane before a descriptor
// breaks the lane's rules (a head never goes backwards): the producer
// drops it with ErrMalformed, and tells it so (error code 3), rather than
// taking each flip for progress and waiting for ever.
func TestShmHeadFlips(t *testing.T) {
	checkNoFDLeak(t)
	pcfg, ccfg := shmConfigs(t)
	pcfg.WriteTimeout = 300 * time.Millisecond
	prod, cons := pair(t, pcfg, ccfg)
	exchange(t, prod, cons, 10)
	head := prod.shm.out.head // the word the consumer writes
	read := atomic.LoadUint64(head)
	offerUnread(t, prod)
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for i := 0; ; i++ {
			select {
			case <-stop:
				atomic.StoreUint64(head, read)
				return
			default:
			}
			atomic.StoreUint64(head, read-uint64(i%2)*read) // read, 0, read, 0, ...
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	err := prod.Flush(ctx)
	cancel()
	close(stop)
	<-stopped
	if !errors.Is(err, ErrMalformed) {
		t.Fatalf("the producer, with the consumer's head flipping: %v, want ErrMalformed", err)
	}
	if err := recvUntilError(t, cons); !errors.Is(err, ErrRemote) || !errors.Is(err, ErrMalformed) {
		t.Fatalf("the consumer got %v, want the producer's error message: malformed", err)
	}
}

// TestShmBadHeadTold: a consumer whose head claims more read than was
// written is dropped with ErrMalformed and told so with an error message
// (code 3), whether the producer finds it writing an offer or waiting for
// the lane to be read before a descriptor; not with a timeout, and not
// with only an end of stream.
func TestShmBadHeadTold(t *testing.T) {
	for _, fds := range []int{0, 1} {
		t.Run([]string{"offer", "offer with a descriptor"}[fds], func(t *testing.T) {
			checkNoFDLeak(t)
			pcfg, ccfg := shmConfigs(t)
			pcfg.WriteTimeout = 300 * time.Millisecond
			prod, cons := pair(t, pcfg, ccfg)
			exchange(t, prod, cons, 10)
			atomic.AddUint64(prod.shm.out.head, 1<<40)
			ctx := testCtx(t)
			o := testOffer()
			o.Seq = 100
			if fds > 0 {
				fd, err := unix.MemfdCreate("cudashare-test", unix.MFD_CLOEXEC)
				if err != nil {
					t.Fatal(err)
				}
				defer unix.Close(fd)
				o.FDs = []int{fd}
			}
			err := sendUntilHeadLooked(ctx, prod, &o)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("send: %v, want ErrMalformed", err)
			}
			if err := recvUntilError(t, cons); !errors.Is(err, ErrRemote) || !errors.Is(err, ErrMalformed) {
				t.Fatalf("the consumer got %v, want the producer's error message: malformed", err)
			}
		})
	}
}

// sendUntilHeadLooked sends copies of o, with growing sequence numbers
// and 2 KiB of metadata, until the producer looks at the consumer's head:
// a writer looks only when the room it saw at its last look is short (or
// before descriptors), so a lie is found at the offer that needs the
// room, within one lane's worth of offers. It returns the first error, or
// Flush's.
func sendUntilHeadLooked(ctx context.Context, prod *Conn, o *Offer) error {
	// Offers of 2 KiB of metadata each (a msgpack bin 16): the lane's
	// room runs short well within the consumer's window of credits.
	o.Meta = append([]byte{0xc5, 2048 >> 8, 2048 & 0xff}, make([]byte, 2048)...)
	for range 2*laneSize/2048 + 1 {
		if err := prod.SendOffer(ctx, o); err != nil {
			return err
		}
		o.Seq++
	}
	return prod.Flush(ctx)
}

// TestShmDoorbellStorm: a consumer that rings the doorbell without
// writing anything into its lane, over and over, is dropped with
// ErrMalformed and told so, instead of costing the producer's reader a
// wake-up per doorbell for as long as it likes. A doorbell answers the
// reader's sleep (PROTOCOL.md section 2.3): a peer that keeps the rules
// never sends more than the reader slept; the tests of two Conns, which
// sleep and ring all the time (TestShmOneCredit, TestShmAsleep), check
// that it never trips on one.
func TestShmDoorbellStorm(t *testing.T) {
	checkNoFDLeak(t)
	pcfg, ccfg := shmConfigs(t)
	prod, cons := pair(t, pcfg, ccfg)
	exchange(t, prod, cons, 10)
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		bells := make([]byte, 4096) // 1024 doorbells
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := cons.nc.Write(bells); err != nil {
				return // the producer hung up
			}
		}
	}()
	// A watchdog, not a timing: a reader that takes doorbells without end
	// never gets back to its ctx, and only Close ends its Recv.
	errc := make(chan error, 1)
	go func() {
		// Releases of the exchange may come first.
		var m Message
		for {
			if err := prod.Recv(testCtx(t), &m); err != nil {
				errc <- err
				return
			}
		}
	}()
	var err error
	select {
	case err = <-errc:
	case <-time.After(10 * time.Second):
		close(stop)
		prod.Close()
		<-errc
		<-stopped
		t.Fatal("the producer's Recv still takes doorbells after 10s")
	}
	close(stop)
	<-stopped
	if !errors.Is(err, ErrMalformed) {
		t.Fatalf("the producer's Recv under a storm of doorbells: %v, want ErrMalformed", err)
	}
	if err := recvUntilError(t, cons); !errors.Is(err, ErrRemote) || !errors.Is(err, ErrMalformed) {
		t.Fatalf("the consumer got %v, want the producer's error message: malformed", err)
	}
}
