//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"

	"github.com/seed743c36cf/cudashare/driver"
)

// bufferAlign is the alignment of ring and arena buffers, as cuMemAlloc's.
const bufferAlign = 256

func alignUp(n uint64) uint64 { return (n + bufferAlign - 1) &^ (bufferAlign - 1) }

// Buffer is a range of an exported allocation: what an offer carries. It
// comes from Register, a Ring or an Arena.
type Buffer struct {
	e     *Exporter
	rec   *allocRec
	off   uint64
	size  uint64
	ring  *Ring
	arena *Arena
	span  uint64 // bytes taken from the arena

	// Guarded by Exporter.mu.
	leases      int
	sending     int // offers or a broadcast in flight
	ev          *expEvent
	held        bool // ring: acquired by the producer
	offered     bool // ring: offered since it was acquired
	freePending bool
	freed       bool
	// abandoned: a consumer lost while holding it may still read it (VMM
	// only): it is never written again (abandonLocked).
	abandoned bool
	// successor takes this ring buffer's place once it is idle: its
	// allocation is being replaced (quarantineLocked); pred is the buffer
	// a successor waits for, until it enters the ring. gone: the buffer
	// left its ring for good (replaced).
	successor, pred *Buffer
	gone            bool
	idle            chan struct{} // closed when leases and sends reach zero; made by Wait
	// after are the release events of consumers that released b
	// stream-ordered: its next write waits on them (settle). settling is
	// the other half of a double buffer, so that neither allocates.
	after, settling []*consEvent
	settlers        int // settles under way (settle)
}

// gpuBusyLocked reports whether consumers' stream-ordered work may still
// read b: release events not yet waited for, in b.after or held by a
// settle under way (b.settling). Whoever writes or offers b settles
// first. mu held.
func (b *Buffer) gpuBusyLocked() bool { return len(b.after) > 0 || b.settlers > 0 }

// waitAfterLocked makes b's next write wait on ce. mu held.
func (b *Buffer) waitAfterLocked(ce *consEvent) {
	for _, x := range b.after {
		if x == ce {
			return // the latest record of an event covers the earlier ones
		}
	}
	b.after = append(b.after, ce)
	ce.refs++
}

// settle makes stream s (nil: the host) wait for the work of the
// stream-ordered releases of b, which no consumer holds now, so that work
// on s after it may overwrite b. A dropped consumer's events are skipped:
// its process, and its GPU work, are gone. A goroutine that comes while
// another settles b (two WaitOn, say) waits for that one's events too:
// returning at once, as the list of events to wait for is empty, would let
// it write under work not yet done.
func (e *Exporter) settle(b *Buffer, s *driver.Stream) error {
	e.mu.Lock()
	if !b.gpuBusyLocked() {
		e.mu.Unlock()
		return nil
	}
	// b.settling holds every event a settle under way waits for, until the
	// last of them ends: one that comes meanwhile waits for them all,
	// those a settle before it took from b.after included. The first
	// waits on b.settling itself (later ones only append to it), so that
	// it allocates nothing; a later one copies it, with references.
	for _, ce := range b.after {
		if ce.dead {
			e.unrefEventLocked(ce, 1)
			continue
		}
		b.settling = append(b.settling, ce) // b.after's reference goes with it
	}
	clear(b.after)
	b.after = b.after[:0]
	b.settlers++
	own := b.settlers == 1
	set := b.settling
	if !own {
		set = make([]*consEvent, 0, len(b.settling))
		for _, ce := range b.settling {
			if ce.dead {
				continue
			}
			ce.refs++
			set = append(set, ce)
		}
	}
	e.mu.Unlock()
	if settleWaiting != nil {
		settleWaiting() // a test holds the settle here, its events taken
	}
	var err error
	for _, ce := range set {
		if s != nil {
			err = errors.Join(err, s.WaitEvent(ce.ev))
		} else {
			err = errors.Join(err, ce.ev.Synchronize())
		}
	}
	e.mu.Lock()
	if !own {
		for _, ce := range set {
			e.unrefEventLocked(ce, 1)
		}
	}
	if b.settlers--; b.settlers == 0 {
		for _, ce := range b.settling {
			e.unrefEventLocked(ce, 1)
		}
		clear(b.settling)
		b.settling = b.settling[:0]
	}
	e.mu.Unlock()
	if err != nil {
		return fmt.Errorf("share: wait for a consumer's stream-ordered release: %w", err)
	}
	return nil
}

