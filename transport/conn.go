//go:build linux

package transport

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
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
	// part of a stream, and waits for the writer to batch it.
	lastWrite time.Time
	wr        writeOp

	kick       chan struct{} // wakes the writer
	dying      chan struct{} // closed with the first failure
	writerDone chan struct{}
	closeOnce  sync.Once
	// onClose, if set, runs once when the Conn is closed: the Listener
	// counts the connection until then.
	onClose func()
}

// pendingFDs are descriptors that leave with the queued frame at off.
type pendingFDs struct {
	off int
	fds []int
}

// readOp is a recvmsg call made through the RawConn. Its func is built
// once per Conn so that a read does not allocate.
type readOp struct {
	fn      func(fd uintptr) bool
	p, oob  []byte
	n, oobn int
	flags   int
	errno   unix.Errno
}

// writeOp is one write(2), or sendmsg(2) with descriptors in oob, made
// through the RawConn, built once per Conn like readOp. Without wait it
// never waits: what does not fit is the writer's. With wait it waits for
// room in the socket, within the write deadline.
type writeOp struct {
	fn    func(fd uintptr) bool
	p     []byte
	oob   []byte
	wait  bool
	n     int
	errno unix.Errno
}

// ctxWatch turns the cancellation of Recv's context into a read deadline
// in the past, which interrupts a blocked read. It stays registered while
// Recv is called with the same context, so a receive loop with one
// long-lived context costs nothing per call.
type ctxWatch struct {
	mu    sync.Mutex
	done  <-chan struct{} // of the context registered; rmu
	stop  func() bool
	gen   uint64
	fired bool
}

const (
	// errorWriteTimeout bounds the write of an error message to a peer
	// that is being dropped.
	errorWriteTimeout = 100 * time.Millisecond
	// A receive buffer starts at initialReadBuffer, enough for any
	// handshake and for the usual messages, and grows to hold a larger
	// frame, or up to maxReadBuffer(cfg) for a connection whose reads fill
	// it: an idle connection costs little, a busy one reads many messages
	// per system call.
	initialReadBuffer = 4 << 10
	minReadBuffer     = 64 << 10
	// streamGap is the idle time after a write that tells a lone send,
	// written at once by its sender, from one of a stream, left to the
	// writer goroutine so that it leaves with the next ones in one write.
	// It is well below a round trip between two processes (10 µs and
	// more) and well above the gap between sends in a loop (under 1 µs).
	streamGap = 3 * time.Microsecond
)

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
	return c, nil
}

// Peer returns what is known of the other side. Its Devices must not be
// modified.
func (c *Conn) Peer() Peer { return c.peer }

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

// --- Receiving ------------------------------------------------------------

// Recv receives the next message into m. Slices in m (Offer.Meta, Seqs)
// are views into the Conn's buffers, valid until the next Recv;
// descriptors in m.Offer.FDs belong to the caller.
//
// Recv returns io.EOF after the peer's goodbye, once the peer has closed
// the connection, and an error matching ErrDisconnected if the peer went
// away without one. If ctx ends first, Recv returns ctx.Err() and the
// connection stays usable. Any other error is final.
func (c *Conn) Recv(ctx context.Context, m *Message) error {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	if c.rerr != nil {
		return c.rerr
	}
	body, err := c.readFrame(ctx)
	if err == nil {
		var kind Kind
		if kind, err = c.dec.decode(body, m); err == nil {
			err = c.admit(kind, m)
		}
	}
	if err != nil {
		if ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
			return err
		}
		return c.recvFailed(err)
	}
	return nil
}

