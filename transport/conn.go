//go:build linux

package transport

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Conn is one handshaken connection between a producer and a consumer.
//
// One goroutine may call Recv while any number call the Send methods,
// Flush, Shutdown and Close.
//
// A send encodes its message into an output queue. On a connection that
// is idle, the sender writes it at once with one non-blocking write, so a
// lone message costs one system call and no hand-off. Messages sent while
// a write is in progress, or in a quick stream, are left to the Conn's
// writer goroutine, which writes everything queued in one write; so does
// what a full socket would not take. A send never blocks on the socket:
// it waits, within its ctx, only for room in the queue (Config.MaxQueued)
// and, for an offer, for a credit. It returns once the message is queued;
// an error writing it later fails the connection, and the next call
// reports it. Flush waits until everything queued has been written.
//
// When both sides advertise CapShm (the Go default; Config.DisableShm),
// the frames go through the shm channel, two lanes (one each way) in
// memory the processes share (shm.go, PROTOCOL.md section 2.3) instead of the socket: a send then
// writes into the lane at once, a receive polls the lane briefly
// (Config.ShmSpin) before it sleeps on the socket, and the socket only
// wakes a sleeping reader and carries descriptors, errors and the end.
// Everything else here holds the same for both.
//
// A Conn enforces the protocol on what it receives (order, direction,
// flow control) and on what it is asked to send. Any violation by the peer
// fails the connection: Recv returns the error, the peer is sent an error
// message when possible, and the socket is closed. Close must still be
// called to release what the Conn holds.
type Conn struct {
	nc   *net.UnixConn
	rc   syscall.RawConn
	cfg  Config
	peer Peer
	desc string // the peer, for errors

	// Receive side: rmu serializes Recv, and the fields to watch belong
	// to whoever holds it.
	rmu     sync.Mutex
	rbuf    []byte // starts small; grows when a frame or a stream needs it
	rbufMax int
	r, w    int // unread bytes are rbuf[r:w]
	// frameStart is when Recv began to wait for the rest of a partial
	// frame, and rdl the read deadline that sets (FrameTimeout later),
	// zero when nothing is buffered: an idle connection never times out.
	frameStart  time.Time
	rdl         time.Time
	fdq         []int // received descriptors no message has claimed yet
	fdOut       [MaxFDs]int
	dec         decoder
	rerr        error // what ended receiving; sticky
	bye         bool  // the peer said goodbye
	handshaking bool
	rd          readOp
	watch       ctxWatch
	intr        atomic.Bool // Interrupt: the next Recv to wait returns errInterrupted
	try         bool        // in tryRecv: a read that would wait returns errWouldBlock
	// Shm mode (shm.go), under rmu: sbuf[sr:sw] is what the socket
	// brought and no frame has taken yet, sockEnd how the socket ended
	// (the lane is read to its end first), gap the last wait for the
	// lane. askShm is set while a dialer that asked for the shm channel waits for
	// the segment with the hello-ack.
	sbuf    []byte
	sr, sw  int
	sockEnd int
	gap     time.Duration
	askShm  bool
	shmGone bool // unmapped by Close; under rmu and shmMu
	// A poller's, if one watches the connection (poller.go): sockReady
	// says the socket may have bytes (epoll said so, or the connection
	// failed), so that tryRecv makes no system call for a socket that has
	// none; pollFD is the socket's number in the poller's epoll set.
	polledBy  atomic.Pointer[poller]
	sockReady atomic.Bool
	pollFD    int32
	// ended is set once this side's failure of the connection is
	// complete: the peer told why, if it was to be, and the socket closed
	// (or left open for what the peer sent before it went). A polled
	// tryRecv reports the failure from then on, not before, so that a
	// reader that ends the connection cannot close the socket under the
	// error message still being written.
	ended atomic.Bool
	// sleeps counts this side's sleeps on the lane it reads, carriers
	// the reads of the socket that brought descriptors, and bells the
	// doorbells read: a peer that keeps the rules rings at most once per
	// sleep, and once more per set of descriptors (socketFrames).
	sleeps, carriers, bells uint64

	// shm is the segment of a shm connection, nil on a socket one. The
	// write side holds shmMu shared while it writes into the segment;
	// Close holds it, and rmu, to unmap it.
	shm   *shmSeg
	shmMu sync.RWMutex

	// Send side and flow control, under mu.
	mu               sync.Mutex
	out, spare       []byte // queued frames; the writer swaps the two
	outFDs, spareFDs []pendingFDs
	queued, written  uint64        // bytes ever queued and written
	progress         chan struct{} // closed on progress; made by a waiter
	err              error         // the first failure: nothing is sent after it
	saidBye          bool
	// For a producer: window is what the consumer granted and outstanding
	// the offers it has not released. For a consumer: the same, as this
	// side has granted and released them.
	window, outstanding uint64

	// writing is set while one goroutine owns the socket's write side:
	// a sender writing directly, the writer goroutine, or fail.
	writing bool
	// cut is set while out starts in the middle of a frame that a short
	// direct write left: an error message written then would land inside
	// that frame.
	cut bool
	// lastWrite is when the last write ended: a send soon after it is
	// part of a stream, and waits for the writer to batch it. Socket
	// connections only: a lane takes every send at once.
	lastWrite time.Time
	wr        writeOp
	// Shm mode, for the write side's owner: bellLeft is what the socket
	// did not take of the last doorbell; shmTimer paces the wait for
	// room in a full lane.
	bellLeft int
	shmTimer *time.Timer

	kick       chan struct{} // wakes the writer
	dying      chan struct{} // closed with the first failure
	writerDone chan struct{}
	closeOnce  sync.Once
	// onClose, if set, runs once when the Conn is closed: the Listener
	// counts the connection until then.
	onClose func()
}

