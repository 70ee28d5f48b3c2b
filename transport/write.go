//go:build linux

package transport

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// pendingFDs are descriptors that leave with the queued frame at off.
type pendingFDs struct {
	off int
	fds []int
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

// streamGap is the idle time after a write that tells a lone send,
// written at once by its sender, from one of a stream, left to the
// writer goroutine so that it leaves with the next ones in one write.
// It is well below a round trip between two processes (10 µs and
// more) and well above the gap between sends in a loop (under 1 µs).
const streamGap = 3 * time.Microsecond

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
		if err := c.waitProgressLocked(ctx); err != nil {
			return err
		}
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
	// A write into the lane costs no system call: write at once if the
	// lane is free, whatever the stream.
	if c.writing || len(c.outFDs) > 0 || (c.shm == nil && time.Since(c.lastWrite) < streamGap) {
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
	var n int
	var err error
	if c.shm != nil {
		n, err = c.shmWriteSome(buf)
	} else {
		op := &c.wr
		op.p, op.oob, op.wait, op.n, op.errno = buf, nil, false, 0, 0
		err = c.rc.Write(op.fn)
		op.p = nil
		n = op.n
		if err == nil && op.errno != 0 && op.errno != unix.EAGAIN {
			err = op.errno
		}
	}
	c.mu.Lock()
	c.writing = false
	if c.shm == nil {
		c.lastWrite = time.Now() // only the socket's heuristic reads it
	}
	c.written += uint64(n)
	if c.shm != nil {
		// The socket, where an error message goes, has whole frames.
	} else if n == len(buf) {
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

// waitProgressLocked, called with mu held, waits for the writer's next
// progress (a write, a failure) or the end of ctx. It returns nil with mu
// held again, or ctx's error with mu released.
func (c *Conn) waitProgressLocked(ctx context.Context) error {
	ch := c.progressLocked()
	c.mu.Unlock()
	select {
	case <-ch:
	case <-ctx.Done():
		return ctx.Err()
	}
	c.mu.Lock()
	return nil
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
			if c.shm == nil {
				c.lastWrite = time.Now()
			}
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
		c.endPolled()
		return
	}
	// A peer that left the lane unread (stopped, say), or broke the
	// lane's rules (its head: shm.go, peerHead), can be told why it was
	// dropped: the socket holds whole frames and has room, and the peer
	// reads it once it resumes. A full socket has no room for it, and
	// may end in the middle of a frame.
	c.fail(err, errors.Is(err, errShmStalled) || (c.shm != nil && errors.Is(err, ErrMalformed)))
}

// errShmStalled marks a write timeout on a lane, where the socket is
// free for an error message. Its text is empty: it only marks.
var errShmStalled = errors.New("")

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
		if err := c.writeAll(buf[off:p.off], nil, 0, armed); err != nil {
			return err
		}
		end := len(buf)
		if i+1 < len(fds) {
			end = fds[i+1].off
		}
		if err := c.writeAll(buf[p.off:end], unix.UnixRights(p.fds...), len(buf)-p.off, armed); err != nil {
			return err
		}
		off = end
	}
	return c.writeAll(buf[off:], nil, 0, armed)
}

// writeAll writes b, with the descriptors in oob (if any) attached to its
// first byte, waiting while the socket is full; see writeBatch for the
// deadline. On a shm connection, b goes into the lane, and the
// descriptors before it on the socket, with a doorbell (and the rest of
// one cut short before) to carry them; behind is how many bytes of the
// batch, from b on, wait for the lane to be read first (shmFlushed).
func (c *Conn) writeAll(b, oob []byte, behind int, armed *bool) error {
	if c.shm == nil {
		return c.sockWriteAll(b, oob, armed)
	}
	if oob != nil {
		if err := c.shmFlushed(behind); err != nil {
			return err
		}
		if c.bellLeft > 0 {
			if err := c.sockWriteAll(bell[:c.bellLeft], nil, armed); err != nil {
				return err
			}
			c.bellLeft = 0
		}
		if err := c.sockWriteAll(bell[:], oob, armed); err != nil {
			return err
		}
	}
	return c.shmWriteAll(b)
}

// sockWriteAll is writeAll on the socket.
func (c *Conn) sockWriteAll(b, oob []byte, armed *bool) error {
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
