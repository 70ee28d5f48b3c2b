//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// OfferOptions go with an offer.
type OfferOptions struct {
	// Meta is small user metadata (shape, dtype, ...): one msgpack value
	// of at most transport.MaxMetaSize bytes, or nil. It is copied.
	Meta []byte
	// Stream, if not nil, is the stream whose work wrote the buffer: the
	// buffer's interprocess event is recorded on it, and the consumer's
	// stream waits for that event instead of the host synchronizing.
	// Offers of one buffer that are in flight together must use the same
	// stream. The writes must be ordered before the record: made on this
	// stream, or on the legacy NULL stream when this stream is a blocking
	// one (a non-blocking stream does not wait for NULL-stream work, and a
	// synchronous cuMemcpyHtoD from pageable memory may return before its
	// DMA lands). Nil: the buffer must be complete on the device when Offer
	// is called (synchronize first), and no event travels (and no event
	// call is made).
	Stream *driver.Stream
}

// Offer gives b to one consumer as a lease: the next, in round-robin order, that has
// a credit; it waits within ctx while none has. This is work distribution:
// each buffer goes to one consumer.
//
// The consumer holds the lease until it releases it; b.Wait, a Ring or an
// arena buffer's Free tell the producer when that is. The producer must
// not write b while it is leased. b must be a buffer of e: another
// exporter's gives ErrForeignBuffer.
func (e *Exporter) Offer(ctx context.Context, b *Buffer, opts OfferOptions) error {
	if err := ctx.Err(); err != nil {
		return err // a loop bounded by its context must end even when credit is free
	}
	if err := e.own(b); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for {
		if err := e.offerReadyLocked(b); err != nil {
			return err
		}
		c := e.pickLocked()
		if c == nil {
			if err := e.waitReadingLocked(ctx, &e.creditWait); err != nil {
				return err
			}
			continue
		}
		// A consumer whose connection failed under the send is dropped
		// (offerToLocked): the buffer goes to another consumer; one
		// consumer's end never fails the producer's Offer.
		if offered, err := e.offerToLocked(ctx, c, b, &opts, true); offered || err != nil {
			return err
		}
	}
}

// offerToLocked offers b to c, which the caller chose: it checks that b can
// be offered, reserves a credit of c and a lease slot, sends the offer
// (recording b's event first if record is set) and ends the reservation.
// It reports whether the offer went out. When c's connection failed under
// the send (it went away, or stopped reading), c is deactivated (its
// connection's reader drops it) and offerToLocked reports neither offered nor an
// error: the caller passes b to another consumer, or skips c. mu held; it
// is released during the send.
func (e *Exporter) offerToLocked(ctx context.Context, c *consumer, b *Buffer, opts *OfferOptions, record bool) (bool, error) {
	if err := e.offerReadyLocked(b); err != nil {
		return false, err
	}
	seq, gen, m := e.reserveLocked(c, b)
	ev := b.ev
	e.mu.Unlock()
	if testHookBeforeSend != nil {
		testHookBeforeSend(c)
	}
	onConn, err := e.send(ctx, c, b, m, seq, gen, ev, opts, record)
	if testHookAfterSend != nil {
		testHookAfterSend(c)
	}
	e.mu.Lock()
	e.finishLocked(c, b, seq, err)
	return e.settleLocked(ctx, c, onConn, err)
}

// settleLocked tells what a send of an offer to c that ended with err
// means: offered (err is nil), the caller's error, or c's connection failed
// under the send (c is then deactivated, and neither is reported: the
// caller passes the buffer to another consumer, or skips c). mu held.
func (e *Exporter) settleLocked(ctx context.Context, c *consumer, onConn bool, err error) (bool, error) {
	switch {
	case err == nil:
		return true, nil
	case !onConn:
		return false, err
	case ctx.Err() != nil:
		// The caller's context ended: that, not what the connection
		// did meanwhile, is why this Offer ends.
		return false, ctx.Err()
	case !connectionFailed(err) && !errors.Is(err, c.conn.Err()):
		// This offer could not be sent (an invalid one): the caller's
		// error, even if the connection also fails meanwhile. (A send
		// that waited on a failed connection returns its failure.)
		return false, err
	}
	// The connection failed under the send, whatever the error says: the
	// consumer went away, or the exporter dropped it meanwhile (a lease
	// held too long, a protocol error: the send then returns that reason).
	// One consumer's end never fails the producer's Offer: pick another.
	e.deactivateLocked(c)
	return false, nil
}

