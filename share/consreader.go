//go:build linux

package share

import (
	"context"
	"errors"
	"io"

	"github.com/seed743c36cf/cudashare/transport"
)

// This file is who reads a consumer's messages on the producer's side: the
// producer's goroutine, while it waits in Ring.Acquire (for a buffer),
// Arena.Alloc (for room), Offer (for credit) or Buffer.WaitOn, and the
// consumer is the only one connected; or else the connection's background
// reader (handover.go). What ends such a wait otherwise (another
// consumer's release, a Free, a retire, Close) interrupts its receive
// (wakeReaderLocked).

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

// readUntil reads c's connection for a producer's wait, as the token's
// holder, until ready (checked before every receive), ctx ends, the
// exporter closes (false) or the connection ends (true). Whatever makes
// ready true otherwise interrupts the receive (wakeReaderLocked).
func (e *Exporter) readUntil(ctx context.Context, c *consumer, ready func() bool) (ended bool) {
	for !c.readDone {
		if ready() || isClosed(e.done) {
			return false
		}
		err := c.conn.Recv(ctx, &c.msg)
		if err != nil {
			if errors.Is(err, transport.ErrInterrupted) {
				continue // something came free otherwise, or the exporter ended: look
			}
			if ctxEnded(ctx, err) {
				return false
			}
		} else {
			err = e.onMessage(c, &c.msg)
		}
		if err != nil {
			c.readEnd(err)
			break
		}
	}
	return true
}

// waitReadingLocked is waitLocked for the producer's own waits (Offer's
// credit, Arena.Alloc's room, Buffer.WaitOn): while the producer has one
// consumer, and no other wait reads its connection, the goroutine waiting
// reads it itself until the next notifyLocked, mostly of the release it
// reads. It saves the hop from the connection's reader to the waiter, as
// Ring.Acquire does, and allocates no channel. Like waitLocked it may
// return with nothing changed: its callers look again. Never called by a
// connection's reader. mu held on entry and on return.
func (e *Exporter) waitReadingLocked(ctx context.Context, ch *chan struct{}) error {
	c := e.sole.Load()
	if c == nil || !e.reading.CompareAndSwap(nil, c) {
		return e.waitLocked(ctx, ch)
	}
	seen := e.notified.Load()
	e.mu.Unlock()
	err := e.awaitReading(ctx, c, seen)
	e.mu.Lock()
	return err
}

// awaitReading waits for a notifyLocked after seen, reading c's
// connection; e.reading is c on entry, nil on return. The end of c's
// connection ends it too: c is no longer the sole consumer then, and the
// caller's next wait is on a channel.
func (e *Exporter) awaitReading(ctx context.Context, c *consumer, seen uint64) error {
	defer e.reading.CompareAndSwap(c, nil)
	c.rd.begin()
	defer c.rd.end()
	notified := func() bool { return e.notified.Load() != seen }
	// The token, if free, without a select of every case: this runs once
	// per handoff. Else the background reader holds it until it sees this
	// wait (begin interrupted its receive).
	select {
	case <-c.rd.tok:
	default:
		select {
		case <-c.rd.tok:
		case <-ctx.Done():
			return ctx.Err()
		case <-e.done:
			return ErrClosed
		}
	}
	e.readUntil(ctx, c, notified)
	c.rd.give()
	if isClosed(e.done) {
		return ErrClosed
	}
	return ctx.Err()
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
		c.byeReason = m.Reason
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

// wakeReaderLocked interrupts the producer's wait that reads a consumer's
// connection, if any, unless the caller handles a message of that very
// consumer (the reader itself: it looks for what it waits for next).
// Whatever may end such a wait calls it: a buffer back in a ring's free
// list, a waiter notified (notifyLocked), a ring retired, the exporter
// closing. mu held.
func (e *Exporter) wakeReaderLocked() {
	if c := e.reading.Load(); c != nil && c != e.handling {
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
	e.wakeReaderLocked()
}
