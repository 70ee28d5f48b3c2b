//go:build linux

package transport

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/internal/testutil"
)

// socketModeEnv, set, makes testConfig disable the shm channel: TestSocketMode
// runs the package's connection tests again that way.
const socketModeEnv = "CUDASHARE_TRANSPORT_SOCKET"

// TestSocketMode runs the tests of two Conns talking again with the shm
// channel disabled, so that the socket path between two Go peers, which a peer
// without CapShm (the Python consumer) uses, stays covered.
func TestSocketMode(t *testing.T) {
	if os.Getenv(socketModeEnv) != "" {
		t.Skip("running in socket mode already")
	}
	if testing.Short() {
		t.Skip("-short")
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^Test(Exchange|Credits|FDPassing|Close|ConcurrentSenders|ShutdownWhilePeerWrites|SocketFullKeepsOrder|SendGoodbye.*|WriteTimeout.*|SlowReaderNotTimedOut|ReleaseEvent|RecvContext|RecvInterrupt|TryRecv|SendContext|ReceiveBufferGrows|CloseWithError|RemoteError.*|ErrorWaitsForWriteUnderWay|ShmMixed)$")
	cmd.Env = append(os.Environ(), socketModeEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "PASS") {
		t.Fatalf("the tests in socket mode: %v\n%s", err, out)
	}
}

// TestShmMixed: two Conns use the shm channel unless either side disables it,
// and then exchange the same messages on the socket.
func TestShmMixed(t *testing.T) {
	for _, tc := range []struct {
		name       string
		prod, cons bool // DisableShm
	}{{"both", false, false}, {"producer without", true, false}, {"consumer without", false, true}} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoFDLeak(t)
			pcfg, ccfg := testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil)
			pcfg.DisableShm = pcfg.DisableShm || tc.prod
			ccfg.DisableShm = ccfg.DisableShm || tc.cons
			ccfg.AcceptVMM = true
			prod, cons := pair(t, pcfg, ccfg)
			want := !pcfg.DisableShm && !ccfg.DisableShm
			if prod.Shm() != want || cons.Shm() != want {
				t.Fatalf("shm: producer %v consumer %v, want %v", prod.Shm(), cons.Shm(), want)
			}
			exchange(t, prod, cons, 2000)
		})
	}
}

