//go:build linux

package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"time"
)

// This file is the observer role (PROTOCOL.md, section 9): a process of
// the producer's user, such as `cudashare top`, that connects to the
// producer's socket to read snapshots of its state. An observer never
// counts as a consumer: it takes no credit and gets no offers. The
// listener serves it on a goroutine of its own, off the producer's
// paths, and bounds what it can cost.

// RoleObserver is the role of a side that only reads a producer's
// snapshots.
const RoleObserver Role = 3

// Observer message kinds (PROTOCOL.md, section 9).
const (
	KindSnapshotRequest Kind = 16 // observer -> producer: [16]
	KindSnapshot        Kind = 17 // producer -> observer: [17, snapshot]
)

// Observer limits, enforced by the listener.
const (
	// MaxObservers is how many observers a listener serves at once; one
	// more is refused (code 12, limit).
	MaxObservers = 4
	// MaxSnapshotSize caps a snapshot's encoded size: the producer
	// trims one to fit, and an observer refuses a longer frame.
	MaxSnapshotSize = 4 << 20
	// ObserverInterval is the least time between two snapshots served to
	// one observer: requests that come faster wait (unread, in the
	// socket), so a flood costs the producer no more than a polite
	// observer at 20 Hz.
	ObserverInterval = 50 * time.Millisecond
	// ObserverIdleTimeout ends an observer that asks nothing for so long,
	// so that silent observers cannot hold every place.
	ObserverIdleTimeout = time.Minute
	// observerWriteTimeout drops an observer that does not read its
	// snapshot: the write of one never waits longer.
	observerWriteTimeout = time.Second
	// maxRequestSize: a request is [16], two bytes; a little room for
	// extra elements (PROTOCOL.md 2.1).
	maxRequestSize = 64
)

// ServeObservers makes the listener answer observers (RoleObserver) with
// what snapshot returns: one msgpack value (a map), called on the
// observer's goroutine for each request. Until it is called, observers
// are refused (code 9, not_supported).
func (l *Listener) ServeObservers(snapshot func() []byte) {
	l.observe.Store(&snapshot)
}

// observing reports whether c is an observer's connection, on either side.
func (c *Conn) observing() bool {
	return c.cfg.Role == RoleObserver || c.peer.Role == RoleObserver
}

// checkRoles refuses a pair of roles that cannot talk: an observer talks
// only to a producer.
func checkRoles(mine, theirs Role) error {
	other := theirs
	if theirs == RoleObserver {
		other = mine
	}
	if (mine == RoleObserver || theirs == RoleObserver) && other != RoleProducer {
		return fmt.Errorf("%w: an observer talks to producers only, not to a %s", ErrHandshake, other)
	}
	return nil
}

// admitObserver counts an observer against MaxObservers, or refuses it:
// too many, no snapshots served, or not this process's user (a snapshot
// names every consumer; Config.AllowedUIDs, which admits consumers of
// other users, does not extend to observers).
func (l *Listener) admitObserver(c *Conn) error {
	if c.peer.Role != RoleObserver {
		return nil
	}
	if l.observe.Load() == nil {
		return fmt.Errorf("%w: this producer serves no snapshots", ErrNotSupported)
	}
	if euid := uint32(os.Geteuid()); c.peer.UID != euid {
		return fmt.Errorf("%w: observers must be the producer's user (uid %d), not uid %d", ErrPeerRefused, euid, c.peer.UID)
	}
	if n := l.observers.Add(1); n > MaxObservers {
		l.observers.Add(-1)
		return fmt.Errorf("%w: %d observers at listener %s: limit MaxObservers=%d", ErrLimit, n-1, l.path, MaxObservers)
	}
	// Its place is given back when the connection closes, whether or not
	// the handshake completes.
	prev := c.onClose
	c.onClose = func() {
		l.observers.Add(-1)
		if prev != nil {
			prev()
		}
	}
	return nil
}

