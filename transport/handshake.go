//go:build linux

package transport

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// This file is a connection's start: Dial, and the handshake (hello and
// hello-ack, PROTOCOL.md) that both sides run before a Conn is shared.

// Dial connects to the listener at path, checks its credentials against
// cfg.AllowedUIDs, and runs the handshake.
func Dial(ctx context.Context, path string, cfg Config) (*Conn, error) {
	cfg, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("transport: dial %s: %w", path, err)
	}
	uc := nc.(*net.UnixConn)
	cred, err := checkPeer(uc, &cfg, "dialer of "+path)
	if err != nil {
		uc.Close()
		return nil, fmt.Errorf("transport: dial %s: %w", path, err)
	}
	c, err := newConn(uc, cfg, cred)
	if err != nil {
		uc.Close()
		return nil, fmt.Errorf("transport: dial %s: %w", path, err)
	}
	if err := c.handshake(ctx, true, nil); err != nil {
		c.Close()
		return nil, fmt.Errorf("transport: dial %s: %w", path, err)
	}
	return c, nil
}

// handshake exchanges hello and hello-ack, then starts the writer. The
// dialer speaks first. A listener calls admit, if not nil, once the hello
// has passed and before it answers: an error from it is the peer's
// answer. Until handshake returns, the Conn is not shared.
func (c *Conn) handshake(ctx context.Context, dialer bool, admit func(*Conn) error) (err error) {
	// The timeout is a deadline; ctx interrupts through an AfterFunc,
	// which runs once ctx.Err is set, so that the two read apart.
	c.nc.SetDeadline(time.Now().Add(c.cfg.HandshakeTimeout))
	stop := context.AfterFunc(ctx, func() { c.nc.SetDeadline(longAgo) })
	defer stop()
	c.handshaking = true
	defer func() { c.handshaking = false }()

	mine := hello{
		kind:    KindHelloAck,
		version: Version,
		role:    c.cfg.Role,
		pid:     uint64(os.Getpid()),
		devices: c.cfg.Devices,
		caps:    c.cfg.caps(),
	}
	if c.cfg.Role == RoleConsumer {
		mine.credits = uint64(c.cfg.Credits)
	} else {
		mine.session = c.cfg.Session
	}
	if c.cfg.Role == RoleObserver {
		mine.caps = 0 // it receives nothing but snapshots
	}
	rand.Read(mine.instanceID[:])

	var werr error
	if dialer {
		c.askShm = mine.caps&CapShm != 0
		mine.kind = KindHello
		_, werr = c.nc.Write(appendHello(nil, &mine))
		// Read the answer even if the write failed: a listener that
		// refuses us sends an error and closes, possibly before our hello
		// arrives.
	}
	theirs, err := c.readHello(ctx, dialer)
	if err != nil {
		if werr != nil && errors.Is(err, ErrDisconnected) {
			err = fmt.Errorf("%w: %w", ErrDisconnected, werr)
		}
		notify := !dialer
		if !dialer && ctx.Err() != nil {
			// The listener's reason, such as an eviction, for the peer;
			// but a listener that closes (its producer shuts down or
			// restarts) is gone to the peer, as a producer that exits is:
			// a reconnecting consumer tries again, where an error would
			// read as a refusal.
			err = context.Cause(ctx)
			notify = !errors.Is(err, context.Canceled)
		}
		return c.handshakeFailed(err, notify)
	}
	if theirs.role == c.cfg.Role {
		return c.handshakeFailed(fmt.Errorf("%w: both sides are %ss", ErrHandshake, theirs.role), true)
	}
	if err := checkRoles(c.cfg.Role, theirs.role); err != nil {
		return c.handshakeFailed(err, true)
	}
	c.peer.Role = theirs.role
	c.peer.InstanceID = theirs.instanceID
	c.peer.Devices = theirs.devices
	c.peer.Caps = theirs.caps
	c.peer.Session = theirs.session
	c.desc = c.peer.String()
	if c.cfg.Role == RoleProducer {
		c.window = theirs.credits
	} else {
		c.window = uint64(c.cfg.Credits)
	}
	if admit != nil {
		if err := admit(c); err != nil {
			return c.handshakeFailed(err, true)
		}
	}
	shm := mine.caps&CapShm != 0 && theirs.caps&CapShm != 0 && !c.observing()
	if dialer {
		if err := c.takeShm(shm); err != nil {
			return c.handshakeFailed(err, true)
		}
	} else if err := c.answer(&mine, shm); err != nil {
		return c.handshakeFailed(err, false)
	}
	if !stop() {
		return c.handshakeFailed(ctx.Err(), false)
	}
	if err := c.nc.SetDeadline(time.Time{}); err != nil {
		return c.handshakeFailed(err, false)
	}
	if c.shm != nil {
		// Anything the peer wrote after its hello is on the socket: it
		// can only be doorbells or an error, and is read as such.
		c.sbuf = make([]byte, max(256, c.w-c.r))
		c.sw = copy(c.sbuf, c.rbuf[c.r:c.w])
		c.r, c.w = 0, 0
	}
	if c.observing() {
		return nil // no writer: the observer's exchange is synchronous (observer.go)
	}
	c.writerDone = make(chan struct{})
	go c.writeLoop()
	return nil
}