// readFrame returns the body of the next frame, a view into rbuf.
func (c *Conn) readFrame(ctx context.Context) ([]byte, error) {
	for {
		avail := c.w - c.r
		need := headerSize
		if avail >= headerSize {
			n := binary.BigEndian.Uint32(c.rbuf[c.r:])
			if n > uint32(c.cfg.MaxFrameSize) {
				return nil, fmt.Errorf("%w: length %d, cap %d", ErrFrameTooLarge, n, c.cfg.MaxFrameSize)
			}
			if n == 0 {
				return nil, malformed("empty frame")
			}
			need += int(n)
			if avail >= need {
				body := c.rbuf[c.r+headerSize : c.r+need : c.r+need]
				c.r += need
				c.frameStart = time.Time{}
				return body, nil
			}
		} else if avail == 0 {
			c.r, c.w = 0, 0
			// Descriptors arrive with the first byte of the message
			// that claims them, so with nothing buffered they are stray.
			if len(c.fdq) > 0 {
				return nil, malformed("%d descriptors arrived with no message", len(c.fdq))
			}
		}
		if c.r+need > len(c.rbuf) {
			if need > len(c.rbuf) {
				c.growRead(need)
			} else {
				c.w = copy(c.rbuf, c.rbuf[c.r:c.w])
				c.r = 0
			}
		}
		if err := c.fill(ctx, avail); err != nil {
			return nil, err
		}
	}
}

// growRead moves the unread bytes to a receive buffer of at least need
// bytes, twice the size of the one before where that is more.
func (c *Conn) growRead(need int) {
	b := make([]byte, min(max(need, 2*len(c.rbuf)), max(need, c.rbufMax)))
	c.w = copy(b, c.rbuf[c.r:c.w])
	c.r = 0
	c.rbuf = b
}

// fill reads what the socket has into rbuf[w:], waiting for at least a
// byte; avail is the number of bytes of a partial frame buffered.
func (c *Conn) fill(ctx context.Context, avail int) error {
	if !c.handshaking {
		// The rest of a partial frame must arrive within FrameTimeout;
		// with nothing buffered, there is no deadline. This comes before
		// the check of ctx below, so that it cannot undo the deadline in
		// the past by which a context that ends interrupts the read.
		var dl time.Time
		if avail > 0 {
			if c.frameStart.IsZero() {
				c.frameStart = time.Now()
			}
			dl = c.frameStart.Add(c.cfg.FrameTimeout)
		}
		if dl != c.rdl {
			if err := c.nc.SetReadDeadline(dl); err != nil {
				return c.failure()
			}
			c.rdl = dl
		}
	}
	if done := ctx.Done(); done != nil {
		select {
		case <-done:
			return ctx.Err()
		default:
		}
		if !c.handshaking {
			c.armRead(ctx, done)
		}
	} else if c.watch.done != nil {
		c.armRead(ctx, nil)
	}
	op := &c.rd
	op.p = c.rbuf[c.w:]
	if err := c.rc.Read(op.fn); err != nil {
		switch {
		case errors.Is(err, os.ErrDeadlineExceeded):
			if err := ctx.Err(); err != nil {
				return err
			}
			if c.handshaking {
				return fmt.Errorf("%w: no answer within %v", ErrHandshake, c.cfg.HandshakeTimeout)
			}
			if !c.rdl.IsZero() && !time.Now().Before(c.rdl) {
				return fmt.Errorf("%w: a frame cut off after %d bytes for %v (FrameTimeout)", ErrTimeout, avail, c.cfg.FrameTimeout)
			}
			// A deadline left by a context no longer watched.
			return c.nc.SetReadDeadline(c.rdl)
		case errors.Is(err, net.ErrClosed):
			return c.failure()
		}
		return err
	}
	if op.errno != 0 {
		if op.errno == unix.ECONNRESET && c.bye && avail == 0 {
			// The peer closed with our messages unread: after its
			// goodbye, that is still a clean end.
			return io.EOF
		}
		if op.errno == unix.ECONNRESET {
			return fmt.Errorf("%w: %w", ErrDisconnected, op.errno)
		}
		return fmt.Errorf("recvmsg: %w", op.errno)
	}
	if op.oobn > 0 || op.flags&unix.MSG_CTRUNC != 0 {
		if err := c.takeFDs(op.oob[:op.oobn], op.flags); err != nil {
			return err
		}
	}
	if op.n == 0 {
		switch {
		case avail > 0:
			return fmt.Errorf("%w: %w: frame cut off after %d bytes", ErrDisconnected, io.ErrUnexpectedEOF, avail)
		case c.bye:
			return io.EOF
		}
		return fmt.Errorf("%w: connection closed without goodbye", ErrDisconnected)
	}
	c.w += op.n
	if c.w == len(c.rbuf) && len(c.rbuf) < c.rbufMax {
		// The read filled the buffer: more is probably waiting, so
		// read more at a time from now on.
		c.growRead(2 * len(c.rbuf))
	}
	return nil
}