// errorWriteTimeout bounds the write of an error message to a peer
// that is being dropped.
const errorWriteTimeout = 100 * time.Millisecond

var longAgo = time.Unix(1, 0)

func newConn(nc *net.UnixConn, cfg Config, cred *unix.Ucred) (*Conn, error) {
	rc, err := nc.SyscallConn()
	if err != nil {
		return nil, err
	}
	c := &Conn{
		nc:      nc,
		rc:      rc,
		cfg:     cfg,
		peer:    Peer{UID: cred.Uid, GID: cred.Gid, PID: cred.Pid},
		rbuf:    make([]byte, initialReadBuffer),
		rbufMax: max(minReadBuffer, 2*(headerSize+cfg.MaxFrameSize)),
		fdq:     make([]int, 0, MaxFDs),
		kick:    make(chan struct{}, 1),
		dying:   make(chan struct{}),
	}
	c.desc = c.peer.String()
	c.rd.oob = make([]byte, unix.CmsgSpace(MaxFDs*4))
	c.wr.fn = func(fd uintptr) bool {
		op := &c.wr
		if op.oob == nil {
			n, _, e := unix.Syscall(unix.SYS_WRITE, fd, uintptr(unsafe.Pointer(unsafe.SliceData(op.p))), uintptr(len(op.p)))
			op.n, op.errno = int(n), e
		} else {
			op.n, op.errno = sendmsg(int(fd), op.p, op.oob)
		}
		if op.errno != 0 {
			op.n = 0
		}
		return !op.wait || op.errno != unix.EAGAIN
	}
	c.rd.fn = func(fd uintptr) bool {
		op := &c.rd
		op.n, op.oobn, op.flags, op.errno = recvmsg(int(fd), op.p, op.oob)
		return op.errno != unix.EAGAIN
	}
	c.rd.now = func(fd uintptr) {
		op := &c.rd
		op.n, op.oobn, op.flags, op.errno = recvmsg(int(fd), op.p, op.oob)
	}
	return c, nil
}

