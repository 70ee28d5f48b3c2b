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
	"time"

	"golang.org/x/sys/unix"
)

// readOp is a recvmsg call made through the RawConn. Its func is built
// once per Conn so that a read does not allocate.
type readOp struct {
	fn      func(fd uintptr) bool
	now     func(fd uintptr) // one recvmsg, for RawConn.Control
	p, oob  []byte
	n, oobn int
	flags   int
	errno   unix.Errno
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
	// A receive buffer starts at initialReadBuffer, enough for any
	// handshake and for the usual messages, and grows to hold a larger
	// frame, or up to the Conn's rbufMax (set by newConn) for a connection
	// whose reads fill it: an idle connection costs little, a busy one
	// reads many messages per system call.
	initialReadBuffer = 4 << 10
	minReadBuffer     = 64 << 10
)

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
	return c.recvLocked(ctx, m)
}

// tryRecv is Recv that never waits: it reports false, and receives
// nothing, when the next message has not arrived whole. A reader that has
// a message in hand uses it to take what else has come, for others,
// without sleeping on the socket.
func (c *Conn) tryRecv(m *Message) (bool, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	c.try = true
	err := c.recvLocked(context.Background(), m)
	c.try = false
	if err == errWouldBlock {
		return false, nil
	}
	return err == nil, err
}

// errWouldBlock is what a read in tryRecv returns instead of waiting.
var errWouldBlock = errors.New("transport: would block")

func (c *Conn) recvLocked(ctx context.Context, m *Message) error {
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
		if err == errInterrupted || err == errWouldBlock {
			return err
		}
		return c.recvFailed(err)
	}
	return nil
}

