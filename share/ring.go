//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
)

// Ring is a fixed set of equal buffers carved from one exported
// allocation, so a consumer maps it once. The producer takes a free buffer
// with Acquire, writes it and offers it; the buffer comes back by itself
// once every consumer it was offered to has released it. This is the
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
				delete(e.recs.byID, rec.id)
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

// next takes a buffer from the free list, waiting for one. Unless another
// wait reads already, the goroutine waiting reads every consumer's
// connection itself, for the release that frees a buffer
// (exporter_read.go).
func (r *Ring) next(ctx context.Context) (*Buffer, error) {
	select {
	case b := <-r.free:
		return b, nil
	default:
	}
	e := r.e
	var tok chan struct{} // nil: wait for the reader
	if e.reading.CompareAndSwap(false, true) {
		defer e.reading.Store(false)
		e.rd.begin()
		defer e.rd.end()
		tok = e.rd.tok
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
		if !ready() {
			e.readUntil(ctx, ready)
		}
		e.rd.give()
		// One-case select with a default, after the length: neither
		// locks a channel that is empty and open.
		if len(r.free) > 0 {
			select {
			case b := <-r.free:
				return b, nil
			default:
			}
		}
		if isClosed(r.dead) || isClosed(e.done) {
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
	for _, rec := range e.recs.byID {
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

// putFreeLocked puts b in r's free list. mu held.
func (e *Exporter) putFreeLocked(r *Ring, b *Buffer) {
	r.free <- b // never blocks: the ring has room for all its buffers
	e.wakeReaderLocked()
}
