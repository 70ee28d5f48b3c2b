//go:build linux

package share

import (
	"github.com/seed743c36cf/cudashare/transport"
)

// This file is what the producer does with VMM memory that a consumer lost
// without a goodbye may still read (PROTOCOL.md, section 7.1): its leases
// are voided at once, the buffers it held are abandoned (never written
// again), and a ring's abandoned buffer is replaced by a fresh allocation
// while the old one waits, quarantined, until no one maps it.

// releaseVMMLocked voids what a consumer lost without a goodbye held in
// VMM allocations, without waiting for its processes to exit: its own
// handles and mappings keep the memory alive for it, so the producer need
// only never write again the buffers it held (abandonLocked). It no
// longer counts as mapping them. mu held.
func (e *Exporter) releaseVMMLocked(c *consumer) {
	for i := range c.slots {
		s := &c.slots[i]
		b := s.b
		if b == nil || b.rec.kind != transport.HandleVMM {
			continue
		}
		s.b = nil
		c.freeSlots = append(c.freeSlots, uint32(i))
		c.addOut(-1)
		e.unmapLeaseLocked(c, b)
		if !s.sent {
			// Still being sent: the consumer may read b only if the send
			// delivers it, which finishLocked learns (a send that fails
			// queued nothing, and b stays the producer's to offer).
			c.voided = append(c.voided, voidedOffer{seq: uint64(s.gen)<<32 | uint64(i), vmm: true})
			continue
		}
		e.stats.Releases++
		e.abandonForLocked(c, b)
		e.unleaseLocked(b)
	}
	for rec := range c.allocs {
		if rec.kind == transport.HandleVMM {
			delete(c.allocs, rec)
			delete(rec.mappers, c)
		}
	}
	e.notifyLocked(&e.changed)
	e.notifyLocked(&e.creditWait)
}

// abandonForLocked abandons b to the lost consumer c, which may read it,
// and counts it against c and its process (served last while it lives).
// mu held.
func (e *Exporter) abandonForLocked(c *consumer, b *Buffer) {
	c.abandoned++
	if c.proc != nil {
		c.proc.abandoned++
	}
	e.abandonLocked(b)
}

// abandonLocked gives b up for good: a lost consumer may still read it, so
// it is never written again. A ring gets fresh memory in its place; an
// arena keeps the range out of use until the arena is retired. mu held.
func (e *Exporter) abandonLocked(b *Buffer) {
	if b.abandoned {
		return
	}
	b.abandoned = true
	e.stats.Abandoned++
	if r := b.ring; r != nil && !b.rec.quarantined && b.rec.state == recLive && !e.closing {
		e.quarantineLocked(r, b.rec)
	}
	if a := b.arena; a != nil {
		a.lost = append(a.lost, span{b.off, b.span})
		e.log.Warn("share: an arena range is given up to a lost consumer that may still read it; it stays out of use until the arena is retired",
			"alloc", b.rec.id, "offset", b.off, "bytes", b.span, "lost", a.lostBytes(), "arena", b.rec.size)
		// An Alloc waiting for room looks whether it may still come.
		e.notifyLocked(&a.room)
	}
}

// quarantineLocked replaces the ring allocation old, which holds an
// abandoned buffer, with a fresh one: each buffer of old gets a successor
// at the same offset of the new allocation, which takes its place in the
// ring at once if the buffer is free or abandoned, else when the buffer
// next comes back. Once no buffer of old is in use, old is retired (the
// producer drops its handle; the memory lives on in the lost consumer).
// If the fresh allocation fails, the ring goes on without the abandoned
// buffers. mu held.
func (e *Exporter) quarantineLocked(r *Ring, old *allocRec) {
	nr, err := e.newOwnedLocked(old.size)
	if err != nil {
		e.log.Error("share: a lost consumer holds ring buffers and no fresh memory could replace them; the ring goes on with fewer buffers",
			"alloc", old.id, "err", err)
		return
	}
	nr.ring = r
	old.quarantined = true
	e.stats.Replaced++
	// Take the free buffers out, so that each slot is in the free list
	// exactly once, as the buffer or as its successor; the others go back.
	// Ring.next takes from the free list without mu: a receive guarded
	// only by len could block, mu held, on a buffer taken in between.
	wasFree := make(map[*Buffer]bool, cap(r.free))
drain:
	for {
		select {
		case b := <-r.free:
			wasFree[b] = true
		default:
			break drain
		}
	}
	for _, x := range old.ringBufs {
		if x.gone {
			continue // left the ring already
		}
		nx := &Buffer{e: e, rec: nr, off: x.off, size: x.size, ring: r}
		nr.ringBufs = append(nr.ringBufs, nx)
		switch {
		case x.pred != nil:
			// x is the successor of a buffer of an older replaced
			// allocation, and has not entered the ring yet: nx enters
			// in its place.
			x.pred.successor, nx.pred = nx, x.pred
			x.pred, x.gone = nil, true
		case wasFree[x]:
			delete(wasFree, x)
			x.gone = true
			e.putFreeLocked(r, nx)
		case x.abandoned:
			x.gone = true
			e.putFreeLocked(r, nx)
		default:
			// Held by the producer, leased, or on its way out of the free
			// list: nx comes in when x is idle (idleLocked).
			x.successor, nx.pred = nx, x
			old.members++
		}
	}
	for x := range wasFree {
		e.putFreeLocked(r, x)
	}
	e.log.Warn("share: a lost consumer may still read ring buffers; they are never written again, and fresh memory replaces them",
		"old_alloc", old.id, "new_alloc", nr.id)
	if old.members == 0 {
		e.retireQuarantinedLocked(old)
	}
}

// memberIdleLocked runs when a buffer of a quarantined ring allocation is
// idle: its successor took its place. mu held.
func (e *Exporter) memberIdleLocked(old *allocRec) {
	if old.members--; old.members == 0 {
		e.retireQuarantinedLocked(old)
	}
}

// retireQuarantinedLocked retires a replaced ring allocation in the
// background. mu held.
func (e *Exporter) retireQuarantinedLocked(old *allocRec) {
	if old.state != recLive || e.closing {
		return
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		if err := e.retire(e.life, old); err != nil && e.life.Err() == nil {
			e.log.Warn("share: retiring a replaced ring allocation failed", "alloc", old.id, "err", err)
		}
	}()
}
