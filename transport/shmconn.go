//go:build linux

package transport

import (
	"context"
	"encoding/binary"
	"fmt"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// This file is a Conn's shm mode (shm.go): how Recv reads the lane and
// sleeps on the socket, and how the write side fills the lane and rings
// the doorbell.

// sockFrameMax caps a frame on the socket of a shm connection: only an
// error message is a frame there, and its text is at most maxTextLen.
const sockFrameMax = 4 << 10

// bell is the doorbell, and the carrier of descriptors: a frame header
// of length 0 on the socket.
var bell [headerSize]byte

// fillShm reads what the lane has into rbuf[w:], waiting for at least a
// byte: it polls the lane for up to Config.ShmSpin, then sleeps on the
// socket, which wakes it with a doorbell, an error message or its end.
func (c *Conn) fillShm(ctx context.Context, avail int) error {
	if c.shmGone {
		return c.failure()
	}
	var waited time.Time
	for {
		n, err := c.shm.in.read(c.rbuf[c.w:])
		if err != nil {
			return err
		}
		if n > 0 {
			if !waited.IsZero() {
				c.gap = time.Since(waited)
			}
			c.w += n
			c.grewFull()
			return nil
		}
		if c.sockEnd != 0 {
			// The peer wrote everything before it closed: it is read.
			return c.endErr(avail, c.sockEnd)
		}
		if c.try {
			if c.polledBy.Load() != nil {
				failed := c.ended.Load()
				if c.sockReady.Swap(false) || failed {
					// The socket has doorbells, an error or its end: take
					// them, then look at the lane again. A connection
					// this side failed gets no more events: once both are
					// read, it says so (as fill does).
					if err := c.drainSocket(); err != nil {
						return err
					}
					if failed && c.sockEnd == 0 && !c.shm.in.ready() {
						return c.failure()
					}
					continue
				}
			}
			if err := c.tryWait(avail); err != nil {
				return err
			}
			return errWouldBlock
		}
		if waited.IsZero() {
			waited = time.Now()
			if c.spinShm(ctx, waited) {
				continue
			}
		}
		c.shm.in.sleep()
		c.sleeps++
		if c.shm.in.ready() {
			c.shm.in.wake()
			continue
		}
		err = c.armWait(ctx, avail)
		if err == nil {
			err = c.readSocketShm(ctx, avail)
		}
		c.shm.in.wake()
		if err != nil {
			return err
		}
	}
}

// spinShm polls the lane, yielding between looks, for up to ShmSpin, if
// the last wait for it was short enough that polling would likely have
// caught it; it reports whether bytes came.
func (c *Conn) spinShm(ctx context.Context, start time.Time) bool {
	spin := c.cfg.ShmSpin
	if spin <= 0 || c.gap > 4*spin {
		return false
	}
	until := start.Add(spin)
	done := ctx.Done()
	for i := 1; ; i++ {
		if c.shm.in.ready() {
			return true
		}
		if i%16 == 0 {
			if time.Now().After(until) || c.intr.Load() {
				return false
			}
			if done != nil {
				select {
				case <-done:
					return false
				default:
				}
			}
		}
		spinPause(i)
	}
}

// spinPause is one pause of a spin on a lane: it lets this process's
// other goroutines run and, every few looks, other processes' threads too.
// A spin that only yields to goroutines keeps its core from every other
// process; with more busy processes than cores (a producer and sixteen
// consumers on sixteen), the spinning consumers then starve the producer
// whose messages they wait for. sched_yield(2) gives the core to a thread
// that is ready to run on it, and returns at once when none is. The first
// looks, a few microseconds, only yield to goroutines: a message that
// comes that soon (one busy consumer) is taken with no system call.
func spinPause(i int) {
	runtime.Gosched()
	if i > 64 && i%4 == 0 {
		unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
	}
}

// readSocketShm waits for the socket of a shm connection and takes what
// it brings: doorbells, descriptors, an error message, its end.
func (c *Conn) readSocketShm(ctx context.Context, avail int) error {
	c.roomInSocketBuf()
	n, end, err := c.readSocket(ctx, c.sbuf[c.sw:], avail)
	if err != nil {
		return err
	}
	return c.socketRead(n, end)
}

// socketRead takes one read of the socket of a shm connection: n bytes
// into sbuf, or its end.
func (c *Conn) socketRead(n, end int) error {
	if end != 0 {
		c.sockEnd = end
		return nil
	}
	c.sw += n
	return c.socketFrames()
}

func (c *Conn) roomInSocketBuf() {
	if c.sr > 0 {
		c.sw = copy(c.sbuf, c.sbuf[c.sr:c.sw])
		c.sr = 0
	}
	if c.sw == len(c.sbuf) {
		c.sbuf = append(c.sbuf, make([]byte, len(c.sbuf))...)
	}
}

// bellSlack is how many doorbells beyond the count of socketFrames a peer
// may send. A peer that keeps the rules never needs it (the count is
// exact: a writer rings only after its compare-and-swap of the sleeping
// word from 1 to 0 succeeds, so once per sleep of this reader at most,
// and once more to carry descriptors); it is a margin for a peer that
// rings a few times too often, which costs little. What it bounds is the
// peer that rings without end and makes this side wake up for nothing
// (one rang 610 million times in 6 s, a whole core of the producer's).
const bellSlack = 64

// socketFrames takes the whole frames in sbuf: doorbells, which only woke
// the reader, and an error message, which ends the connection. Anything
// else has no business on the socket of a shm connection, and neither
// have more doorbells than the reader slept (bellSlack).
func (c *Conn) socketFrames() error {
	for {
		avail := c.sw - c.sr
		if avail < headerSize {
			break
		}
		n := int(binary.BigEndian.Uint32(c.sbuf[c.sr:]))
		if n == 0 {
			c.sr += headerSize
			if c.bells++; c.bells > c.sleeps+c.carriers+bellSlack {
				return malformed("%d doorbells on the socket of a shm connection whose reader slept %d times and took %d sets of descriptors: a doorbell answers a sleep", c.bells, c.sleeps, c.carriers)
			}
			continue
		}
		if n > sockFrameMax {
			return malformed("a frame of %d bytes on the socket of a shm connection, where only doorbells, descriptors and errors go", n)
		}
		if avail < headerSize+n {
			break
		}
		body := c.sbuf[c.sr+headerSize : c.sr+headerSize+n]
		c.sr += headerSize + n
		var m Message
		kind, err := c.dec.decode(body, &m)
		if err != nil {
			return err
		}
		if kind == KindError {
			return &RemoteError{Code: c.dec.errCode, Message: c.dec.errText, Peer: c.desc}
		}
		return fmt.Errorf("%w: %s on the socket of a shm connection, where only doorbells, descriptors and errors go", ErrUnexpectedMessage, kind)
	}
	if c.sr == c.sw {
		c.sr, c.sw = 0, 0
	}
	return nil
}

// drainSocket takes, without waiting, all the socket of a shm connection
// has: doorbells, descriptors, an error message, its end.
func (c *Conn) drainSocket() error {
	for c.sockEnd == 0 {
		c.roomInSocketBuf()
		n, end, err := c.readSocketNow(c.sbuf[c.sw:])
		if err == errWouldBlock {
			return nil
		}
		if err != nil {
			return err
		}
		if err := c.socketRead(n, end); err != nil {
			return err
		}
	}
	return nil
}

// pullSocket takes, without waiting, what the socket has until need
// descriptors are queued: those of an offer just read from the lane left
// on the socket before it. One recvmsg takes the descriptors of at most
// one carrier.
func (c *Conn) pullSocket(need int) error {
	for c.sockEnd == 0 && len(c.fdq) < need {
		c.roomInSocketBuf()
		op := &c.rd
		op.p = c.sbuf[c.sw:]
		// Control, not Read: no deadline of ctx applies to what has
		// arrived already.
		if err := c.rc.Control(c.rd.now); err != nil {
			return c.failure()
		}
		if op.errno == unix.EAGAIN {
			op.p = nil
			return nil
		}
		n, end, err := c.took()
		if err != nil {
			return err
		}
		if err := c.socketRead(n, end); err != nil || end != 0 {
			return err
		}
	}
	return nil
}

// shmWriteSome writes as much of b as the lane has room for, without
// waiting, and rings the doorbell if the peer sleeps. The caller owns the
// write side.
func (c *Conn) shmWriteSome(b []byte) (int, error) {
	c.shmMu.RLock()
	defer c.shmMu.RUnlock()
	if c.shmGone {
		return 0, c.failure()
	}
	n, err := c.shm.out.write(b)
	if n > 0 && c.shm.out.asleep() {
		if berr := c.shmBell(); err == nil {
			err = berr
		}
	}
	return n, err
}

// peerClosed reports whether the peer has closed its socket, as far as
// poll(2) says without reading: a peer that only shut down its writing
// after its goodbye still reads.
func (c *Conn) peerClosed() bool {
	hup := false
	c.rc.Control(func(fd uintptr) {
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		if n, err := unix.Poll(p, 0); err == nil && n > 0 {
			hup = p[0].Revents&(unix.POLLHUP|unix.POLLERR) != 0
		}
	})
	return hup
}

// shmWriteAll writes b into the lane, waiting while it is full: the peer
// has WriteTimeout to read some of it, as it has a full socket.
func (c *Conn) shmWriteAll(b []byte) error {
	var w shmWait
	for len(b) > 0 {
		n, err := c.shmWriteSome(b)
		if err != nil {
			return err
		}
		if n > 0 {
			b = b[n:]
			w = shmWait{}
			continue
		}
		if err := c.shmPause(&w, "read nothing of a full shm lane", true); err != nil {
			return err
		}
	}
	return nil
}

// shmFlushed waits until the peer has read everything in the lane. A
// writer does so before it sends descriptors, so that a reader never
// holds those of more than the offer it is taking and the next. behind is
// how many bytes of the writer's batch wait for it: the frame that
// carries the descriptors and what follows it.
//
// While what waits would fit in the room the peer has left in the lane,
// it waits without the write deadline, which measures only a peer that
// leaves a full lane (or socket) unread (PROTOCOL.md section 7): a reader
// that pauses (a trainer saving a checkpoint) is not stuck. What it
// leaves unread is offers it holds, and the lease deadline of the layer
// above covers those; a socket connection waits the same for a reader
// that pauses with room in its socket. But once what waits (behind, and
// what senders queued meanwhile) would not fit, the lane is as good as
// full: a socket would have filled with those bytes, and the deadline
// runs from then, renewed whenever the peer reads. Without it a peer
// stopped while a descriptor waited was never dropped when the lease
// deadline was off: the lane never filled, as the bytes that would fill
// it waited here (a producer of 4096 small buffers, with the writer's
// batch of their first offers 660 KB long, kept a SIGSTOPped consumer
// for ever).
//
// The wait is the writer goroutine's, of this connection only: it holds
// no lock that a send or another connection needs. It ends when the peer
// reads, closes or dies (its socket hangs up), breaks the lane's rules
// (its head goes backwards or past the tail: peerHead), leaves it as good
// as full for the write timeout, or the connection fails (Close, the
// lease deadline).
func (c *Conn) shmFlushed(behind int) error {
	var w shmWait
	full := false
	var head uint64
	for {
		c.shmMu.RLock()
		if c.shmGone {
			c.shmMu.RUnlock()
			return c.failure()
		}
		done, err := c.shm.out.flushed()
		seen, unread := c.shm.out.seen, c.shm.out.pos-c.shm.out.seen
		c.shmMu.RUnlock()
		if err != nil || done {
			return err
		}
		c.mu.Lock()
		queued := len(c.out)
		c.mu.Unlock()
		nowFull := unread+uint64(behind)+uint64(queued) > laneSize
		if seen != head || nowFull != full {
			// The peer read, or the lane just became as good as full:
			// the deadline, if any, runs from now.
			w = shmWait{}
			head, full = seen, nowFull
		}
		if err := c.shmPause(&w, "did not read its shm lane to its end", full); err != nil {
			return err
		}
	}
}

// shmWait is the state of a wait for the peer to read the lane.
type shmWait struct {
	stuck time.Time
	pause time.Duration
}

// Pauses between looks at a lane the peer has not read: short at first, to
// catch a reader that is only behind, then up to shmPauseMax; and once a
// wait without a deadline has lasted shmLongWait, up to shmPauseLong, so
// that a reader paused for minutes costs a few wake-ups a second.
const (
	shmPauseMax  = time.Millisecond
	shmLongWait  = 100 * time.Millisecond
	shmPauseLong = 20 * time.Millisecond
)

// shmPause waits a little for the peer to read, looking again soon and
// then less often: a reader that is behind, or stopped. It fails once the
// peer has closed, or, with deadline, made no progress for WriteTimeout.
func (c *Conn) shmPause(w *shmWait, what string, deadline bool) error {
	if c.peerClosed() {
		// A socket would say EPIPE: the reader is gone for good.
		return fmt.Errorf("%w: the peer closed the connection and %s: %w", ErrDisconnected, what, unix.EPIPE)
	}
	now := time.Now()
	if w.stuck.IsZero() {
		w.stuck = now
	}
	waited := now.Sub(w.stuck)
	if deadline && waited >= c.cfg.WriteTimeout {
		return fmt.Errorf("%w: the peer %s for %v%w", ErrWriteTimeout, what, c.cfg.WriteTimeout, errShmStalled)
	}
	most := shmPauseMax
	if !deadline && waited >= shmLongWait {
		most = shmPauseLong
	}
	w.pause = min(max(2*w.pause, 10*time.Microsecond), most)
	if c.shmTimer == nil {
		c.shmTimer = time.NewTimer(w.pause)
	} else {
		c.shmTimer.Reset(w.pause)
	}
	select {
	case <-c.shmTimer.C:
		return nil
	case <-c.dying:
		c.shmTimer.Stop()
		return c.failure()
	}
}

// shmBell writes the doorbell to the socket, without waiting: a socket
// too full to take it has bytes for the peer to wake to already. A
// doorbell cut short is finished before anything else goes on the socket.
// The caller owns the write side. It fails only if the peer is gone.
func (c *Conn) shmBell() error {
	left := c.bellLeft
	fresh := left == 0
	if fresh {
		left = headerSize
	}
	op := &c.wr
	op.p, op.oob, op.wait, op.n, op.errno = bell[:left], nil, false, 0, 0
	err := c.rc.Write(op.fn)
	n, errno := op.n, op.errno
	op.p = nil
	if errno == unix.EPIPE || errno == unix.ECONNRESET {
		return writeErr(errno)
	}
	if err != nil || (fresh && n == 0) {
		return nil
	}
	c.bellLeft = left - n
	return nil
}