// takeFDs queues the descriptors of one recvmsg, or closes them and fails.
func (c *Conn) takeFDs(oob []byte, flags int) error {
	fds, err := parseRights(oob)
	if err != nil {
		return err
	}
	switch {
	case flags&unix.MSG_CTRUNC != 0:
		err = malformed("more than %d descriptors with one message", MaxFDs)
	case !c.cfg.AcceptFDs:
		err = fmt.Errorf("%w: %d descriptors, and this side did not advertise CapFDs", ErrUnexpectedMessage, len(fds))
	case len(c.fdq)+len(fds) > MaxFDs:
		err = malformed("%d descriptors pending, limit %d", len(c.fdq)+len(fds), MaxFDs)
	}
	if err != nil {
		closeFDs(fds)
		return err
	}
	c.fdq = append(c.fdq, fds...)
	return nil
}

// armRead registers ctx (whose Done channel is done) to interrupt reads.
func (c *Conn) armRead(ctx context.Context, done <-chan struct{}) {
	w := &c.watch
	if done == w.done {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stop != nil {
		w.stop()
		w.stop = nil
	}
	w.gen++
	if w.fired {
		c.nc.SetReadDeadline(c.rdl) // the frame's, if any
		w.fired = false
	}
	w.done = done
	if done == nil {
		return
	}
	gen := w.gen
	w.stop = context.AfterFunc(ctx, func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.gen == gen {
			w.fired = true
			c.nc.SetReadDeadline(longAgo)
		}
	})
}

