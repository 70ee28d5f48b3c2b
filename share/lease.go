//go:build linux

package share

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"weak"

	"github.com/seed743c36cf/cudashare/driver"
)

// Lease is one buffer offered by the producer, mapped in this process. Its
// pointer is valid until Release (or until the importer is closed); the
// producer does not write the buffer, retire or free its allocation while
// the lease is held.
//
// # Leases that are never released
//
// A Lease that becomes garbage without Release is released on the user's
// behalf, logged as an error and counted in ImporterStats.Leaked;
// otherwise its credit and its allocation would be held until the importer
// closes. That can only happen once nothing refers to the lease, and a
// pointer is valid only while its lease is held, so it cannot take memory
// from under a user who keeps the contract; close-before-free holds,
// since the mapping is still closed before the producer is told.
//
// Leases are allocated in blocks of leaseBlockSize, each watched by one
// cleanup (runtime.AddCleanup) that runs when the whole block is garbage:
// the handoff path allocates nothing and registers nothing per lease. A
// block costs five allocations (the block, its state, the cleanup's
// argument, the weak handle and the cleanup's record), so 128 leases a
// block make 0.04 allocations a lease (32 made 0.16). Fewer is not to be
// had while a released Lease stays usable (Meta, Seq, a second Release):
// only the garbage collector can tell when no one refers to a lease, and
// it runs only when something allocates. So a
// lease dropped without Release is reported once it and the other leases
// of its block are all unreachable: promptly for a consumer that drops its
// leases, later if it keeps one of them for long.
type Lease struct {
	a       *impAlloc
	st      *blockState
	idx     int // in the block
	seq     uint64
	gen     uint64
	ptr     driver.DevicePtr
	size    uint64
	meta    []byte
	ev      *driver.Event
	stream  *driver.Stream // where the producer's event was waited on
	err     error          // a queued mapping failure, for Next; not a lease
	done    atomic.Bool
	metaBuf [48]byte // small metadata lives here, with no allocation of its own
}

// leaseBlockSize is the number of leases allocated together.
const leaseBlockSize = 128

// leaseBlock is what the garbage collector watches.
type leaseBlock struct {
	leases [leaseBlockSize]Lease
	used   int // guarded by Importer.mu
}

// blockState is the cleanup's view of a block: which of its leases were
// returned by Next and not released. It must not refer to the block, or the
// block would never become garbage. Guarded by Importer.mu, but for live.
type blockState struct {
	im  *Importer
	out [leaseBlockSize]heldLease
}

// heldLease is a lease of the block, as its block's cleanup sees it: a and
// seq are set when its offer is mapped, live when Next hands it out, which
// takes no lock (Importer.handOut); it is cleared with Importer.mu held.
type heldLease struct {
	a    *impAlloc
	seq  uint64
	live atomic.Bool // returned by Next and not released
}

// newLeaseLocked returns a zero Lease from the current block, starting a
// new block when it is full or was collected. The importer holds its
// current block only weakly, so that a block whose leases were all dropped
// can be collected even while it has room. mu held.
func (im *Importer) newLeaseLocked() *Lease {
	blk := im.block.Value()
	if blk == nil || blk.used == leaseBlockSize {
		blk = new(leaseBlock)
		st := &blockState{im: im}
		for i := range blk.leases {
			blk.leases[i].st, blk.leases[i].idx = st, i
		}
		runtime.AddCleanup(blk, blockCollected, st)
		im.block = weak.Make(blk)
	}
	l := &blk.leases[blk.used]
	blk.used++
	return l
}

// blockCollected releases, on their users' behalf, the leases of a
// garbage block that were returned and never released.
func blockCollected(st *blockState) {
	im := st.im
	im.mu.Lock()
	defer im.mu.Unlock()
	for i := range st.out {
		h := &st.out[i]
		if !h.live.Load() {
			continue
		}
		h.live.Store(false)
		im.leaked.Add(1)
		im.log.Error("share: a lease was garbage-collected without Release; releasing it now (fix the caller: its pointer was invalid from then on)",
			"seq", h.seq, "alloc", h.a.id)
		im.releaseLocked(h.a, h.seq, nil)
	}
}

// Ptr is the device pointer of the buffer in this process: the mapping's
// base plus the buffer's offset in its allocation. After Release (or
// ReleaseAfter) it is 0, so that a use after release fails in the driver
// instead of reading a buffer the producer may be writing.
//
// A lease of legacy IPC memory whose producer is gone has no memory any
// more: its Ptr is 0 too, and Err says why.
func (l *Lease) Ptr() driver.DevicePtr {
	if l.done.Load() || l.a != nil && l.a.dead() {
		return 0
	}
	return l.ptr
}

