//go:build linux

package share

import (
	"context"
	"fmt"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
)

// Arena is one large exported allocation that buffers are sub-allocated
// from, so fresh buffers cost no driver call and a consumer maps the arena
// once: fresh buffers hand off at the rate of reused ones.
type Arena struct {
	e       *Exporter
	rec     *allocRec
	spans   spans         // guarded by Exporter.mu
	room    chan struct{} // closed when a range is freed; made by a waiter
	pending []*Buffer     // freed, waiting for consumers' GPU work; Exporter.mu
	blk     []Buffer      // where Alloc's next Buffers come from; Exporter.mu
	// lost are the ranges abandoned to lost consumers (VMM): out of use
	// until the arena is retired (abandonLocked). Exporter.mu.
	lost []span
	// waiting counts the Allocs waiting for room; pinnedWarned is when
	// warnPinnedLocked last warned about it. Exporter.mu.
	waiting      int
	pinnedWarned time.Time
}

// lostBytes is the size of the ranges abandoned to lost consumers. mu held.
func (a *Arena) lostBytes() uint64 {
	var n uint64
	for _, l := range a.lost {
		n += l.n
	}
	return n
}

// arenaBlock is the number of arena Buffers allocated together.
const arenaBlock = 64

// newBufferLocked returns a zero Buffer for Alloc. Buffers are allocated
// arenaBlock at a time, so that a fresh buffer per handoff costs 1/64 of
// an allocation instead of one. None is ever reused: a Buffer kept after
// Free still refers to its own range, never to a later one, and its block
// (arenaBlock Buffers, about 11 KiB) is garbage once all of them are.
// Exporter.mu held.
func (a *Arena) newBufferLocked() *Buffer {
	if len(a.blk) == 0 {
		a.blk = make([]Buffer, arenaBlock)
	}
	b := &a.blk[0]
	a.blk = a.blk[1:]
	return b
}

// NewArena allocates an arena of at least size bytes (with VMM, size
// rounded up to the allocation granularity).
func (e *Exporter) NewArena(size uint64) (*Arena, error) {
	if size == 0 {
		return nil, fmt.Errorf("share: NewArena(0): %w", driver.ErrInvalidValue)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	rec, err := e.newOwnedChecked(size)
	if err != nil {
		return nil, err
	}
	// A VMM arena is rounded up to the granularity: the rest is usable.
	a := &Arena{e: e, rec: rec, spans: newSpans(rec.size)}
	rec.arena = a
	return a, nil
}

// Alloc takes a buffer of size bytes from the arena (its range rounded up
// to 256 bytes), waiting within ctx for room while consumers hold too much
// of it. Give it back with Free, which may come right after its offer. A
// range that consumers released stream-ordered comes back once their GPU
// work is done: Alloc checks without waiting, and only when the arena is
// out of room waits on the host for the oldest such range.
//
// With VMM, a range that a lost consumer held is never written again, and
// stays out of use until the arena is retired (PROTOCOL.md, section 7.1).
// Once such ranges leave no room of size bytes that could ever come free,
// Alloc returns an error matching ErrAbandoned instead of waiting: retire
// the arena and make a new one.
func (a *Arena) Alloc(ctx context.Context, size uint64) (*Buffer, error) {
	if err := ctx.Err(); err != nil {
		return nil, err // a loop bounded by its context must end even when there is room
	}
	need := min(alignUp(size), a.rec.size)
	if size == 0 || size > a.rec.size {
		return nil, fmt.Errorf("share: Alloc(%d) from an arena of %d bytes: %w", size, a.rec.size, driver.ErrInvalidValue)
	}
	e := a.e
	e.mu.Lock()
	defer e.mu.Unlock()
	for {
		switch {
		case e.closing:
			return nil, ErrClosed
		case a.rec.state != recLive:
			return nil, fmt.Errorf("%w: arena allocation %d", ErrRetired, a.rec.id)
		}
		if len(a.pending) > 0 {
			a.reclaimLocked()
		}
		if off, ok := a.spans.alloc(need); ok {
			b := a.newBufferLocked()
			*b = Buffer{e: e, rec: a.rec, off: off, size: size, arena: a, span: need}
			return b, nil
		}
		if len(a.pending) > 0 {
			// Out of room, with ranges waiting for consumers' GPU work:
			// wait for the oldest on the host.
			b := a.pending[0]
			a.pending = a.pending[1:]
			e.mu.Unlock()
			err := e.settle(b, nil)
			e.mu.Lock()
			switch {
			case a.rec.state != recLive:
			case err != nil:
				// Whether the consumers' GPU work is done is unknown:
				// the range stays out of use, as a lost consumer's.
				a.lost = append(a.lost, span{b.off, b.span})
				e.log.Warn("share: an arena range stays out of use: waiting for a consumer's stream-ordered release failed",
					"alloc", b.rec.id, "offset", b.off, "bytes", b.span, "lost", a.lostBytes(), "arena", b.rec.size, "err", err)
				// Other Allocs waiting for room look again: this one may
				// leave some of them ErrAbandoned, as abandonLocked does.
				e.notifyLocked(&a.room)
			default:
				// Other Allocs waiting for room may fit in what this one
				// leaves.
				a.spans.release(b.off, b.span)
				e.notifyLocked(&a.room)
			}
			if err != nil {
				return nil, err
			}
			continue
		}
		if len(a.lost) > 0 && !fits(a.rec.size, a.lost, need) {
			return nil, fmt.Errorf("%w: Alloc(%d) from arena allocation %d can never be served: lost consumers may still read %d of its %d bytes, and leave no free range of %d bytes; retire the arena and make a new one",
				ErrAbandoned, size, a.rec.id, a.lostBytes(), a.rec.size, need)
		}
		a.waiting++
		err := e.waitReadingLocked(ctx, &a.room)
		a.waiting--
		if err != nil {
			return nil, err
		}
	}
}

// Available returns the free bytes of the arena.
func (a *Arena) Available() uint64 {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	return a.spans.available()
}

// Retire retires the arena's allocation (see Exporter.Retire) and frees
// it. Its buffers can no longer be offered.
func (a *Arena) Retire(ctx context.Context) error { return a.e.retire(ctx, a.rec) }

// reclaimLocked returns to the arena the ranges whose consumers' GPU work
// is done. mu held.
func (a *Arena) reclaimLocked() {
	e := a.e
	keep := a.pending[:0]
	for _, b := range a.pending {
		// A settle under way holds events in b.settling: not done.
		done := b.settlers == 0
		for _, ce := range b.after {
			if !done {
				break
			}
			if ce.dead {
				continue
			}
			if ok, err := ce.ev.Done(); !ok && err == nil {
				done = false
				break
			}
		}
		if !done {
			keep = append(keep, b)
			continue
		}
		for _, ce := range b.after {
			e.unrefEventLocked(ce, 1)
		}
		b.after = b.after[:0]
		a.spans.release(b.off, b.span)
	}
	clear(a.pending[len(keep):])
	a.pending = keep
}