// admit checks a decoded message against the connection's state.
func (c *Conn) admit(kind Kind, m *Message) error {
	if c.bye {
		return fmt.Errorf("%w: %s after goodbye", ErrUnexpectedMessage, kind)
	}
	switch kind {
	case KindHello, KindHelloAck:
		return fmt.Errorf("%w: %s after the handshake", ErrUnexpectedMessage, kind)
	case KindError:
		return &RemoteError{Code: c.dec.errCode, Message: c.dec.errText, Peer: c.desc}
	case KindGoodbye:
		c.bye = true
		return nil
	}
	if !c.fromRole(kind) {
		return fmt.Errorf("%w: %s from a %s", ErrUnexpectedMessage, kind, c.peer.Role)
	}
	switch kind {
	case KindOffer:
		nfds := c.dec.nfds
		if nfds > 0 && !c.cfg.AcceptFDs {
			// Descriptors to a side that did not ask for them, whether
			// or not any came: PROTOCOL.md section 5.
			return fmt.Errorf("%w: offer declares %d descriptors, and this side did not advertise CapFDs", ErrUnexpectedMessage, nfds)
		}
		if nfds > len(c.fdq) {
			return malformed("offer declares %d descriptors, %d arrived", nfds, len(c.fdq))
		}
		c.mu.Lock()
		if c.outstanding >= c.window {
			c.mu.Unlock()
			return fmt.Errorf("%w: offer beyond the %d credits granted", ErrCredit, c.window)
		}
		c.outstanding++
		c.mu.Unlock()
		if nfds > 0 {
			copy(c.fdOut[:], c.fdq[:nfds])
			c.fdq = slices.Delete(c.fdq, 0, nfds)
			m.Offer.FDs = c.fdOut[:nfds:nfds]
		}
	case KindRelease:
		if m.HasReleaseEvent && !c.cfg.ReleaseEvents {
			return fmt.Errorf("%w: a release with an event, and this side did not advertise CapReleaseEvents", ErrNotSupported)
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		n := uint64(len(m.Seqs))
		if n > c.outstanding {
			return fmt.Errorf("%w: %d releases with %d offers outstanding", ErrCredit, n, c.outstanding)
		}
		c.outstanding -= n
		c.wakeLocked()
	case KindCredit:
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.window+uint64(m.Credits) > MaxWindow {
			return fmt.Errorf("%w: window of %d credits, limit %d", ErrCredit, c.window+uint64(m.Credits), MaxWindow)
		}
		c.window += uint64(m.Credits)
		c.wakeLocked()
	}
	return nil
}

// fromRole reports whether the peer's role sends messages of kind k.
func (c *Conn) fromRole(k Kind) bool {
	switch k {
	case KindOffer, KindRetire:
		return c.peer.Role == RoleProducer
	case KindRelease, KindClosed, KindCredit:
		return c.peer.Role == RoleConsumer
	}
	return false
}

// recvFailed ends receiving with err and fails the connection.
func (c *Conn) recvFailed(err error) error {
	closeFDs(c.fdq)
	c.fdq = c.fdq[:0]
	if err == io.EOF {
		// A clean end, even if sending failed first: the peer said
		// goodbye and left while we were still writing to it.
		c.rerr = io.EOF
		c.fail(fmt.Errorf("transport: %s: %w", c.desc, ErrClosed), false)
		return err
	}
	var remote *RemoteError
	if errors.As(err, &remote) {
		// What the peer said is the cause, whatever failed on this side
		// meanwhile or just before (a write into the connection it closed
		// after saying it): that failure is only its echo. Reading the
		// message and the write failing race when a stopped process
		// resumes with both pending.
		err = fmt.Errorf("transport: receive from %s: %w", c.desc, err)
		c.rerr = err
		c.fail(err, false)
		return err
	}
	c.mu.Lock()
	cur := c.err
	c.mu.Unlock()
	if cur != nil {
		// Failed or closed elsewhere first; that is the cause.
		c.rerr = cur
		c.nc.Close()
		return cur
	}
	notify := !errors.Is(err, ErrDisconnected) && !errors.Is(err, ErrClosed)
	if !errors.Is(err, ErrClosed) {
		err = fmt.Errorf("transport: receive from %s: %w", c.desc, err)
	}
	c.rerr = err
	return c.fail(err, notify)
}

// --- Sending --------------------------------------------------------------

// SendOffer queues an offer. It waits, within ctx, for a credit from the
// consumer and for room in the output queue. Only a producer sends offers.
func (c *Conn) SendOffer(ctx context.Context, o *Offer) error {
	if err := c.may(KindOffer); err != nil {
		return err
	}
	if err := o.checkRange(); err != nil {
		return err
	}
	if err := checkMeta(o.Meta); err != nil {
		return err
	}
	switch o.HandleKind {
	case HandleIPC:
	case HandleFD:
		if c.peer.Caps&CapFDs == 0 {
			return fmt.Errorf("%w: %s does not accept descriptors, so not posix_fd handles", ErrNotSupported, c.desc)
		}
	case HandleFabric:
		if c.peer.Caps&CapFabric == 0 {
			return fmt.Errorf("%w: %s does not import fabric handles", ErrNotSupported, c.desc)
		}
	default:
		return fmt.Errorf("transport: offer with unknown %s", o.HandleKind)
	}
	var dups []int
	if len(o.FDs) > 0 {
		if len(o.FDs) > MaxFDs {
			return fmt.Errorf("transport: offer with %d descriptors, limit %d", len(o.FDs), MaxFDs)
		}
		if c.peer.Caps&CapFDs == 0 {
			return fmt.Errorf("%w: %s does not accept descriptors", ErrNotSupported, c.desc)
		}
		var err error
		if dups, err = dupFDs(o.FDs); err != nil {
			return err
		}
	}
	if err := c.lockRoom(ctx, true); err != nil {
		closeFDs(dups)
		return err
	}
	off := len(c.out)
	c.out = appendOffer(c.out, o)
	if dups != nil {
		c.outFDs = append(c.outFDs, pendingFDs{off: off, fds: dups})
	}
	c.outstanding++
	c.unlockAndKick(off)
	return nil
}

// SendRelease queues the release of the offers with the given sequence
// numbers, in as many messages as MaxReleaseSeqs requires. Only a consumer
// sends releases, and only for offers it holds.
func (c *Conn) SendRelease(ctx context.Context, seqs ...uint64) error {
	return c.sendRelease(ctx, nil, seqs)
}

// SendReleaseAfter queues a stream-ordered release: the offers are
// released once the work recorded by the interprocess event ev (a
// CUipcEventHandle) is done; the producer's next write of them waits for
// the event on the GPU. Only to a producer that advertised
// CapReleaseEvents (else ErrNotSupported); the event must have been
// recorded before the call.
func (c *Conn) SendReleaseAfter(ctx context.Context, ev Handle, seqs ...uint64) error {
	if c.peer.Caps&CapReleaseEvents == 0 {
		return fmt.Errorf("%w: %s does not take release events", ErrNotSupported, c.desc)
	}
	return c.sendRelease(ctx, &ev, seqs)
}

// QueueRelease queues the release of seqs, after the event ev if not nil
// (as SendReleaseAfter), without writing it: it leaves with the next
// message sent, or at Push. A consumer that releases leases one by one
// while more offers are arriving sends many in one write this way; it must
// Push before it waits for anything from the producer, and soon in any
// case (the producer's lease deadline counts until the release arrives).
func (c *Conn) QueueRelease(ctx context.Context, ev *Handle, seqs ...uint64) error {
	if ev != nil && c.peer.Caps&CapReleaseEvents == 0 {
		return fmt.Errorf("%w: %s does not take release events", ErrNotSupported, c.desc)
	}
	return c.queueRelease(ctx, ev, seqs, true)
}

// Push writes what QueueRelease left queued, as a send would.
func (c *Conn) Push() {
	c.mu.Lock()
	if len(c.out) == 0 || c.err != nil {
		c.mu.Unlock()
		return
	}
	c.unlockAndKick(len(c.out))
}

func (c *Conn) sendRelease(ctx context.Context, ev *Handle, seqs []uint64) error {
	return c.queueRelease(ctx, ev, seqs, false)
}

func (c *Conn) queueRelease(ctx context.Context, ev *Handle, seqs []uint64, lazy bool) error {
	if err := c.may(KindRelease); err != nil {
		return err
	}
	for len(seqs) > 0 {
		n := min(len(seqs), MaxReleaseSeqs)
		if err := c.lockRoom(ctx, false); err != nil {
			return err
		}
		if uint64(n) > c.outstanding {
			c.mu.Unlock()
			return fmt.Errorf("%w: releasing %d offers, %d outstanding", ErrCredit, n, c.outstanding)
		}
		c.outstanding -= uint64(n)
		off := len(c.out)
		c.out = appendRelease(c.out, seqs[:n], ev)
		if lazy && len(c.out) < c.cfg.MaxQueued/2 {
			c.queued += uint64(len(c.out) - off)
			c.mu.Unlock()
		} else {
			c.unlockAndKick(off)
		}
		seqs = seqs[n:]
	}
	return nil
}

// SendRetire queues the retirement of an allocation: the producer wants to
// free it, and the consumer is to close its mapping and answer with
// closed. Only a producer sends it.
func (c *Conn) SendRetire(ctx context.Context, allocID uint64) error {
	return c.sendUint(ctx, KindRetire, allocID)
}

// SendClosed queues the consumer's confirmation that it closed its mapping
// of an allocation. Only a consumer sends it.
func (c *Conn) SendClosed(ctx context.Context, allocID uint64) error {
	return c.sendUint(ctx, KindClosed, allocID)
}

// SendCredit grants the producer n more outstanding offers. Only a
// consumer sends it.
func (c *Conn) SendCredit(ctx context.Context, n uint32) error {
	if n == 0 {
		return nil
	}
	return c.sendUint(ctx, KindCredit, uint64(n))
}

func (c *Conn) sendUint(ctx context.Context, k Kind, v uint64) error {
	if err := c.may(k); err != nil {
		return err
	}
	if err := c.lockRoom(ctx, false); err != nil {
		return err
	}
	if k == KindCredit {
		if c.window+v > MaxWindow {
			c.mu.Unlock()
			return fmt.Errorf("%w: window of %d credits, limit %d", ErrCredit, c.window+v, MaxWindow)
		}
		c.window += v
	}
	off := len(c.out)
	c.out = appendUintMsg(c.out, k, v)
	c.unlockAndKick(off)
	return nil
}

// may reports whether this side's role sends messages of kind k.
func (c *Conn) may(k Kind) error {
	mine := c.cfg.Role
	if (k == KindOffer || k == KindRetire) != (mine == RoleProducer) {
		return fmt.Errorf("%w: a %s does not send %s", ErrUnexpectedMessage, mine, k)
	}
	return nil
}

// Flush waits, within ctx, until every message queued before the call has
// been written to the socket.
func (c *Conn) Flush(ctx context.Context) error {
	c.Push()
	c.mu.Lock()
	target := c.queued
	for {
		if c.err != nil {
			err := c.err
			c.mu.Unlock()
			return err
		}
		if c.written >= target {
			break
		}
		ch := c.progressLocked()
		c.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
		c.mu.Lock()
	}
	c.mu.Unlock()
	return nil
}

// Shutdown says goodbye with reason, waits within ctx until everything
// queued has been written, and closes the connection. The peer receives
// every message sent before Shutdown, then the goodbye.
func (c *Conn) Shutdown(ctx context.Context, reason string) error {
	err := c.lockRoom(ctx, false)
	if err == nil {
		off := len(c.out)
		c.out = appendGoodbye(c.out, reason)
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
	if err := c.lockRoom(ctx, false); err != nil {
		return err
	}
	off := len(c.out)
	c.out = appendGoodbye(c.out, reason)
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

// lockRoom locks mu once the output queue has room and, for an offer, a
// credit is left; it waits within ctx.
func (c *Conn) lockRoom(ctx context.Context, offer bool) error {
	c.mu.Lock()
	for {
		if c.err != nil {
			err := c.err
			c.mu.Unlock()
			return err
		}
		if c.saidBye {
			c.mu.Unlock()
			return fmt.Errorf("transport: %s: send after goodbye: %w", c.desc, ErrClosed)
		}
		if len(c.out) < c.cfg.MaxQueued && (!offer || c.outstanding < c.window) {
			return nil
		}
		ch := c.progressLocked()
		c.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
		c.mu.Lock()
	}
}

// unlockAndKick accounts for the frames queued from off and unlocks mu,
// then sees them written. If the socket is idle and has been for a while,
// it writes them at once on this goroutine, without waiting: a lone send
// costs one write and no hand-off. Otherwise, or for what the socket would
// not take, it wakes the writer goroutine, which writes everything queued
// by then in one go.
func (c *Conn) unlockAndKick(off int) {
	c.queued += uint64(len(c.out) - off)
	if c.writing || len(c.outFDs) > 0 || time.Since(c.lastWrite) < streamGap {
		c.mu.Unlock()
		c.kickWriter()
		return
	}
	if c.writeNow() {
		c.kickWriter()
	}
}

func (c *Conn) kickWriter() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// writeNow writes what is queued (no descriptors) with one non-blocking
// write. It is called with mu held and the socket free, and unlocks mu.
// It reports whether anything is left for the writer.
func (c *Conn) writeNow() bool {
	c.writing = true
	buf := c.out
	c.out = c.spare[:0]
	c.mu.Unlock()
	op := &c.wr
	op.p, op.oob, op.wait, op.n, op.errno = buf, nil, false, 0, 0
	err := c.rc.Write(op.fn)
	op.p = nil
	n := op.n
	if err == nil && op.errno != 0 && op.errno != unix.EAGAIN {
		err = op.errno
	}
	c.mu.Lock()
	c.writing = false
	c.lastWrite = time.Now()
	c.written += uint64(n)
	if n == len(buf) {
		c.cut = false
	} else if n > 0 {
		c.cut = true
	}
	if n < len(buf) && err == nil {
		// The socket is full: the rest goes first, before anything
		// queued meanwhile.
		for i := range c.outFDs {
			c.outFDs[i].off += len(buf) - n
		}
		rest := append(buf[:0], buf[n:]...)
		buf, c.out = c.out, append(rest, c.out...)
	}
	c.spare = buf[:0]
	c.wakeLocked()
	more := len(c.out) > 0 && c.err == nil
	c.mu.Unlock()
	if err != nil {
		c.writeFailed(writeErr(err))
		return false
	}
	return more
}

func (c *Conn) progressLocked() chan struct{} {
	if c.progress == nil {
		c.progress = make(chan struct{})
	}
	return c.progress
}

func (c *Conn) wakeLocked() {
	if c.progress != nil {
		close(c.progress)
		c.progress = nil
	}
}

// writeLoop writes what is queued, all of it in one write where it can.
func (c *Conn) writeLoop() {
	defer close(c.writerDone)
	for {
		select {
		case <-c.kick:
		case <-c.dying:
			return
		}
		for {
			c.mu.Lock()
			if c.err != nil || c.writing || len(c.out) == 0 {
				// Failed, or a sender is writing and will kick again if
				// it leaves anything, or nothing to do.
				c.mu.Unlock()
				break
			}
			c.writing = true
			buf, fds := c.out, c.outFDs
			c.out, c.outFDs = c.spare[:0], c.spareFDs[:0]
			c.mu.Unlock()
			err := c.writeBatch(buf, fds)
			for i := range fds {
				closeFDs(fds[i].fds)
				fds[i] = pendingFDs{}
			}
			c.mu.Lock()
			c.writing = false
			c.lastWrite = time.Now()
			c.spare, c.spareFDs = buf[:0], fds[:0]
			if err == nil {
				c.written += uint64(len(buf))
				c.cut = false
			}
			c.wakeLocked()
			c.mu.Unlock()
			if err != nil {
				c.writeFailed(err)
				return
			}
		}
	}
}

// writeFailed fails the connection for an error writing to the socket.
func (c *Conn) writeFailed(err error) {
	err = fmt.Errorf("transport: send to %s: %w", c.desc, err)
	if errors.Is(err, ErrDisconnected) {
		// The peer is gone, but what it sent before it went, a goodbye
		// say, is still to be read: leave the socket to Recv and Close.
		c.setFailure(err)
		return
	}
	c.fail(err, false)
}

// writeBatch writes buf, sending each set of descriptors with the first
// byte of its frame.
//
// The write timeout measures a peer that stops reading, and nothing else:
// it is armed only once the socket is full, renewed whenever bytes leave,
// and cleared at the end. A deadline left behind would fail a later write
// on a healthy connection (RawConn.Write checks it before writing), and
// one deadline for the whole batch would fail a peer that reads slowly but
// steadily.
func (c *Conn) writeBatch(buf []byte, fds []pendingFDs) error {
	armed := false
	err := c.writeFrames(buf, fds, &armed)
	if armed {
		if cerr := c.nc.SetWriteDeadline(time.Time{}); err == nil {
			err = cerr
		}
	}
	return err
}

func (c *Conn) writeFrames(buf []byte, fds []pendingFDs, armed *bool) error {
	off := 0
	for i, p := range fds {
		if err := c.writeAll(buf[off:p.off], nil, armed); err != nil {
			return err
		}
		end := len(buf)
		if i+1 < len(fds) {
			end = fds[i+1].off
		}
		if err := c.writeAll(buf[p.off:end], unix.UnixRights(p.fds...), armed); err != nil {
			return err
		}
		off = end
	}
	return c.writeAll(buf[off:], nil, armed)
}

// writeAll writes b, with the descriptors in oob (if any) attached to its
// first byte, waiting while the socket is full; see writeBatch for the
// deadline.
func (c *Conn) writeAll(b, oob []byte, armed *bool) error {
	op := &c.wr
	for len(b) > 0 {
		op.p, op.oob, op.wait, op.n, op.errno = b, oob, *armed, 0, 0
		err := c.rc.Write(op.fn)
		n, errno := op.n, op.errno
		op.p, op.oob = nil, nil
		switch {
		case err != nil:
			return writeErr(err)
		case errno == unix.EAGAIN: // nothing fit
		case errno != 0:
			return writeErr(errno)
		default:
			b = b[n:]
			oob = nil // the descriptors left with the first byte
		}
		if len(b) > 0 {
			// The socket is full: the peer has this long to take more.
			if err := c.nc.SetWriteDeadline(time.Now().Add(c.cfg.WriteTimeout)); err != nil {
				return writeErr(err)
			}
			*armed = true
		}
	}
	return nil
}

func writeErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("%w: %w", ErrWriteTimeout, err)
	case errors.Is(err, unix.EPIPE), errors.Is(err, unix.ECONNRESET):
		return fmt.Errorf("%w: %w", ErrDisconnected, err)
	}
	return err
}

// --- Failing and closing --------------------------------------------------

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
	return err
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
	tell(c.nc, code, text)
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