// Err reports whether the lease's memory can still be used: nil while
// it can; an error matching ErrReleased after Release; ErrClosed after
// the importer's Close (which closed its mapping); ErrProducerGone when
// its producer is gone and the memory with it (legacy IPC: with VMM
// sharing the lease's own mapping keeps the memory, and a lease of a
// producer gone stays usable until released).
func (l *Lease) Err() error {
	if l == nil || l.st == nil {
		return errors.New("share: a lease Next did not return")
	}
	if l.done.Load() {
		return fmt.Errorf("share: lease %d: %w", l.seq, ErrReleased)
	}
	return l.unmapped()
}

// Size is the buffer's length in bytes.
func (l *Lease) Size() uint64 { return l.size }

// Device is the UUID of the device that holds the memory (the producer's).
func (l *Lease) Device() driver.UUID { return l.a.ent.key.src }

// Meta is the offer's metadata, one msgpack value or nil. It belongs to
// the lease and stays valid after Release.
func (l *Lease) Meta() []byte { return l.meta }

// Seq is the producer's name for this lease on this connection.
func (l *Lease) Seq() uint64 { return l.seq }

// Generation is the producer's count of offers of the buffer's allocation,
// this one included: a later offer of the same range has a larger one.
func (l *Lease) Generation() uint64 { return l.gen }

// Release gives the buffer back to the producer. If the producer has
// retired the allocation and this was the last lease in it, the mapping is
// closed first and the producer told. Release is idempotent and safe for
// concurrent use; the pointer must not be used after it. It cannot fail:
// the release is only queued to the producer (a failed connection ends
// the importer, and Next reports it), and a mapping that fails to close is
// logged.
func (l *Lease) Release() {
	if l == nil || l.st == nil || !l.done.CompareAndSwap(false, true) {
		return
	}
	im := l.st.im
	im.mu.Lock()
	defer im.mu.Unlock()
	h := &l.st.out[l.idx]
	if !h.live.Load() {
		return // never returned, or released on the user's behalf
	}
	h.live.Store(false)
	im.releaseLocked(l.a, l.seq, nil)
}

// Stream is the stream the lease is ready on: the one that waited on the
// producer's event (the importer's, or NextOn's), or nil if the host
// waited. Work queued on it sees the producer's writes.
func (l *Lease) Stream() *driver.Stream { return l.stream }

// WaitOn makes stream s wait until the producer's writes of the buffer
// are done, so that work queued on s afterwards may read it, whichever
// stream the lease was made ready on: a handler that reads the lease on
// streams of its own (one per decoder, say) calls WaitOn for each. It
// queues a wait on the producer's event if the offer carried one, and
// does nothing if the offer carried none (the buffer was complete when
// offered) or s is the lease's own Stream. It never blocks the host.
// After Release it returns ErrReleased; after the importer's Close,
// ErrClosed.
func (l *Lease) WaitOn(s *driver.Stream) error {
	if l != nil && l.done.Load() {
		return ErrReleased
	}
	if l == nil || s == nil || l.ev == nil || s == l.stream {
		return nil
	}
	// Close leaves the event to be destroyed once this is done.
	l.st.im.useEvent()
	defer l.st.im.doneWithEvent()
	if err := l.unmapped(); err != nil {
		return err // its event is closed too
	}
	if l.a.lost.Load() {
		// Its producer is gone: no write of it is pending any more, and
		// its event may be destroyed.
		return nil
	}
	if err := s.WaitEvent(l.ev); err != nil {
		return fmt.Errorf("share: make a stream wait for the producer's event: %w", err)
	}
	return nil
}

// ReleaseAfter gives the buffer back once the work queued on stream s so
// far is done, without waiting for it: the last use of the buffer must be
// queued on s. The producer's next write of the buffer waits for that work
// on the GPU (stream-ordered release; PROTOCOL.md, section 4). With a
// producer that does not take release events, or one in a PID namespace
// this process cannot see (another container: the driver does not open
// interprocess events there), ReleaseAfter waits for s on the host, then
// releases. A nil s is Release. Like Release, it is
// idempotent; the pointer must not be used by work queued after it.
func (l *Lease) ReleaseAfter(s *driver.Stream) error {
	if s == nil {
		l.Release()
		return nil
	}
	if l == nil || l.st == nil || l.done.Load() {
		return nil
	}
	im := l.st.im
	if !im.relEvOK.Load() {
		err := s.Synchronize()
		l.Release()
		return err
	}
	im.mu.Lock()
	defer im.mu.Unlock()
	var r *relEvent
	var err error
	if im.state != stateClosed {
		r, err = im.releaseEventLocked(s)
		if err == nil {
			err = r.ev.Record(s)
		}
		if err != nil {
			// The work cannot be ordered: wait for it here instead.
			err = errors.Join(fmt.Errorf("share: stream-ordered release: %w", err), s.Synchronize())
			r = nil
		}
	}
	// Else Close closed the mapping, and its release events with it: a new
	// one would never be destroyed. Nothing is sent but the goodbye.
	if !l.done.CompareAndSwap(false, true) {
		return nil
	}
	h := &l.st.out[l.idx]
	if !h.live.Load() {
		return nil
	}
	h.live.Store(false)
	im.releaseLocked(l.a, l.seq, r)
	return err
}