// exchange sends n offers (every 50th with a descriptor) and their
// releases, the consumer holding at most its credits, and checks each.
func exchange(t *testing.T, prod, cons *Conn, n int) {
	t.Helper()
	ctx := testCtx(t)
	errc := make(chan error, 1)
	go func() {
		var m Message
		for i := 0; i < n; i++ {
			if err := cons.Recv(ctx, &m); err != nil {
				errc <- err
				return
			}
			if m.Kind != KindOffer || m.Offer.Seq != uint64(i) || len(m.Offer.FDs) != boolInt(i%50 == 0) {
				errc <- errors.New("wrong offer")
				return
			}
			closeFDs(m.Offer.FDs)
			if err := cons.SendRelease(ctx, m.Offer.Seq); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	released := 0
	go func() {
		var m Message
		for released < n {
			if err := prod.Recv(ctx, &m); err != nil {
				return
			}
			released += len(m.Seqs)
		}
	}()
	for i := 0; i < n; i++ {
		o := testOffer()
		o.Seq = uint64(i)
		if i%50 == 0 {
			fd, err := unix.MemfdCreate("cudashare-test", unix.MFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			o.FDs = []int{fd}
			err = prod.SendOffer(ctx, &o)
			unix.Close(fd)
			if err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := prod.SendOffer(ctx, &o); err != nil {
			t.Fatal(err)
		}
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestShmAsleep: with no polling, every wait sleeps on the socket, and
// the doorbell wakes it; slow and fast stretches both arrive.
func TestShmAsleep(t *testing.T) {
	pcfg, ccfg := shmConfigs(t)
	pcfg.ShmSpin, ccfg.ShmSpin = -1, -1
	prod, cons := pair(t, pcfg, ccfg)
	exchange(t, prod, cons, 500)
	// A message after a pause longer than any polling.
	ctx := testCtx(t)
	time.Sleep(20 * time.Millisecond)
	o := testOffer()
	o.Seq = 9999
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	var m Message
	if err := cons.Recv(ctx, &m); err != nil || m.Offer.Seq != 9999 {
		t.Fatalf("after a pause: %v %v", m.Offer.Seq, err)
	}
}

// TestShmLyingPeer: a peer that writes nonsense into the control block,
// as a hostile process sharing the segment could, fails the connection
// with ErrMalformed on the side that reads it, and nothing is read or
// written out of bounds.
func TestShmLyingPeer(t *testing.T) {
	pcfg, ccfg := shmConfigs(t)
	for _, tc := range []struct {
		name  string
		lie   func(prod, cons *Conn)
		check func(t *testing.T, prod, cons *Conn)
	}{
		{"tail far ahead", func(prod, cons *Conn) {
			atomic.AddUint64(cons.shm.in.tail, laneSize+1) // what the producer side "wrote"
		}, func(t *testing.T, prod, cons *Conn) {
			var m Message
			if err := cons.Recv(testCtx(t), &m); !errors.Is(err, ErrMalformed) {
				t.Fatalf("Recv: %v, want ErrMalformed", err)
			}
		}},
		{"tail moved back", func(prod, cons *Conn) {
			atomic.StoreUint64(cons.shm.in.tail, ^uint64(0))
		}, func(t *testing.T, prod, cons *Conn) {
			var m Message
			if err := cons.Recv(testCtx(t), &m); !errors.Is(err, ErrMalformed) {
				t.Fatalf("Recv: %v, want ErrMalformed", err)
			}
		}},
		{"head beyond the tail", func(prod, cons *Conn) {
			atomic.AddUint64(prod.shm.out.head, 1<<40) // what the consumer side "read"
		}, func(t *testing.T, prod, cons *Conn) {
			ctx := testCtx(t)
			o := testOffer()
			o.Seq = 77
			err := sendUntilHeadLooked(ctx, prod, &o)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("send: %v, want ErrMalformed", err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoFDLeak(t)
			prod, cons := pair(t, pcfg, ccfg)
			exchange(t, prod, cons, 10)
			tc.lie(prod, cons)
			tc.check(t, prod, cons)
		})
	}
}

// TestShmSocketAbuse: on a shm connection the socket carries doorbells,
// descriptors and errors only. An error there is the peer's word; any
// other message, or descriptors that no offer claims, fail the
// connection; and the descriptors are closed.
func TestShmSocketAbuse(t *testing.T) {
	pcfg, ccfg := shmConfigs(t)
	for _, tc := range []struct {
		name  string
		abuse func(t *testing.T, prod *Conn)
		want  error
	}{
		{"error message", func(t *testing.T, prod *Conn) {
			tell(prod.nc, bell[:], codeLimit, "too many")
		}, ErrLimit},
		{"an offer on the socket", func(t *testing.T, prod *Conn) {
			if _, err := prod.nc.Write(frame(mustMarshal(offerElems(5, 0)))); err != nil {
				t.Fatal(err)
			}
		}, ErrUnexpectedMessage},
		{"a huge frame on the socket", func(t *testing.T, prod *Conn) {
			var h [headerSize]byte
			binary.BigEndian.PutUint32(h[:], 1<<30)
			if _, err := prod.nc.Write(h[:]); err != nil {
				t.Fatal(err)
			}
		}, ErrMalformed},
		{"descriptors nobody claims", func(t *testing.T, prod *Conn) {
			for i := 0; i < 3*MaxFDs; i++ {
				fd, err := unix.MemfdCreate("cudashare-test", unix.MFD_CLOEXEC)
				if err != nil {
					t.Fatal(err)
				}
				_, _, err = prod.nc.WriteMsgUnix(bell[:], unix.UnixRights(fd), nil)
				unix.Close(fd)
				if err != nil {
					return // the consumer gave up
				}
			}
		}, ErrMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoFDLeak(t)
			prod, cons := pair(t, pcfg, ccfg)
			ctx := testCtx(t)
			exchange(t, prod, cons, 10)
			tc.abuse(t, prod)
			var m Message
			err := cons.Recv(ctx, &m)
			if !errors.Is(err, tc.want) {
				t.Fatalf("Recv: %v, want %v", err, tc.want)
			}
		})
	}
}

// TestShmSegmentChecks: a dialer maps only a sealed segment of the
// right size: a listener that could shrink it could make every access to
// it fault.
func TestShmSegmentChecks(t *testing.T) {
	checkNoFDLeak(t)
	mk := func(size int64, seals int) int {
		fd, err := unix.MemfdCreate("cudashare-test", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Ftruncate(fd, size); err != nil {
			t.Fatal(err)
		}
		if seals != 0 {
			if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
				t.Fatal(err)
			}
		}
		return fd
	}
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	unix.Close(p[1])
	for name, fd := range map[string]int{
		"unsealed":         mk(shmSegSize, 0),
		"may shrink":       mk(shmSegSize, unix.F_SEAL_GROW),
		"too small":        mk(shmSegSize-4096, shmSeals),
		"too large":        mk(2*shmSegSize, shmSeals),
		"not a file":       p[0],
		"sealed and right": mk(shmSegSize, shmSeals),
	} {
		seg, err := openShmSeg(fd)
		unix.Close(fd)
		if name == "sealed and right" {
			if err != nil {
				t.Errorf("%s: %v", name, err)
			} else {
				seg.unmap()
			}
			continue
		}
		if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrHandshake) {
			t.Errorf("%s: %v, want a refusal", name, err)
		}
		if seg != nil {
			seg.unmap()
		}
	}
}

// TestShmHostileListener: a listener that answers a dialer asking for a
// shm channel with no segment, two, or a bad one fails the handshake, and the
// dialer keeps no descriptor.
func TestShmHostileListener(t *testing.T) {
	if testConfig(RoleConsumer, nil).DisableShm {
		t.Skip("socket mode")
	}
	ack := mustMarshal([]any{KindHelloAck, Version, RoleProducer, 1, make([]byte, 16), []any{}, uint64(CapShm), 0})
	memfd := func(sealed bool) int {
		fd, err := unix.MemfdCreate("cudashare-test", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		if err != nil {
			t.Fatal(err)
		}
		unix.Ftruncate(fd, shmSegSize)
		if sealed {
			unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, shmSeals)
		}
		return fd
	}
	for _, tc := range []struct {
		name string
		fds  func() []int
	}{
		{"no segment", func() []int { return nil }},
		{"two segments", func() []int { return []int{memfd(true), memfd(true)} }},
		{"unsealed segment", func() []int { return []int{memfd(false)} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoFDLeak(t)
			path, _, done := serveRaw(t, func(p *rawPeer) {
				if _, err := p.recv(); err != nil {
					return
				}
				fds := tc.fds()
				if len(fds) == 0 {
					p.send(ack)
				} else {
					p.sendFDs(ack, fds...)
					closeFDs(fds)
				}
				bufio.NewReader(p.c).ReadByte() // until the dialer hangs up
			})
			c, err := Dial(testCtx(t), path, testConfig(RoleConsumer, nil))
			if err == nil {
				c.Close()
				t.Fatal("Dial succeeded")
			}
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrHandshake) {
				t.Fatalf("Dial: %v, want a malformed handshake", err)
			}
			<-done
		})
	}
}

// TestShmUnmapped: the listener's memfd is closed once sent, the
// dialer's once mapped, and Close unmaps the segment on both sides.
func TestShmUnmapped(t *testing.T) {
	if testConfig(RoleConsumer, nil).DisableShm {
		t.Skip("socket mode")
	}
	count := func() int {
		b, err := os.ReadFile("/proc/self/maps")
		if err != nil {
			t.Skip("no /proc/self/maps")
		}
		return strings.Count(string(b), "cudashare-shm")
	}
	before := count()
	checkNoFDLeak(t)
	l := listen(t, testConfig(RoleProducer, nil))
	ctx := testCtx(t)
	var conns []*Conn
	for i := 0; i < 8; i++ {
		c, err := Dial(ctx, l.Addr(), testConfig(RoleConsumer, nil))
		if err != nil {
			t.Fatal(err)
		}
		p, err := l.Accept(ctx)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c, p)
	}
	for fd, target := range testutil.OpenFDs() {
		if strings.Contains(target, "cudashare-shm") {
			t.Errorf("descriptor %d -> %s left open", fd, target)
		}
	}
	if n := count() - before; n != 16 {
		t.Errorf("%d segments mapped, want 16", n)
	}
	for _, c := range conns {
		c.Close()
		c.Close()
	}
	if n := count() - before; n != 0 {
		t.Errorf("%d segments still mapped after Close", n)
	}
}

// TestOfferReadWithHelloAck: without the shm channel, one recvmsg may read the
// hello-ack and the first offer's descriptor with it (a producer offers at
// once); the descriptor is the offer's, not a stray one of the handshake.
// Whether the two arrive in one read is a race, so it tries 20 times.
func TestOfferReadWithHelloAck(t *testing.T) {
	checkNoFDLeak(t)
	for i := 0; i < 20; i++ {
		offerWithHelloAck(t)
	}
}

func offerWithHelloAck(t *testing.T) {
	path, _, done := serveRaw(t, func(p *rawPeer) {
		p.sendMsg(KindHelloAck, Version, RoleProducer, 1, make([]byte, 16), []any{}, 0, 0)
		fd, err := unix.MemfdCreate("cudashare-test", unix.MFD_CLOEXEC)
		if err != nil {
			t.Error(err)
			return
		}
		p.sendFDs(mustMarshal(offerElems(1, 1)), fd)
		unix.Close(fd)
		p.recv()                        // the hello
		bufio.NewReader(p.c).ReadByte() // until the dialer hangs up
	})
	cfg := testConfig(RoleConsumer, nil)
	cfg.AcceptVMM = true
	c, err := Dial(testCtx(t), path, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var m Message
	err = c.Recv(testCtx(t), &m)
	closeFDs(m.Offer.FDs)
	c.Close()
	if err != nil || m.Kind != KindOffer || len(m.Offer.FDs) != 1 {
		t.Fatalf("the first offer: %v, %d descriptors, %v", m.Kind, len(m.Offer.FDs), err)
	}
	<-done
}

// shmConfigs is a producer's and a consumer's test configuration for a
// test of the shm channel itself, which skips when TestSocketMode re-runs
// the package with the shm channel off.
func shmConfigs(t *testing.T) (prod, cons Config) {
	prod, cons = testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil)
	if prod.DisableShm {
		t.Skip("socket mode")
	}
	cons.AcceptVMM = true
	return prod, cons
}

// TestShmOneCredit: offers and releases one at a time, back to back, so
// that each side's reader goes to sleep on the lane again and again just
// as the other writes. A doorbell missed hangs the exchange (the context
// only ends a hang). Under the race detector, whose atomics order less
// than Go's usual ones, this hung within a few thousand handoffs before
// the lane's stores became swaps (shm.go, sleep).
func TestShmOneCredit(t *testing.T) {
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.Credits = 1
	prod, cons := pair(t, testConfig(RoleProducer, nil), ccfg)
	ctx := testCtx(t)
	const n = 20000
	errs := make(chan error, 2)
	go func() { // the producer's reader takes the releases
		var m Message
		for {
			if err := prod.Recv(ctx, &m); err != nil {
				errs <- err
				return
			}
		}
	}()
	go func() {
		o := testOffer()
		for i := range n {
			o.Seq = uint64(i + 1)
			if err := prod.SendOffer(ctx, &o); err != nil {
				errs <- fmt.Errorf("offer %d: %w", i+1, err)
				return
			}
		}
	}()
	var m Message
	for i := range n {
		if err := cons.Recv(ctx, &m); err != nil {
			t.Fatalf("offer %d of %d: %v", i+1, n, err)
		}
		if m.Kind != KindOffer || m.Offer.Seq != uint64(i+1) {
			t.Fatalf("got %v seq %d, want offer %d", m.Kind, m.Offer.Seq, i+1)
		}
		if err := cons.queueReleaseLater(ctx, nil, m.Offer.Seq); err != nil {
			t.Fatal(err)
		}
		cons.push()
	}
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
}

// TestShmStalledPeerTold: a consumer that stops reading its lane (stopped
// with SIGSTOP, say) fails the producer's writes with ErrWriteTimeout, and
// is sent why on the socket, which has room: once it reads again, it gets
// the producer's error (code 11, timeout) after what the lane held, not an
// end of stream that would read as the producer's death.
func TestShmStalledPeerTold(t *testing.T) {
	pcfg, ccfg := shmConfigs(t)
	pcfg.WriteTimeout = 200 * time.Millisecond
	ccfg.Credits = MaxWindow
	prod, cons := pair(t, pcfg, ccfg)
	if !prod.Shm() {
		t.Fatal("no shm channel between two Conns that allow one")
	}
	o := testOffer()
	o.Meta = mustMarshal(strings.Repeat("x", 4000))
	ctx := testCtx(t)
	var err error
	sent := 0
	for i := 0; err == nil; i++ {
		o.Seq = uint64(i)
		if err = prod.SendOffer(ctx, &o); err == nil {
			err = prod.Flush(ctx)
		}
		if err == nil {
			sent++
		}
	}
	if !errors.Is(err, ErrWriteTimeout) {
		t.Fatalf("offers to a consumer that does not read its lane: %v, want ErrWriteTimeout", err)
	}
	var m Message
	got := 0
	for err = nil; err == nil; got++ {
		err = cons.Recv(ctx, &m)
	}
	if !errors.Is(err, ErrRemote) || !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "shm lane") {
		t.Fatalf("the stalled consumer, reading again, got %v after %d messages, want the producer's error: a timeout, naming the shm lane", err, got-1)
	}
	if got-1 < sent {
		t.Fatalf("the consumer read %d of the %d offers sent before the error", got-1, sent)
	}
}

// TestShmSegmentShrunkBetweenChecks: a listener that sends an unsealed
// segment of the right size, shrinks it to nothing just after the
// dialer's fstat, and then seals it, passes a check of the size followed
// by one of the seals: the dialer would map a segment with no pages, and
// die of SIGBUS at its first access. The seals must be checked first:
// once the segment cannot shrink, the size read next is the size mapped.
func TestShmSegmentShrunkBetweenChecks(t *testing.T) {
	checkNoFDLeak(t)
	fd, err := unix.MemfdCreate("cudashare-test", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, shmSegSize); err != nil {
		t.Fatal(err)
	}
	fstat := shmSegFstat
	t.Cleanup(func() { shmSegFstat = fstat })
	shmSegFstat = func(fd int, st *unix.Stat_t) error {
		err := fstat(fd, st)
		// The hostile listener, between the dialer's two looks.
		if _, serr := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0); serr == nil {
			unix.Ftruncate(fd, 0)
			unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, shmSeals)
		}
		return err
	}
	seg, err := openShmSeg(fd)
	if seg != nil {
		var st unix.Stat_t
		unix.Fstat(fd, &st)
		seg.unmap() // untouched: every access would fault
		t.Fatalf("the dialer mapped a segment that now has %d bytes (err %v): its first access dies of SIGBUS", st.Size, err)
	}
	if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "sealed") {
		t.Fatalf("openShmSeg: %v, want a refusal for the seals", err)
	}
}