// answer sends the listener's hello-ack, with a shm segment if shm, or
// on the socket alone if one cannot be made.
func (c *Conn) answer(mine *hello, shm bool) error {
	var seg *shmSeg
	fd := -1
	if shm {
		var err error
		if seg, fd, err = newShmSeg(); err != nil {
			c.cfg.Logger.Warn("transport: no shm channel for this connection; its frames go on the socket", "peer", c.desc, "err", err)
			mine.caps &^= CapShm
		}
	}
	msg := appendHello(nil, mine)
	if seg == nil {
		_, err := c.nc.Write(msg)
		return writeErr(err)
	}
	n, _, err := c.nc.WriteMsgUnix(msg, unix.UnixRights(fd), nil)
	unix.Close(fd)
	if err == nil && n < len(msg) {
		err = fmt.Errorf("hello-ack cut short after %d bytes", n)
	}
	if err != nil {
		seg.unmap()
		return writeErr(err)
	}
	c.shm = seg
	return nil
}

// takeShm maps the segment that came with the hello-ack if both sides
// advertised CapShm. Nothing else may come with it. Without the shm channel,
// descriptors queued are those of the first offer, whose first bytes one
// recvmsg may have read with the hello-ack: they stay queued for it.
func (c *Conn) takeShm(shm bool) error {
	c.askShm = false
	if !shm {
		return nil
	}
	defer func() {
		closeFDs(c.fdq)
		c.fdq = c.fdq[:0]
	}()
	if len(c.fdq) != 1 {
		return malformed("hello-ack with the shm capability and %d descriptors, want 1 (the segment)", len(c.fdq))
	}
	seg, err := openShmSeg(c.fdq[0])
	if err != nil {
		return err
	}
	c.shm = seg
	return nil
}

// readHello reads the peer's hello (listener) or hello-ack (dialer).
func (c *Conn) readHello(ctx context.Context, dialer bool) (*hello, error) {
	want := KindHello
	if dialer {
		want = KindHelloAck
	}
	body, err := c.readFrame(ctx)
	if err != nil {
		return nil, err
	}
	var m Message
	kind, err := c.dec.decode(body, &m)
	switch {
	case err != nil:
		return nil, err
	case kind == KindError:
		return nil, &RemoteError{Code: c.dec.errCode, Message: c.dec.errText, Peer: c.desc}
	case kind != want:
		return nil, fmt.Errorf("%w: %s during the handshake, want %s", ErrUnexpectedMessage, kind, want)
	}
	h := c.dec.hello
	return &h, nil
}

// handshakeFailed tells the peer why if notify and the failure is theirs
// to hear, and returns err wrapped.
func (c *Conn) handshakeFailed(err error, notify bool) error {
	var remote *RemoteError
	if notify && !errors.As(err, &remote) && !errors.Is(err, ErrDisconnected) && !errors.Is(err, os.ErrDeadlineExceeded) {
		c.writeError(codeOf(err), err.Error())
	}
	closeFDs(c.fdq)
	c.fdq = c.fdq[:0]
	return fmt.Errorf("transport: handshake with %s: %w", c.desc, err)
}