// interrupt makes the Recv that waits now for the peer, or else the next
// one that has to wait, return errInterrupted; the connection stays
// usable, and what was received is kept for the next Recv. A receiver
// that shares the connection's reading with others (share.Importer's Next
// and its background reader) uses it to take back a Recv that would
// otherwise wait for the peer's next message. Interrupts do not
// accumulate: several before a Recv waits end one wait.
func (c *Conn) interrupt() {
	// The flag first, then the deadline: a Recv that checks the flag
	// (armWait) before it is set finds the deadline in the past when it
	// reads, whatever deadline it set itself.
	c.intr.Store(true)
	c.nc.SetReadDeadline(longAgo)
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
			if len(c.fdq) > 0 && c.shm == nil {
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

// fill reads what the socket (or the lane) has into rbuf[w:], waiting for
// at least a byte; avail is the number of bytes of a partial frame
// buffered.
func (c *Conn) fill(ctx context.Context, avail int) error {
	if c.shm != nil && !c.handshaking {
		return c.fillShm(ctx, avail)
	}
	var n, end int
	var err error
	if c.try {
		if err := c.tryWait(avail); err != nil {
			return err
		}
		polled := c.polledBy.Load() != nil
		failed := polled && c.ended.Load()
		if polled && !failed && !c.sockReady.Load() {
			return errWouldBlock // the poller has not seen the socket readable
		}
		n, end, err = c.readSocketNow(c.rbuf[c.w:])
		if err == errWouldBlock {
			c.sockReady.Store(false)
			if failed {
				// Failed by this side, and what the peer sent before is
				// read (a write that failed leaves the socket open for
				// it): nothing more comes, and no event may say so.
				return c.failure()
			}
		}
	} else if err = c.armWait(ctx, avail); err == nil {
		n, end, err = c.readSocket(ctx, c.rbuf[c.w:], avail)
	}
	if err != nil {
		return err
	}
	if end != 0 {
		return c.endErr(avail, end)
	}
	c.w += n
	c.grewFull()
	return nil
}

// tryWait is what tryRecv does instead of waiting for the rest of a
// partial frame (avail bytes of it buffered): the frame must still come
// whole within FrameTimeout of its first wait, as Recv's would.
func (c *Conn) tryWait(avail int) error {
	if avail == 0 || c.handshaking {
		return nil
	}
	now := time.Now()
	if c.frameStart.IsZero() {
		c.frameStart = now
	} else if now.Sub(c.frameStart) >= c.cfg.FrameTimeout {
		return fmt.Errorf("%w: a frame cut off after %d bytes for %v (FrameTimeout)", ErrTimeout, avail, c.cfg.FrameTimeout)
	}
	return nil
}

// grewFull grows rbuf after a read that filled it: more is probably
// waiting, so read more at a time from now on.
func (c *Conn) grewFull() {
	if c.w == len(c.rbuf) && len(c.rbuf) < c.rbufMax {
		c.growRead(2 * len(c.rbuf))
	}
}

// armWait sets what may end the wait for the next read: the rest of a
// partial frame's FrameTimeout, and ctx.
func (c *Conn) armWait(ctx context.Context, avail int) error {
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
	// Last, after every deadline this function sets (see Interrupt).
	if c.intr.Load() && !c.handshaking {
		return c.interrupted()
	}
	return nil
}

// interrupted takes an interrupt: the flag is consumed, and the deadline
// it set in the past gives way to the frame's, unless the watched context
// has ended and wants it in the past too.
func (c *Conn) interrupted() error {
	c.intr.Store(false)
	w := &c.watch
	w.mu.Lock()
	defer w.mu.Unlock()
	dl := c.rdl
	if w.fired {
		dl = longAgo
	}
	if err := c.nc.SetReadDeadline(dl); err != nil {
		return c.failure()
	}
	return errInterrupted
}

// How the socket ended, once read: end of stream, or reset.
const (
	sockEOF   = 1
	sockReset = 2
)

// readSocket reads what the socket has into p, waiting for at least a byte,
// and queues the descriptors that came with it. It returns the bytes read,
// or how the socket ended.
func (c *Conn) readSocket(ctx context.Context, p []byte, avail int) (n, end int, err error) {
	op := &c.rd
	op.p = p
	if err := c.rc.Read(op.fn); err != nil {
		switch {
		case errors.Is(err, os.ErrDeadlineExceeded):
			if err := ctx.Err(); err != nil {
				return 0, 0, err
			}
			if c.handshaking {
				return 0, 0, fmt.Errorf("%w: no answer within %v", ErrHandshake, c.cfg.HandshakeTimeout)
			}
			if c.intr.Load() {
				return 0, 0, c.interrupted()
			}
			if !c.rdl.IsZero() && !time.Now().Before(c.rdl) {
				return 0, 0, fmt.Errorf("%w: a frame cut off after %d bytes for %v (FrameTimeout)", ErrTimeout, avail, c.cfg.FrameTimeout)
			}
			// A deadline left by a context no longer watched.
			return 0, 0, c.nc.SetReadDeadline(c.rdl)
		case errors.Is(err, net.ErrClosed):
			return 0, 0, c.failure()
		}
		return 0, 0, err
	}
	return c.took()
}

// readSocketNow is readSocket for tryRecv: what the socket has, or
// errWouldBlock. Control, not Read: no deadline applies to what has
// arrived already.
func (c *Conn) readSocketNow(p []byte) (n, end int, err error) {
	op := &c.rd
	op.p = p
	if err := c.rc.Control(op.now); err != nil {
		op.p = nil
		return 0, 0, c.failure()
	}
	if op.errno == unix.EAGAIN {
		op.p = nil
		return 0, 0, errWouldBlock
	}
	return c.took()
}

// took finishes a recvmsg made with c.rd.
func (c *Conn) took() (n, end int, err error) {
	op := &c.rd
	op.p = nil
	if op.errno != 0 {
		if op.errno == unix.ECONNRESET {
			return 0, sockReset, nil
		}
		return 0, 0, fmt.Errorf("recvmsg: %w", op.errno)
	}
	if op.oobn > 0 || op.flags&unix.MSG_CTRUNC != 0 {
		if err := c.takeFDs(op.oob[:op.oobn], op.flags); err != nil {
			return 0, 0, err
		}
	}
	if op.n == 0 {
		return 0, sockEOF, nil
	}
	return op.n, 0, nil
}

// endErr is what Recv returns for the end of the socket, with avail bytes
// of a partial frame buffered.
func (c *Conn) endErr(avail, end int) error {
	if end == sockReset {
		if c.bye && avail == 0 {
			// The peer closed with our messages unread: after its
			// goodbye, that is still a clean end.
			return io.EOF
		}
		return fmt.Errorf("%w: %w", ErrDisconnected, unix.ECONNRESET)
	}
	switch {
	case avail > 0:
		return fmt.Errorf("%w: %w: frame cut off after %d bytes", ErrDisconnected, io.ErrUnexpectedEOF, avail)
	case c.bye:
		return io.EOF
	}
	return fmt.Errorf("%w: connection closed without goodbye", ErrDisconnected)
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
	case !c.cfg.AcceptVMM && !(c.handshaking && c.askShm):
		err = fmt.Errorf("%w: %d descriptors, and this side did not advertise CapVMM", ErrUnexpectedMessage, len(fds))
	case len(c.fdq)+len(fds) > c.fdLimit():
		err = malformed("%d descriptors pending, limit %d", len(c.fdq)+len(fds), c.fdLimit())
	}
	if err != nil {
		closeFDs(fds)
		return err
	}
	c.fdq = append(c.fdq, fds...)
	c.carriers++
	return nil
}

// fdLimit is the most descriptors that may wait for their message. On a
// shm connection, those of the next offer may come before the one being
// taken has claimed its own (PROTOCOL.md section 2.3).
func (c *Conn) fdLimit() int {
	if c.shm != nil {
		return 2 * MaxFDs
	}
	return MaxFDs
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
		if nfds > 0 && !c.cfg.AcceptVMM {
			// Descriptors to a side that did not ask for them, whether
			// or not any came: PROTOCOL.md section 5.
			return fmt.Errorf("%w: offer declares %d descriptors, and this side did not advertise CapVMM", ErrUnexpectedMessage, nfds)
		}
		if nfds > len(c.fdq) && c.shm != nil {
			// They left on the socket before the offer entered the lane.
			if err := c.pullSocket(nfds); err != nil {
				return err
			}
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