// Peer returns what is known of the other side. Its Devices must not be
// modified.
func (c *Conn) Peer() Peer { return c.peer }

// Shm reports whether the connection carries its frames through the shm
// channel, two lanes in shared memory (CapShm on both sides), rather than
// on the socket.
func (c *Conn) Shm() bool { return c.shm != nil }

// Credits returns how many more offers may be outstanding on the
// connection now: the window the consumer granted less the offers not yet
// released, as this side counts them. A producer reads it once after the
// handshake to learn the consumer's initial window (Peer does not carry
// it); a sharing layer that spreads offers over several consumers uses it
// to pick one that can take an offer without waiting.
func (c *Conn) Credits() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.outstanding >= c.window {
		return 0
	}
	return c.window - c.outstanding
}

// Err returns why the connection failed or was closed (the error every
// later call returns), or nil while it works. A send that fails while Err
// is nil failed for a reason of its own (an invalid message, ctx), and the
// connection goes on; once Err is not nil, nothing more will be sent on it.
func (c *Conn) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Shutdown says goodbye with reason, waits within ctx until everything
// queued has been written, and closes the connection. The peer receives
// every message sent before Shutdown, then the goodbye.
func (c *Conn) Shutdown(ctx context.Context, reason string) error {
	err := c.lockRoom(ctx, false)
	if err == nil {
		off := len(c.out)
		c.out = appendGoodbye(c.out, GoodbyeDone, reason)
		c.saidBye = true
		c.unlockAndKick(off)
		err = c.Flush(ctx)
	}
	c.Close()
	return err
}

// SendGoodbye says goodbye with reason, waits, within ctx, until it is
// written, and then half-closes the connection (shutdown(SHUT_WR)): the
// peer reads the goodbye and then end of stream, as PROTOCOL.md section 4
// says, while this side can still Recv until the peer closes; Close it
// afterwards. Shutdown closes at once: the peer still reads the goodbye,
// because a write that fails after the peer has closed leaves the socket
// open for Recv to drain (TestShutdownWhilePeerWrites). SendGoodbye is for
// a side that wants to linger until the peer has closed (its Recv returns)
// or a timeout passes, as the share package's importer and exporter do.
// Without the half-close, a peer that waits for end of stream after the
// goodbye, as the page tells it to, and this side, waiting for the peer to
// close, would wait for each other until the timeout.
func (c *Conn) SendGoodbye(ctx context.Context, reason string) error {
	return c.SendGoodbyeCode(ctx, GoodbyeDone, reason)
}

// SendGoodbyeCode is SendGoodbye with a code that says what comes next:
// a producer that restarts says GoodbyeRestarting, so that consumers that
// reconnect wait for its successor.
func (c *Conn) SendGoodbyeCode(ctx context.Context, code GoodbyeCode, reason string) error {
	if err := c.lockRoom(ctx, false); err != nil {
		return err
	}
	off := len(c.out)
	c.out = appendGoodbye(c.out, code, reason)
	c.saidBye = true
	c.unlockAndKick(off)
	if err := c.Flush(ctx); err != nil {
		return err
	}
	// Nothing is written after the goodbye (saidBye refuses it), so the
	// write side can go. A peer that has closed already makes this fail
	// with ENOTCONN, which changes nothing.
	_ = c.nc.CloseWrite()
	return nil
}

