//go:build linux

package share

import (
	"context"
	"errors"
	"io"

	"github.com/seed743c36cf/cudashare/transport"
)

// This file is who reads a consumer's messages on the producer's side: a
// goroutine in Ring.Acquire, while it waits for a buffer and the consumer
// is the only one connected, or the connection's background reader
// (handover.go). A buffer that comes free otherwise (another consumer's
// release, a Free, a retire, Close) interrupts a reading Acquire
// (wakeAcquireLocked).

// readLoop is c's background reader.
func (c *consumer) readLoop() {
	defer c.e.wg.Done()
	c.rd.background(c.e.done, c.done, c.readBackground)
}

// readBackground reads c's connection, as the token's holder, until a
// wait wants it, unless stopped, and then until the connection ends,
// which it reports.
func (c *consumer) readBackground(stopped bool) (ended bool) {
	seen := c.rd.begun.Load()
	for !c.readDone {
		err := c.conn.Recv(context.Background(), &c.msg)
		if errors.Is(err, transport.ErrInterrupted) {
			if !stopped && c.rd.wanted(seen) {
				return false // an Acquire wants the connection
			}
			continue
		}
		if err == nil {
			err = c.e.onMessage(c, &c.msg)
		}
		if err != nil {
			c.readEnd(err)
			break
		}
		if !stopped && c.rd.wanted(seen) {
			return false
		}
	}
	return true
}

// readFor reads c's connection for a goroutine in r's Acquire, as the
// token's holder, until a buffer comes free in r, which it returns, or ctx
// ends, r is retired, the exporter closes or the connection ends.
func (r *Ring) readFor(ctx context.Context, c *consumer) (*Buffer, bool) {
	e := r.e
	for !c.readDone {
		// One-case selects with a default, and the length, do not lock a
		// channel that is empty and open: this runs once per handoff.
		if len(r.free) > 0 {
			select {
			case b := <-r.free:
				return b, false
			default:
			}
		}
		if isClosed(r.dead) || isClosed(e.done) {
			return nil, false
		}
		err := c.conn.Recv(ctx, &c.msg)
		if err != nil {
			if errors.Is(err, transport.ErrInterrupted) {
				continue // a buffer came free otherwise, or the ring or exporter ended: look
			}
			if ctxEnded(ctx, err) {
				return nil, false
			}
		} else {
			err = e.onMessage(c, &c.msg)
		}
		if err != nil {
			c.readEnd(err)
			break
		}
	}
	return nil, true
}

// onMessage handles one message of c's. A goodbye ends the reading with
// io.EOF; a message that breaks the protocol drops c (its connection's
// next Recv fails).
func (e *Exporter) onMessage(c *consumer, m *transport.Message) error {
	var bad error
	switch m.Kind {
	case transport.KindRelease:
		var after *consEvent
		if m.HasReleaseEvent {
			after, bad = e.consumerEvent(c, m.ReleaseEvent)
		}
		if bad == nil {
			bad = e.onRelease(c, m.Seqs, after)
		}
	case transport.KindClosed:
		bad = e.onClosed(c, m.AllocID)
	case transport.KindCredit:
		e.mu.Lock()
		c.window += uint64(m.Credits)
		e.notifyLocked(&e.creditWait)
		e.mu.Unlock()
	case transport.KindGoodbye:
		e.mu.Lock()
		c.saidBye = true
		e.deactivateLocked(c)
		e.mu.Unlock()
		return io.EOF // nothing comes after it
	}
	if bad != nil {
		e.kick(c, bad)
	}
	return nil
}

// readEnd ends the reading of c's connection, once.
func (c *consumer) readEnd(err error) {
	c.readDone = true
	close(c.done)
	c.e.onGone(c, err)
}

// wakeAcquireLocked interrupts the Acquire that reads a consumer's
// connection, if any, unless the caller handles a message of that very
// consumer (the reader itself: it looks for its buffer next). Whatever
// may end an Acquire's wait calls it: a buffer back in a ring's free list,
// a ring retired, the exporter closing. mu held.
func (e *Exporter) wakeAcquireLocked() {
	if c := e.acquiring.Load(); c != nil && c != e.handling {
		c.conn.Interrupt()
	}
}

// soleLocked keeps sole up to date with consumers. mu held.
func (e *Exporter) soleLocked() {
	var c *consumer
	if len(e.consumers) == 1 {
		c = e.consumers[0]
	}
	e.sole.Store(c)
}

// putFreeLocked puts b in r's free list. mu held.
func (e *Exporter) putFreeLocked(r *Ring, b *Buffer) {
	r.free <- b // never blocks: the ring has room for all its buffers
	e.wakeAcquireLocked()
}
