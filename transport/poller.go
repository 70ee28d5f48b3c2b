//go:build linux

package transport

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// poller lets one goroutine wait for messages on many connections: a
// producer reads every consumer with it, with no goroutine per connection
// and no goroutine switch per message. The goroutine that polls takes
// what has come with each connection's tryRecv, and calls Wait when none
// has anything. Wait looks at the connections' lanes, for up to their
// ShmSpin, and then sleeps in one epoll_wait(2) on every socket (the
// lanes' doorbells, the sockets' messages, errors and ends) and on Wake.
//
// Add, Remove and Wait are for the polling goroutine, one at a time (a
// reader that hands the polling over must order the handover itself, as a
// mutex or channel does); Wake may be called from any goroutine. A
// connection that fails or is closed by any goroutine wakes the poller, and
// its next tryRecv returns why. Close the poller after the connections are
// removed or closed.
type poller struct {
	epfd, evfd int
	conns      []*Conn
	byFD       map[int32]*Conn
	events     []unix.EpollEvent
	spin       time.Duration
	onShm      int           // connections on the shm channel: none, no spin
	gap        time.Duration // how long the last sleep lasted: no spin after long ones
	// sleeping is set while Wait sleeps or is about to; woken by Wake.
	// Each side stores its own word before it loads the other's, so one
	// of the two sees the other (Swap: see lane.sleep).
	sleeping, woken atomic.Bool
	watchDone       <-chan struct{}
	watchStop       func() bool
	closed          bool
}

// newPoller returns an empty poller. spin is how long Wait polls the
// lanes before it sleeps, while messages come about that often (0: no
// polling; Config.ShmSpin is the connections' own).
func newPoller(spin time.Duration) (*poller, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("transport: epoll_create1: %w", err)
	}
	evfd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("transport: eventfd: %w", err)
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: -1}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, evfd, &ev); err != nil {
		unix.Close(evfd)
		unix.Close(epfd)
		return nil, fmt.Errorf("transport: epoll_ctl: %w", err)
	}
	return &poller{epfd: epfd, evfd: evfd, byFD: make(map[int32]*Conn), events: make([]unix.EpollEvent, 64), spin: max(spin, 0)}, nil
}

// Add watches c. A connection is watched by one poller at most.
func (p *poller) Add(c *Conn) error {
	if p.closed {
		return ErrClosed
	}
	if c.polledBy.Load() != nil {
		return errors.New("transport: poller.Add: the connection is watched already")
	}
	var fd int32 = -1
	var cerr error
	if err := c.rc.Control(func(f uintptr) {
		fd = int32(f)
		ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP, Fd: fd}
		cerr = unix.EpollCtl(p.epfd, unix.EPOLL_CTL_ADD, int(f), &ev)
	}); err != nil {
		return c.failure()
	}
	if cerr != nil {
		return fmt.Errorf("transport: epoll_ctl: %w", cerr)
	}
	c.polledBy.Store(p)
	// What came before it was watched is read by the first tryRecv.
	c.sockReady.Store(true)
	p.byFD[fd] = c
	p.conns = append(p.conns, c)
	if c.shm != nil {
		p.onShm++
	}
	c.pollFD = fd
	if c.ended.Load() {
		p.Wake()
	}
	return nil
}

// Remove stops watching c, which may be closed already.
func (p *poller) Remove(c *Conn) {
	if c.polledBy.Load() != p {
		return
	}
	for i, x := range p.conns {
		if x == c {
			last := len(p.conns) - 1
			p.conns[i] = p.conns[last]
			p.conns[last] = nil
			p.conns = p.conns[:last]
			if c.shm != nil {
				p.onShm--
			}
			break
		}
	}
	if p.byFD[c.pollFD] == c {
		delete(p.byFD, c.pollFD)
		// A closed socket left the epoll set by itself (and its number
		// may be another's now): only an open one is taken out.
		c.rc.Control(func(f uintptr) { unix.EpollCtl(p.epfd, unix.EPOLL_CTL_DEL, int(f), nil) })
	}
	c.polledBy.Store(nil)
}

// Wake makes the Wait under way, or else the next one, return. It costs
// two atomic operations unless Wait sleeps, and then one write(2).
func (p *poller) Wake() {
	if p.woken.Swap(true) {
		return // woken already, and not yet seen
	}
	if p.sleeping.Load() {
		var one = [8]byte{1}
		unix.Write(p.evfd, one[:])
	}
}

