//go:build linux

package share

import (
	"context"
	"io"

	"github.com/seed743c36cf/cudashare/transport"
)

// This file is how the producer reads its consumers' messages: one
// goroutine at a time reads every connection, through one poller
// (internal/transportx), and handles each message where it reads it. The
// reader is whoever holds the exporter's reading token (read_token.go):
//
//   - a producer's wait (Ring.Acquire for a buffer, Offer and Broadcast for
//     credit, Arena.Alloc for room, Buffer.WaitOn), which reads until what
//     it waits for comes: the release that frees a buffer is read and
//     applied by the goroutine that wants the buffer, with no goroutine
//     woken and no thread crossed, however many consumers there are;
//   - or else the exporter's one background reader, once no wait has begun
//     for handoverAfter, so that what must be answered while nobody waits
//     (retires, goodbyes, ends, releases) is.
//
// What ends such a wait otherwise (a Free, a retire, another goroutine's
// notify, Close, a connection that fails) wakes the poller.

// readLoop is the exporter's background reader.
func (e *Exporter) readLoop() {
	defer e.wg.Done()
	e.rd.background(e.done, nil, e.readBackground)
}

// readBackground reads every connection, as the token's holder, until a
// wait wants the token, unless stopped (the exporter is closing), and then
// until every connection has ended, which it reports.
func (e *Exporter) readBackground(stopped bool) (ended bool) {
	seen := e.rd.begun.Load()
	ctx := context.Background()
	for {
		if !stopped && isClosed(e.done) {
			return false // read on as the stopped reader
		}
		e.readAll()
		if stopped && e.readersGone() {
			return true
		}
		if !stopped && e.rd.wanted(seen) {
			return false
		}
		if err := e.poll.Wait(ctx); err != nil {
			e.log.Error("share: waiting for consumers' messages", "err", err)
			return true
		}
		if !stopped && e.rd.wanted(seen) {
			return false
		}
	}
}

// readUntil reads every connection for a producer's wait, as the token's
// holder, until ready (checked after every pass over the connections),
// ctx ends or the exporter closes.
func (e *Exporter) readUntil(ctx context.Context, ready func() bool) {
	for {
		e.readAll()
		if ready() || isClosed(e.done) || ctx.Err() != nil {
			return
		}
		if err := e.poll.Wait(ctx); err != nil {
			if ctx.Err() == nil {
				e.log.Error("share: waiting for consumers' messages", "err", err)
			}
			return
		}
	}
}

// readAll takes in the consumers that connected since the last pass, and
// reads, without waiting, everything each connection has, handling each
// message as it comes. It starts each pass one connection further on, so
// that no consumer's messages always wait for the others'. The token's
// holder only.
func (e *Exporter) readAll() {
	if e.joined.Load() != e.pass.taken {
		e.takeJoined()
	}
	n := len(e.pass.readers)
	if n == 0 {
		return
	}
	if e.pass.n++; e.pass.n%pollEvery == 0 {
		// Busy rings keep the reader from sleeping, and so from epoll's
		// word on the sockets: an error or end on one is looked for here.
		e.poll.Poll()
	}
	e.pass.start++
	if e.pass.start >= n {
		e.pass.start = 0
	}
	for i := 0; i < n; i++ {
		j := e.pass.start + i
		if j >= n {
			j -= n
		}
		if j >= len(e.pass.readers) {
			continue // the list shrank under this pass
		}
		c := e.pass.readers[j]
		for {
			ok, err := connTryRecv(c.conn, &e.pass.msg)
			if !ok && err == nil {
				break
			}
			if err == nil {
				err = e.onMessage(c, &e.pass.msg)
			}
			if err != nil {
				e.stopReading(c)
				c.readEnd(err)
				break
			}
		}
	}
}

// pollEvery is how many passes a busy reader makes between two looks at
// the sockets.
const pollEvery = 64

// takeJoined moves the consumers that connected into the readers' list.
func (e *Exporter) takeJoined() {
	e.mu.Lock()
	joining := e.joining
	e.joining = nil
	e.pass.taken = e.joined.Load()
	e.mu.Unlock()
	for _, c := range joining {
		if err := e.poll.Add(c.conn); err != nil {
			c.readEnd(err)
			continue
		}
		e.pass.readers = append(e.pass.readers, c)
	}
}

// stopReading takes c out of the readers' list.
func (e *Exporter) stopReading(c *consumer) {
	e.poll.Remove(c.conn)
	for i, x := range e.pass.readers {
		if x == c {
			last := len(e.pass.readers) - 1
			e.pass.readers[i] = e.pass.readers[last]
			e.pass.readers[last] = nil
			e.pass.readers = e.pass.readers[:last]
			return
		}
	}
}

// readersGone reports whether every connection has ended and no consumer
// can join any more. The token's holder only.
func (e *Exporter) readersGone() bool {
	if len(e.pass.readers) > 0 {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.closing && len(e.joining) == 0
}

// waitReadingLocked is waitLocked for the producer's own waits (Offer's
// credit, Arena.Alloc's room, Buffer.WaitOn): unless another wait reads
// already, the goroutine waiting reads every connection itself until the
// next notifyLocked, mostly of a release it reads. It saves the hop from a
// reader to the waiter, as Ring.Acquire does, and allocates no channel.
// Like waitLocked it may return with nothing changed: its callers look
// again. Never called by the reader itself (from onMessage). mu held on
// entry and on return.
func (e *Exporter) waitReadingLocked(ctx context.Context, ch *chan struct{}) error {
	if !e.reading.CompareAndSwap(false, true) {
		return e.waitLocked(ctx, ch)
	}
	seen := e.notified.Load()
	e.mu.Unlock()
	err := e.awaitReading(ctx, seen)
	e.mu.Lock()
	return err
}

// awaitReading waits for a notifyLocked after seen, reading every
// connection; e.reading is set on entry, cleared on return.
func (e *Exporter) awaitReading(ctx context.Context, seen uint64) error {
	defer e.reading.Store(false)
	e.rd.begin()
	defer e.rd.end()
	notified := func() bool { return e.notified.Load() != seen }
	// The token, if free, without a select of every case: this runs once
	// per handoff. Else the background reader holds it until it sees this
	// wait (begin woke it).
	select {
	case <-e.rd.tok:
	default:
		select {
		case <-e.rd.tok:
		case <-ctx.Done():
			return ctx.Err()
		case <-e.done:
			return ErrClosed
		}
	}
	if !notified() {
		e.readUntil(ctx, notified)
	}
	e.rd.give()
	if isClosed(e.done) {
		return ErrClosed
	}
	return ctx.Err()
}

// onMessage handles one message of c's. A goodbye ends the reading with
// io.EOF; a message that breaks the protocol drops c (its connection's
// next receive fails).
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
	close(c.done)
	c.e.onGone(c, err)
}

// wakeReaderLocked wakes the reader, whoever it is, so that it looks at
// what it waits for again. Whatever may end such a wait calls it: a buffer
// back in a ring's free list, a waiter notified (notifyLocked), a ring
// retired, the exporter closing. It costs two atomic operations unless the
// reader sleeps. mu held.
func (e *Exporter) wakeReaderLocked() { e.poll.Wake() }
