//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
)

// bufferAlign is the alignment of ring and arena buffers, as cuMemAlloc's.
const bufferAlign = 256

func alignUp(n uint64) uint64 { return (n + bufferAlign - 1) &^ (bufferAlign - 1) }

// Buffer is a range of an exported allocation: what an offer lends. It
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
	offers      uint64
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
// settle under way (b.settling). Whoever writes or hands out b settles
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

// Ring is a fixed set of equal buffers carved from one exported
// allocation, so a consumer maps it once. The producer takes a free buffer
// with Acquire, writes it and offers it; the buffer comes back by itself
// once every consumer it was lent to has released it. This is the
// reused-buffer path: it allocates nothing per handoff.
type Ring struct {
	e    *Exporter
	rec  *allocRec     // its first allocation, to name the ring in errors
	bufs []*Buffer     // the buffers it was made with: len(bufs) is its size
	free chan *Buffer  // buffers ready to be acquired; room for all
	dead chan struct{} // closed once the ring is retired
	// Exporter.mu.
	deadClosed   bool
	pinnedWarned time.Time // when warnPinnedLocked last warned about it
}

// NewRing allocates n buffers of size bytes each. With legacy IPC they
// lie in one allocation, so a consumer maps the ring once. With VMM, in as
// few allocations as the granularity allows each holding as many buffers
// as fit (8 x 1 MiB at 2 MiB granularity: 4 allocations of 2), so that a
// buffer a lost consumer may still read is replaced with little memory
// (PROTOCOL.md, section 7.1).
func (e *Exporter) NewRing(n int, size uint64) (*Ring, error) {
	if n <= 0 || size == 0 {
		return nil, fmt.Errorf("share: NewRing(%d, %d): %w", n, size, driver.ErrInvalidValue)
	}
	stride := alignUp(size)
	per := n
	if e.sharing == SharingVMM {
		per = int(max(1, e.gran/stride))
		per = min(per, n)
	}
	r := &Ring{e: e, bufs: make([]*Buffer, n), free: make(chan *Buffer, n), dead: make(chan struct{})}
	e.mu.Lock()
	defer e.mu.Unlock()
	var recs []*allocRec
	for i := 0; i < n; i += per {
		rec, err := e.newOwnedChecked(stride * uint64(min(per, n-i)))
		if err != nil {
			for _, rec := range recs {
				if ferr := e.freeMemory(rec); ferr != nil {
					err = errors.Join(err, ferr)
				}
				delete(e.allocs, rec.id)
			}
			return nil, err
		}
		rec.ring = r
		recs = append(recs, rec)
		for j := i; j < min(i+per, n); j++ {
			b := &Buffer{e: e, rec: rec, off: uint64(j-i) * stride, size: size, ring: r}
			r.bufs[j] = b
			rec.ringBufs = append(rec.ringBufs, b)
			r.free <- b
		}
	}
	r.rec = recs[0]
	return r, nil
}

// newOwnedChecked is newOwnedLocked, refused once the exporter closes.
// mu held.
func (e *Exporter) newOwnedChecked(size uint64) (*allocRec, error) {
	if e.closing {
		return nil, ErrClosed
	}
	return e.newOwnedLocked(size)
}

// Acquire waits within ctx for a buffer that no consumer holds and gives
// it to the producer. The buffer returns to the ring once it has been
// offered and every lease of it is released; a buffer the producer decides
// not to offer goes back with Free.
func (r *Ring) Acquire(ctx context.Context) (*Buffer, error) { return r.AcquireOn(ctx, nil) }

// AcquireOn is Acquire for a producer that writes the buffer on stream s:
// instead of waiting on the host for consumers that released the buffer
// stream-ordered (Lease.ReleaseAfter), it makes s wait for their GPU work,
// so that the producer never blocks a CPU thread on the GPU. Work queued
// on s after AcquireOn returns may write the buffer.
func (r *Ring) AcquireOn(ctx context.Context, s *driver.Stream) (*Buffer, error) {
	if err := ctx.Err(); err != nil {
		return nil, err // a loop bounded by its context must end even when a buffer is free
	}
	for {
		b, err := r.next(ctx)
		if err != nil {
			return nil, err
		}
		b, waits, err := r.take(b)
		if waits {
			if err := r.e.settle(b, s); err != nil {
				b.Free()
				return nil, err
			}
		}
		if b != nil || err != nil {
			return b, err
		}
	}
}

// next takes a buffer from the free list, waiting for one. While the
// producer has one consumer, the goroutine waiting reads the consumer's
// connection itself, for the release that frees a buffer (consreader.go).
func (r *Ring) next(ctx context.Context) (*Buffer, error) {
	select {
	case b := <-r.free:
		return b, nil
	default:
	}
	e := r.e
	var c *consumer
	var tok chan struct{} // nil: wait for the connections' readers
	if c = e.sole.Load(); c != nil && e.reading.CompareAndSwap(nil, c) {
		defer e.reading.CompareAndSwap(c, nil)
		c.rd.begin()
		defer c.rd.end()
		tok = c.rd.tok
	}
	ready := func() bool { return len(r.free) > 0 || isClosed(r.dead) }
	for {
		// The token, if free, without a select of every case: this runs
		// once per handoff.
		took := false
		if tok != nil {
			select {
			case <-tok:
				took = true
			default:
			}
		}
		if !took {
			select {
			case b := <-r.free:
				return b, nil
			case <-tok:
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-r.dead:
				if isClosed(e.done) {
					return nil, ErrClosed
				}
				return nil, fmt.Errorf("%w: ring allocation %d", ErrRetired, r.rec.id)
			case <-e.done:
				return nil, ErrClosed
			}
		}
		ended := e.readUntil(ctx, c, ready)
		c.rd.give()
		// One-case select with a default, after the length: neither
		// locks a channel that is empty and open.
		if len(r.free) > 0 {
			select {
			case b := <-r.free:
				return b, nil
			default:
			}
		}
		if ended || isClosed(r.dead) || isClosed(e.done) {
			tok = nil // the select says which
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
}

// take gives b, just taken from the free list, to the producer; nil, nil
// if it must not have it. waits says whether consumers released it
// stream-ordered (settle), so that the common case takes the lock once.
func (r *Ring) take(b *Buffer) (_ *Buffer, waits bool, _ error) {
	e := r.e
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.offerableLocked(b); err != nil {
		r.free <- b
		return nil, false, err
	}
	if b.leases > 0 || b.sending > 0 {
		// Never hand out a buffer a consumer holds: it would be
		// rewritten under the reader. Offer refuses buffers the producer
		// does not hold, so this is a bug; the buffer comes back once idle.
		e.log.Error("share: a leased ring buffer was in the free list; keeping it out until released",
			"alloc", b.rec.id, "offset", b.off, "leases", b.leases)
		b.held, b.offered = true, true
		return nil, false, nil
	}
	b.held = true
	return b, b.gpuBusyLocked(), nil
}

// Retire retires the ring's allocations (see Exporter.Retire) and frees
// them.
func (r *Ring) Retire(ctx context.Context) error {
	e := r.e
	e.mu.Lock()
	var recs []*allocRec
	for _, rec := range e.allocs {
		if rec.ring == r {
			recs = append(recs, rec)
		}
	}
	e.mu.Unlock()
	for _, rec := range recs {
		if err := e.startRetire(ctx, rec); err != nil {
			return err
		}
	}
	for _, rec := range recs {
		if err := e.finishRetire(ctx, rec); err != nil {
			return err
		}
	}
	return nil
}

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