// Wait returns when a watched connection may have a message (tryRecv
// says), Wake is called, a partial frame's FrameTimeout passes (tryRecv
// then fails it), or ctx ends (then with ctx's error). It may return with
// nothing new. Like a level-triggered epoll, it does not sleep while a
// connection whose socket was readable, or that failed, has not been read
// by tryRecv since: a connection whose tryRecv failed must be removed.
func (p *poller) Wait(ctx context.Context) error {
	if p.closed {
		return ErrClosed
	}
	if p.woken.Swap(false) {
		return nil
	}
	if done := ctx.Done(); done != p.watchDone {
		if p.watchStop != nil {
			p.watchStop()
			p.watchStop = nil
		}
		p.watchDone = done
		if done != nil {
			p.watchStop = context.AfterFunc(ctx, p.Wake)
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	start := time.Now()
	if p.spin > 0 && p.onShm > 0 && p.gap <= 4*p.spin && p.spinShm(start) {
		p.unwatchShort(ctx)
		return nil
	}
	p.sleeping.Swap(true)
	var deadline time.Time
	ready := p.woken.Swap(false)
	armed := 0
	for _, c := range p.conns {
		if ready {
			break
		}
		r, dl := c.armPoll()
		armed++
		// A socket epoll said was readable, or a connection that failed,
		// that no tryRecv has taken since: its Wake may be spent (the
		// caller's pass did not reach it), and a socket closed by this
		// side left the epoll set with no event. tryRecv clears the mark
		// once it has read all there is.
		ready = r || c.sockReady.Load()
		if !dl.IsZero() && (deadline.IsZero() || dl.Before(deadline)) {
			deadline = dl
		}
	}
	var err error
	if !ready {
		timeout := -1
		if !deadline.IsZero() {
			timeout = int(max(time.Until(deadline)/time.Millisecond+1, 0))
		}
		err = p.epollWait(timeout)
	}
	p.sleeping.Store(false)
	p.woken.Store(false)
	for _, c := range p.conns[:armed] {
		c.disarmPoll()
	}
	p.gap = time.Since(start)
	p.unwatchShort(ctx)
	if err != nil {
		return err
	}
	return ctx.Err()
}

// unwatchShort stops watching ctx if it has a deadline: such a context is
// likely one wait's (a broadcast's grace), and unwatched its cancel costs
// no goroutine and no Wake. A context without one stays watched for the
// next Wait, at no cost per Wait.
func (p *poller) unwatchShort(ctx context.Context) {
	if _, ok := ctx.Deadline(); ok && p.watchStop != nil {
		p.watchStop()
		p.watchStop, p.watchDone = nil, nil
	}
}

// spinShm polls the lanes, yielding between looks, for up to spin; it
// reports whether a lane has bytes or Wake was called.
func (p *poller) spinShm(start time.Time) bool {
	until := start.Add(p.spin)
	for i := 1; ; i++ {
		for _, c := range p.conns {
			if c.shmHasBytes() {
				return true
			}
		}
		if p.woken.Load() {
			p.woken.Store(false)
			return true
		}
		if i%16 == 0 && time.Now().After(until) {
			return false
		}
		spinPause(i)
	}
}

// epollWait sleeps until a socket is readable, Wake, or timeout
// milliseconds (-1: none), and marks the sockets that are.
func (p *poller) epollWait(timeout int) error {
	for {
		n, err := unix.EpollWait(p.epfd, p.events, timeout)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("transport: epoll_wait: %w", err)
		}
		for _, ev := range p.events[:n] {
			if ev.Fd < 0 {
				var b [8]byte
				unix.Read(p.evfd, b[:])
				continue
			}
			if c := p.byFD[ev.Fd]; c != nil {
				c.sockReady.Store(true)
			}
		}
		return nil
	}
}

// Poll marks, without waiting, the sockets that have something to read:
// a poller that never sleeps, because messages keep coming, calls it now
// and then so that a shm connection's error or end is seen.
func (p *poller) Poll() error {
	if p.closed {
		return ErrClosed
	}
	return p.epollWait(0)
}

// Close releases the poller. Idempotent.
func (p *poller) Close() error {
	if p.closed {
		return nil
	}
	p.closed = true
	if p.watchStop != nil {
		p.watchStop()
	}
	for _, c := range p.conns {
		c.polledBy.Store(nil)
	}
	p.conns = nil
	unix.Close(p.evfd)
	return unix.Close(p.epfd)
}

// armPoll prepares c for the poller's sleep: a shm connection's reader
// says it sleeps (the peer rings the doorbell after its next write) and
// looks at the ring once more. It reports whether c has bytes to read,
// and when a partial frame times out (zero: none).
func (c *Conn) armPoll() (ready bool, deadline time.Time) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	if c.w > c.r {
		if c.frameStart.IsZero() {
			c.frameStart = time.Now()
		}
		deadline = c.frameStart.Add(c.cfg.FrameTimeout)
	}
	if c.shm == nil || c.shmGone || c.handshaking {
		return false, deadline
	}
	c.shm.in.sleep()
	c.sleeps++ // the peer may ring once for it (socketFrames)
	return c.shm.in.ready() || c.sockEnd != 0, deadline
}

// disarmPoll ends armPoll's sleep.
func (c *Conn) disarmPoll() {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	if c.shm != nil && !c.shmGone {
		c.shm.in.wake()
	}
}

// shmHasBytes reports whether c's lane has bytes to read, for a poller's
// spin.
func (c *Conn) shmHasBytes() bool {
	if !c.rmu.TryLock() {
		return false
	}
	defer c.rmu.Unlock()
	return c.shm != nil && !c.shmGone && !c.handshaking && c.shm.in.ready()
}