// Test hooks: run in offerToLocked with mu unlocked, around the send, so that
// a test can lose the consumer there (nil outside tests).
var testHookBeforeSend, testHookAfterSend func(c *consumer)

// connectionFailed reports whether err, from a consumer's connection,
// means that the connection failed or was closed (the consumer went away,
// stopped reading or was dropped), rather than that this offer could not
// be sent on it.
func connectionFailed(err error) bool {
	return errors.Is(err, transport.ErrClosed) || errors.Is(err, transport.ErrDisconnected) ||
		errors.Is(err, transport.ErrWriteTimeout) || errors.Is(err, transport.ErrRemote)
}

// Broadcast offers b to every consumer that keeps up, and returns how many
// it reached. It waits within ctx while no consumer can take b at all. A
// consumer that cannot take b now (at its credits or MaxLeasesPerConsumer,
// or, while other consumers are connected, holding half or more of b's
// ring, or of b's arena's bytes, so that it never pins a whole ring) is
// given up to BroadcastGrace to make room; if it does not, it misses b and
// is lagging: later broadcasts skip it without waiting until it has room
// again. What it misses is not queued for later (Stats.BroadcastMissed
// counts misses). So a stalled consumer costs the others one grace period,
// and its backlog is bounded. A consumer that goes away meanwhile is
// skipped. The event, if any, is recorded once.
func (e *Exporter) Broadcast(ctx context.Context, b *Buffer, opts OfferOptions) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	if err := e.own(b); err != nil {
		return 0, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for {
		if err := e.offerReadyLocked(b); err != nil {
			return 0, err
		}
		if slices.ContainsFunc(e.policy.consumers, func(c *consumer) bool { return e.takesLocked(c, b) }) {
			break
		}
		// Credit, a new consumer and a lost one all wake creditWait.
		if err := e.waitReadingLocked(ctx, &e.creditWait); err != nil {
			return 0, err
		}
	}
	// Pin b: a consumer that releases quickly must not return it to its
	// ring (or free it) while the broadcast is still going.
	b.sending++
	b.rec.sending++
	defer e.unpinLocked(b) // runs before the deferred Unlock

	// A consumer lost meanwhile may abandon b (its allocation is then
	// replaced and retired): that ends the broadcast, not as the
	// producer's error.
	wasAbandoned := b.abandoned
	sc := broadcastScratch.Get().(*broadcastPass)
	defer sc.put()

	// First every consumer that can take b now, in one pass: their offers
	// reserved under one hold of mu, sent without it, settled under one
	// more. The cost per consumer reached is then the send's own, not a
	// lock and an unlock of the exporter each (a broadcast to many is
	// bound by the producer's CPU).
	for _, c := range e.policy.consumers {
		switch {
		case e.takesLocked(c, b):
			c.lagging = false
			seq, gen, m := e.reserveLocked(c, b)
			sc.now = append(sc.now, broadcastOffer{c: c, seq: seq, gen: gen, m: m})
		case c.lagging:
			e.stats.BroadcastMissed++
			c.obs.broadcastMissed++
		default:
			sc.later = append(sc.later, c) // given the grace below
		}
	}
	n, err := e.sendAllLocked(ctx, b, &opts, sc.now)
	if err != nil || b.abandoned && !wasAbandoned {
		return n, err
	}

	// Then those at their limit, one at a time, each given up to the
	// broadcast's grace to make room.
	record := n == 0
	var deadline time.Time // of the grace, from the first wait
	for _, c := range sc.later {
		if err := e.offerReadyLocked(b); err != nil {
			if b.abandoned && !wasAbandoned {
				return n, nil
			}
			return n, err
		}
		take, err := e.roomLocked(ctx, c, b, &deadline)
		if err != nil {
			if b.abandoned && !wasAbandoned && ctx.Err() == nil {
				return n, nil
			}
			return n, err
		}
		if !take {
			continue
		}
		// A consumer whose connection failed under the send is going
		// away: offerToLocked drops it, and it is skipped.
		offered, err := e.offerToLocked(ctx, c, b, &opts, record)
		if err != nil {
			return n, err
		}
		if offered {
			n++
			record = false
		}
	}
	return n, nil
}