// fail records err as the connection's failure if it is the first, tells
// the peer if so, notify is set and the socket is free, and closes the
// socket. It returns the first failure.
func (c *Conn) fail(err error, notify bool) error {
	first, err := c.setFailure(err)
	if first && notify {
		c.mu.Lock()
		// A write under way (an offer that left as the failure came) ends
		// in microseconds, or fails: wait for it, briefly, rather than
		// leave the peer without the reason. Nothing new starts now that
		// the failure is set.
		if c.writing && !c.cut {
			deadline := time.Now().Add(errorWriteTimeout)
			for c.writing && !c.cut {
				left := time.Until(deadline)
				if left <= 0 {
					break
				}
				ch := c.progressLocked()
				c.mu.Unlock()
				t := time.NewTimer(left)
				select {
				case <-ch:
				case <-t.C:
				}
				t.Stop()
				c.mu.Lock()
			}
		}
		own := !c.writing && !c.cut
		c.writing = true // for good: nothing else is written
		c.mu.Unlock()
		if own {
			c.writeError(codeOf(err), err.Error())
		}
	}
	c.nc.Close()
	c.endPolled()
	return err
}

// endPolled marks this side's failure of the connection complete, and
// wakes the poller that watches it, if any: its next tryRecv reads what
// is left and says why it ended (the socket may have left the epoll set
// without an event).
func (c *Conn) endPolled() {
	c.ended.Store(true)
	if p := c.polledBy.Load(); p != nil {
		c.sockReady.Store(true)
		p.Wake()
	}
}

// setFailure records err as the connection's failure if it is the first:
// nothing is sent after it, and every waiting sender wakes. It reports
// whether err is the first, and returns the first.
func (c *Conn) setFailure(err error) (first bool, cause error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return false, c.err
	}
	c.err = err
	close(c.dying)
	c.wakeLocked()
	return true, err
}

// writeError writes an error message straight to the socket, briefly.
// The caller owns the socket's write side.
func (c *Conn) writeError(code uint32, text string) {
	var pre []byte
	if c.bellLeft > 0 {
		// Finish the doorbell cut short, so that the error is a frame.
		pre = bell[:c.bellLeft:c.bellLeft]
	}
	tell(c.nc, pre, code, text)
}

// failure returns the connection's failure.
func (c *Conn) failure() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		return fmt.Errorf("transport: %s: %w", c.desc, ErrClosed)
	}
	return c.err
}

// CloseWithError fails the connection with err and closes it, as Close
// does: any blocked call returns, Recv with err or an error matching
// ErrClosed, and so does every later call. The peer is sent one error
// message whose code is that of err's sentinel (ErrTimeout, ErrLimit,
// ErrCredit, ...; internal for others) and whose text is err's, on a
// best-effort basis: with a short timeout, and only if no write is in
// progress, whose bytes it would corrupt. It is for a layer above that
// drops a peer for a reason of its own, such as a lease held too long.
// If the connection had already failed or been closed, it only closes.
// CloseWithError is idempotent, may be called from any goroutine, and
// Close may be called after it; it always returns nil.
func (c *Conn) CloseWithError(err error) error {
	if err != nil {
		c.fail(err, true)
	}
	return c.Close()
}

// Close closes the connection at once, dropping what is queued; any
// blocked call returns. It closes descriptors received and not yet claimed
// by a message. Close is idempotent and always returns nil.
func (c *Conn) Close() error {
	c.fail(fmt.Errorf("transport: connection to %s: %w", c.desc, ErrClosed), false)
	c.closeOnce.Do(func() {
		if c.writerDone != nil {
			<-c.writerDone
		}
		c.mu.Lock()
		for _, p := range c.outFDs {
			closeFDs(p.fds)
		}
		c.outFDs = nil
		c.mu.Unlock()
		c.rmu.Lock()
		closeFDs(c.fdq)
		c.fdq = c.fdq[:0]
		if c.shm != nil {
			// Recv is out (rmu) and a writer in the lane holds shmMu:
			// nothing can touch the segment from here on.
			c.shmMu.Lock()
			c.shmGone = true
			c.shm.unmap()
			c.shmMu.Unlock()
		}
		c.watch.mu.Lock()
		if c.watch.stop != nil {
			c.watch.stop()
			c.watch.stop = nil
		}
		c.watch.gen++
		c.watch.mu.Unlock()
		c.rmu.Unlock()
		if c.onClose != nil {
			c.onClose()
		}
	})
	return nil
}