// settleWaiting, if set (tests only), runs in settle between taking the
// events and waiting for them: the simulator's events are done at once, so
// a test cannot otherwise catch a settle in its wait.
var settleWaiting func()

// Ptr is the buffer's device pointer in the exporting process.
func (b *Buffer) Ptr() driver.DevicePtr { return b.rec.base + driver.DevicePtr(b.off) }

// Size is the buffer's length in bytes.
func (b *Buffer) Size() uint64 { return b.size }

// AllocID is the id of the buffer's allocation on the wire. It is never
// reused by the exporter's process: memory freed and allocated again at
// the same address gets a new one.
func (b *Buffer) AllocID() uint64 { return b.rec.id }

// Leases returns the number of consumers holding the buffer now.
func (b *Buffer) Leases() int {
	b.e.mu.Lock()
	defer b.e.mu.Unlock()
	return b.leases
}

// Wait waits within ctx until no consumer holds the buffer, and on the
// host for the GPU work of consumers that released it stream-ordered, so
// that the producer may write it again.
func (b *Buffer) Wait(ctx context.Context) error { return b.WaitOn(ctx, nil) }

// WaitOn waits within ctx until no consumer holds the buffer, and makes
// stream s wait for the GPU work of consumers that released it
// stream-ordered: work queued on s afterwards may write the buffer, with
// no host wait on the GPU. A nil s is Wait.
func (b *Buffer) WaitOn(ctx context.Context, s *driver.Stream) error {
	e := b.e
	e.mu.Lock()
	for b.leases > 0 || b.sending > 0 {
		if err := e.waitReadingLocked(ctx, &b.idle); err != nil {
			e.mu.Unlock()
			return err
		}
	}
	abandoned := b.abandoned
	e.mu.Unlock()
	if abandoned {
		return fmt.Errorf("%w: offset %d of allocation %d", ErrAbandoned, b.off, b.rec.id)
	}
	return e.settle(b, s)
}

// Free gives back a buffer of an Arena or a Ring. An arena buffer's range
// returns to the arena, and a ring buffer to its ring, once no consumer
// holds it: Free does not wait, and the producer may forget the buffer
// right after offering it. Free is idempotent. A registered buffer has
// nothing to give back (its memory is the caller's): Free returns
// ErrRegistered; use Retire.
func (b *Buffer) Free() error {
	e := b.e
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case b.arena != nil:
		if b.freed || b.freePending {
			return nil
		}
		if b.leases == 0 && b.sending == 0 {
			e.freeBufferLocked(b)
		} else {
			b.freePending = true
		}
		return nil
	case b.ring != nil:
		if !b.held {
			return nil
		}
		b.offered = true
		if b.leases == 0 && b.sending == 0 {
			e.idleLocked(b)
		}
		return nil
	}
	return ErrRegistered
}

// releaseAfterLocked drops b's stream-ordered release events: b is never
// written again. mu held.
func (e *Exporter) releaseAfterLocked(b *Buffer) {
	for _, ce := range b.after {
		e.unrefEventLocked(ce, 1)
	}
	clear(b.after)
	b.after = b.after[:0]
}

// freeBufferLocked returns an arena buffer's range.
func (e *Exporter) freeBufferLocked(b *Buffer) {
	b.freed, b.freePending = true, false
	if b.ev != nil {
		e.eventPool = append(e.eventPool, b.ev)
		delete(b.rec.evBufs, b)
		b.ev = nil
	}
	a := b.arena
	switch {
	case b.abandoned:
		// A lost consumer may still read it: the range stays out of use
		// until the arena is retired.
		e.releaseAfterLocked(b)
		e.stats.AbandonedBytes += b.span
	case b.rec.state != recLive:
	case b.gpuBusyLocked():
		// Consumers' GPU work may still read it: the range comes back
		// once that is done (reclaimLocked). A waiting Alloc wakes to
		// check, or to wait for it.
		a.pending = append(a.pending, b)
		e.notifyLocked(&a.room)
	default:
		a.spans.release(b.off, b.span)
		e.notifyLocked(&a.room)
	}
}