// broadcastOffer is one reserved offer of a broadcast's first pass.
type broadcastOffer struct {
	c        *consumer
	seq, gen uint64
	m        *mapping
	onConn   bool
	err      error
}

// broadcastPass is a broadcast's scratch, reused so that a broadcast
// allocates nothing.
type broadcastPass struct {
	now   []broadcastOffer
	later []*consumer
}

var broadcastScratch = sync.Pool{New: func() any { return new(broadcastPass) }}

// put clears p (it must not keep consumers alive) and returns it to the pool.
func (p *broadcastPass) put() {
	clear(p.now)
	clear(p.later)
	p.now, p.later = p.now[:0], p.later[:0]
	broadcastScratch.Put(p)
}

// sendAllLocked sends the reserved offers of b, with mu released, the
// event recorded once (by the first send), and settles every one: it
// returns how many went out, and the first error that is the producer's
// (a consumer whose connection failed under its send is dropped and
// skipped, as offerToLocked does). mu held on entry and on return.
func (e *Exporter) sendAllLocked(ctx context.Context, b *Buffer, opts *OfferOptions, offers []broadcastOffer) (int, error) {
	if len(offers) == 0 {
		return 0, nil
	}
	ev := b.ev
	e.mu.Unlock()
	record := true
	var stop error // a failure of the offer itself: no more are sent
	for i := range offers {
		o := &offers[i]
		if stop != nil {
			o.err = stop
			continue
		}
		if testHookBeforeSend != nil {
			testHookBeforeSend(o.c)
		}
		o.onConn, o.err = e.send(ctx, o.c, b, o.m, o.seq, o.gen, ev, opts, record)
		if testHookAfterSend != nil {
			testHookAfterSend(o.c)
		}
		switch {
		case o.err == nil:
			record = false
		case !o.onConn:
			stop = o.err
		}
	}
	e.mu.Lock()
	n := 0
	var first error
	for i := range offers {
		o := &offers[i]
		e.finishLocked(o.c, b, o.seq, o.err)
		offered, err := e.settleLocked(ctx, o.c, o.onConn, o.err)
		if offered {
			n++
		}
		if err != nil && first == nil {
			first = err
		}
	}
	return n, first
}

// BroadcastGrace is how long Broadcast waits for a consumer that keeps up
// to make room for a buffer before it misses it.
const BroadcastGrace = time.Second

// roomLocked waits, within ctx and the broadcast's grace, for c to be able
// to take b, and reports whether it can; one that cannot misses b and is
// lagging. The grace starts at the first wait of the broadcast. mu held.
func (e *Exporter) roomLocked(ctx context.Context, c *consumer, b *Buffer, deadline *time.Time) (bool, error) {
	for {
		if err := e.offerableLocked(b); err != nil {
			return false, err
		}
		switch {
		case !c.active:
			return false, nil
		case e.takesLocked(c, b):
			c.lagging = false
			return true, nil
		case c.lagging:
			e.stats.BroadcastMissed++
			c.obs.broadcastMissed++
			return false, nil
		}
		if deadline.IsZero() {
			*deadline = time.Now().Add(BroadcastGrace)
		}
		wctx, cancel := context.WithDeadline(ctx, *deadline)
		err := e.waitReadingLocked(wctx, &e.creditWait)
		cancel()
		switch {
		case ctx.Err() != nil:
			return false, ctx.Err()
		case err != nil && !errors.Is(err, context.DeadlineExceeded):
			return false, err
		case err != nil:
			c.lagging = true
			e.log.Warn("share: a consumer lags behind the broadcast; it misses buffers until it has room again",
				"peer", c.peer.String(), "leases", c.out)
		}
	}
}

// own checks that b is a buffer of e.
func (e *Exporter) own(b *Buffer) error {
	if b == nil || b.e != e {
		return ErrForeignBuffer
	}
	return nil
}