// serveObserver answers c's snapshot requests until it leaves, breaks
// the rules, idles past ObserverIdleTimeout, does not read a snapshot
// within a second, or the listener closes. It reads the socket itself:
// an observer's connection has no writer goroutine and no shm channel.
func (l *Listener) serveObserver(c *Conn) {
	defer l.wg.Done()
	defer c.Close()
	stop := context.AfterFunc(l.ctx, func() { c.nc.SetDeadline(longAgo) })
	defer stop()
	// What the handshake read past the hello is the start of a request.
	r := io.MultiReader(bytes.NewReader(bytes.Clone(c.rbuf[c.r:c.w])), c.nc)
	var hdr [headerSize]byte
	var body [maxRequestSize]byte
	var last time.Time
	for {
		c.nc.SetReadDeadline(time.Now().Add(ObserverIdleTimeout))
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[:])
		if n < 2 || n > maxRequestSize {
			c.writeError(codeMalformed, fmt.Sprintf("a request of %d bytes from an observer (2..%d)", n, maxRequestSize))
			return
		}
		if _, err := io.ReadFull(r, body[:n]); err != nil {
			return
		}
		if body[0] < 0x91 || body[0] > 0x9f || body[1] != byte(KindSnapshotRequest) {
			c.writeError(codeUnexpected, "an observer may only send snapshot-request")
			return
		}
		if wait := ObserverInterval - time.Since(last); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-t.C:
			case <-l.ctx.Done():
				t.Stop()
				return
			}
		}
		last = time.Now()
		snap := (*l.observe.Load())()
		if len(snap) > MaxSnapshotSize {
			c.writeError(codeLimit, fmt.Sprintf("a snapshot of %d bytes: limit MaxSnapshotSize=%d", len(snap), MaxSnapshotSize))
			return
		}
		frame := make([]byte, headerSize, headerSize+2+len(snap))
		binary.BigEndian.PutUint32(frame, uint32(2+len(snap)))
		frame = append(frame, 0x92, byte(KindSnapshot))
		frame = append(frame, snap...)
		c.nc.SetWriteDeadline(time.Now().Add(observerWriteTimeout))
		if _, err := c.nc.Write(frame); err != nil {
			return
		}
	}
}

// Observer is an observer's connection to a producer.
type Observer struct {
	c   *Conn
	buf []byte
}

// DialObserver connects to the producer listening at path as an observer.
// Only cfg.AllowedUIDs (the producer's user must be among them), Logger
// and HandshakeTimeout matter; Role is set to RoleObserver.
func DialObserver(ctx context.Context, path string, cfg Config) (*Observer, error) {
	cfg.Role = RoleObserver
	cfg.Credits = 0
	cfg.DisableShm = true
	cfg.Devices = nil
	c, err := Dial(ctx, path, cfg)
	if err != nil {
		return nil, err
	}
	return &Observer{c: c}, nil
}

// Snapshot asks for a snapshot and returns it: one msgpack value, valid
// until the next call. A producer that refused or dropped the observer
// gives a *RemoteError (errors.Is with its sentinel).
func (o *Observer) Snapshot(ctx context.Context) ([]byte, error) {
	if err := o.c.Err(); err != nil {
		return nil, err
	}
	nc := o.c.nc
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Time{}
	}
	nc.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { nc.SetDeadline(longAgo) })
	defer stop()
	if _, err := nc.Write([]byte{0, 0, 0, 2, 0x91, byte(KindSnapshotRequest)}); err != nil {
		return nil, o.failed(ctx, err)
	}
	r := io.MultiReader(bytes.NewReader(o.c.rbuf[o.c.r:o.c.w]), nc)
	o.c.r = o.c.w
	var hdr [headerSize]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, o.failed(ctx, err)
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n < 2 || n > MaxSnapshotSize+2 {
		return nil, o.fail(fmt.Errorf("%w: length %d, cap %d", ErrFrameTooLarge, n, MaxSnapshotSize+2))
	}
	if cap(o.buf) < int(n) {
		o.buf = make([]byte, n)
	}
	body := o.buf[:n]
	if _, err := io.ReadFull(r, body); err != nil {
		return nil, o.failed(ctx, err)
	}
	if body[0] == 0x92 && body[1] == byte(KindSnapshot) {
		return body[2:], nil
	}
	var m Message
	kind, err := o.c.dec.decode(body, &m)
	switch {
	case err != nil:
		return nil, o.fail(err)
	case kind == KindError:
		return nil, o.fail(&RemoteError{Code: o.c.dec.errCode, Message: o.c.dec.errText, Peer: o.c.desc})
	}
	return nil, o.fail(fmt.Errorf("%w: %s, want snapshot", ErrUnexpectedMessage, kind))
}

func (o *Observer) failed(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		err = ctx.Err()
	} else if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		err = fmt.Errorf("%w: %w", ErrDisconnected, err)
	}
	return o.fail(err)
}

func (o *Observer) fail(err error) error {
	o.c.fail(err, false)
	return fmt.Errorf("transport: observe %s: %w", o.c.desc, err)
}

// Close closes the connection. It is idempotent and returns nil.
func (o *Observer) Close() error { return o.c.Close() }