// offerReadyLocked says why b cannot be offered now, if it cannot. mu held.
func (e *Exporter) offerReadyLocked(b *Buffer) error {
	if b.ring != nil && !b.held {
		// Back in its ring: the next Acquire may hand it out to be
		// rewritten while this lease would be read.
		return fmt.Errorf("%w: ring buffer at offset %d of allocation %d went back to its ring; Acquire it again", ErrNotHeld, b.off, b.rec.id)
	}
	return e.offerableLocked(b)
}

// offerableLocked says why b cannot be offered, if it cannot. mu held.
func (e *Exporter) offerableLocked(b *Buffer) error {
	switch {
	case e.closing:
		return ErrClosed
	case b.freed || b.freePending:
		return ErrFreed
	case b.rec.state != recLive:
		return fmt.Errorf("%w: allocation %d", ErrRetired, b.rec.id)
	}
	return nil
}

// reserveLocked takes a credit of c and a lease slot for b.
func (e *Exporter) reserveLocked(c *consumer, b *Buffer) (seq, gen uint64, _ *mapping) {
	var idx uint32
	if n := len(c.freeSlots); n > 0 {
		idx = c.freeSlots[n-1]
		c.freeSlots = c.freeSlots[:n-1]
	} else {
		idx = uint32(len(c.slots))
		c.slots = append(c.slots, leaseSlot{})
	}
	s := &c.slots[idx]
	s.gen++
	s.b = b
	s.sent = false
	s.epoch = e.clock.epoch
	s.at, s.warned = e.obs.now(), false
	c.addOut(1)
	b.leases++
	b.sending++
	b.rec.offers++
	b.rec.sending++
	e.stats.Leases++
	m := c.allocs[b.rec]
	if m == nil {
		m = &mapping{}
		c.allocs[b.rec] = m
		b.rec.mappers[c] = struct{}{}
	}
	m.leases++
	m.bytes += b.size
	if r := b.rec.ring; r != nil {
		c.ringLeases[r]++
	}
	return uint64(s.gen)<<32 | uint64(idx), b.rec.offers, m
}

// send records the event if asked, and queues the offer. onConn reports
// that err is the consumer's connection's, not one of preparing the offer
// (a driver call): "closed" is one value in every layer, so the error
// alone cannot tell a consumer's closed connection from a closed driver
// context.
func (e *Exporter) send(ctx context.Context, c *consumer, b *Buffer, m *mapping, seq, gen uint64, ev *expEvent, opts *OfferOptions, record bool) (onConn bool, err error) {
	if opts.Stream != nil {
		if ev == nil {
			if ev, err = e.bufferEvent(b); err != nil {
				return false, err
			}
		}
		if record {
			if err := ev.ev.Record(opts.Stream); err != nil {
				return false, fmt.Errorf("share: record the buffer's event: %w", err)
			}
		}
	}
	rec := b.rec
	o := transport.Offer{
		Seq: seq, AllocID: rec.id, Generation: gen, Handle: rec.handle, HandleKind: rec.kind,
		AllocSize: rec.size, Offset: b.off, Size: b.size, Device: e.dev, Meta: opts.Meta,
	}
	if ev != nil && opts.Stream != nil {
		if c.noEvents {
			// It may not open our event: wait for it here instead.
			if err := ev.ev.Synchronize(); err != nil {
				return false, fmt.Errorf("share: wait for the buffer's event: %w", err)
			}
		} else {
			o.Event, o.HasEvent = ev.h, true
		}
	}
	if rec.kind != transport.HandleVMM {
		return true, c.conn.SendOffer(ctx, &o)
	}
	return e.sendFD(ctx, c, rec, &o, m)
}

// finishLocked ends a reservation: on success the offer is out; on error
// it was not queued and the lease is undone.
func (e *Exporter) finishLocked(c *consumer, b *Buffer, seq uint64, err error) {
	if err == nil {
		e.stats.Offers++
		e.stats.BytesOffered += b.size
		c.obs.offers++
		c.obs.bytesOffered += b.size
		if b.ring != nil && b.held {
			b.offered = true
		}
	}
	if i := slices.IndexFunc(c.voided, func(v voidedOffer) bool { return v.seq == seq }); i >= 0 {
		// The consumer was lost or dropped while this offer was being
		// sent, and that voided the lease without ending it: it ends
		// here. (The consumer may have released it before: then it
		// ended then.)
		v := c.voided[i]
		c.voided = slices.Delete(c.voided, i, i+1)
		if err == nil {
			e.stats.Releases++
		}
		if v.vmm {
			// A lost consumer may read a VMM buffer whose offer was
			// queued to it (it may have left before the connection
			// closed): never written again. One whose send failed it
			// never saw.
			if err == nil {
				e.abandonForLocked(c, b)
			}
			e.unleaseLocked(b)
			// Kept only because this offer might abandon b to it
			// (onGone): if it did not, and nothing else holds it, forget it.
			if err != nil && c.ended && !c.dropped && c.abandoned == 0 && !c.holdsLocked() && e.life.Err() == nil &&
				!slices.ContainsFunc(c.voided, func(v voidedOffer) bool { return v.vmm }) {
				e.dropLocked(c)
			}
		}
	} else if err == nil {
		if !c.dropped {
			// (A dropped consumer has no slots left: its drop voided this.)
			if s := &c.slots[uint32(seq)]; s.b == b && s.gen == uint32(seq>>32) {
				s.sent = true
			}
		}
	} else if !c.dropped {
		idx := uint32(seq)
		if s := &c.slots[idx]; s.b == b && s.gen == uint32(seq>>32) {
			s.b = nil
			c.freeSlots = append(c.freeSlots, idx)
			c.addOut(-1)
			b.leases--
			e.stats.Leases--
			e.unmapLeaseLocked(c, b)
			e.notifyLocked(&e.creditWait)
		}
	}
	e.unpinLocked(b)
}

// unpinLocked ends one in-flight send of b.
func (e *Exporter) unpinLocked(b *Buffer) {
	b.sending--
	if b.rec.sending--; b.rec.sending == 0 && b.rec.state != recLive {
		e.notifyLocked(&e.changed)
	}
	if b.leases == 0 && b.sending == 0 {
		e.idleLocked(b)
	}
}

// bufferEvent returns b's interprocess event, taking one from the pool or
// creating one on first use.
func (e *Exporter) bufferEvent(b *Buffer) (*expEvent, error) {
	e.mu.Lock()
	if ev := b.ev; ev != nil {
		e.mu.Unlock()
		return ev, nil
	}
	var ev *expEvent
	if n := len(e.eventPool); n > 0 {
		ev = e.eventPool[n-1]
		e.eventPool = e.eventPool[:n-1]
	}
	e.mu.Unlock()
	if ev == nil {
		dev, err := e.dctx.NewEvent(driver.EventInterprocess | driver.EventDisableTiming)
		if err != nil {
			return nil, fmt.Errorf("share: create an interprocess event: %w", err)
		}
		h, err := dev.IpcHandle()
		if err != nil {
			dev.Close()
			return nil, fmt.Errorf("share: interprocess event handle: %w", err)
		}
		ev = &expEvent{ev: dev, h: transport.Handle(h)}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if b.ev != nil {
		e.eventPool = append(e.eventPool, ev)
		return b.ev, nil
	}
	b.ev = ev
	b.rec.evBufs[b] = struct{}{}
	return ev, nil
}

// unleaseLocked ends one lease of b.
func (e *Exporter) unleaseLocked(b *Buffer) {
	b.leases--
	e.stats.Leases--
	if b.leases == 0 && b.sending == 0 {
		e.idleLocked(b)
	}
}

// idleLocked runs when b has no lease and no offer in flight: waiters
// wake, a pending Free completes, a ring buffer that was offered goes back
// to its ring.
func (e *Exporter) idleLocked(b *Buffer) {
	e.notifyLocked(&b.idle)
	switch {
	case b.freePending:
		e.freeBufferLocked(b)
	case b.ring != nil && b.held && b.offered:
		b.held, b.offered = false, false
		switch {
		case b.successor != nil:
			// Its allocation is being replaced: the successor takes its
			// slot.
			e.releaseAfterLocked(b)
			succ := b.successor
			b.successor, succ.pred, b.gone = nil, nil, true
			e.putFreeLocked(b.ring, succ)
			e.memberIdleLocked(b.rec)
		case b.abandoned:
			// Never written again; its slot was refilled (or could not be).
			b.gone = true
			e.releaseAfterLocked(b)
		default:
			e.putFreeLocked(b.ring, b)
		}
	}
}
