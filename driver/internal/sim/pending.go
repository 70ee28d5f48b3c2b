package sim

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// Work is synchronous in the sim, but one rule of asynchronous work is
// checked: a process must not close its mapping of another process's
// memory (cuIpcCloseMemHandle, cuMemUnmap of an imported allocation) while
// work it queued may still use it. A consumer that releases stream-ordered
// must wait for that work on the host before it closes a retired
// allocation (PROTOCOL.md, section 4), and no other check of the sim would
// notice if it did not.
//
// The rule the sim applies is deliberately generous: it can miss a fault,
// and it accuses only one kind of correct program (below). An asynchronous
// copy or set that used a foreign mapping counts as done once the process
// makes, after it, any call that waits on the host, for any stream or
// event: cuStreamSynchronize, cuCtxSynchronize, cuEventSynchronize,
// cuEventQuery (which succeeds at once in the sim), a synchronous copy or
// set (a device-to-device copy or a set need not wait, which only makes
// the rule more generous), a free (even one that fails), cuCtxDestroy, or
// the cuDevicePrimaryCtxRelease that destroys a primary context. Only a
// mapping closed (by its last cuIpcCloseMemHandle, or cuMemUnmap) with work
// queued on it after the last such call is a "close-with-pending-work"
// violation. CUDA promises less: a wait on one stream says nothing of
// another's work. Tracking that exactly, through cuStreamWaitEvent chains,
// the legacy default stream's implicit waits and destroyed streams, was
// tried and accused correct programs. The one correct program still
// accused is a process that learns its own work is done only from another
// process (which waited on its event), and closes the mapping without a
// wait of its own.
const kindClosePending = "close-with-pending-work"

// pendingWork numbers the asynchronous copies and sets of the process and
// remembers, per foreign mapping, the last of them that used it.
type pendingWork struct {
	ops    atomic.Uint64 // asynchronous operations so far
	waited atomic.Uint64 // ops at the last host wait
	mu     sync.Mutex
	last   map[*memObj]uint64
}

// foreign reports whether o maps memory another process allocated.
func (o *memObj) foreign() bool {
	return o.imported || o.vmm != nil && o.vmm.foreign
}

// queued records one asynchronous operation that used a and b (either may
// be nil).
func (d *Driver) queued(a, b *memObj) {
	op := d.pend.ops.Add(1)
	for _, o := range [2]*memObj{a, b} {
		if o == nil || !o.foreign() {
			continue
		}
		d.pend.mu.Lock()
		if d.pend.last == nil {
			d.pend.last = make(map[*memObj]uint64)
		}
		d.pend.last[o] = op
		d.pend.mu.Unlock()
	}
}

// hostWaited records a call that waited on the host: every operation
// queued before it counts as done.
func (d *Driver) hostWaited() {
	n := d.pend.ops.Load()
	for {
		cur := d.pend.waited.Load()
		if n <= cur || d.pend.waited.CompareAndSwap(cur, n) {
			return
		}
	}
}

// forget drops what is noted of o, which is gone.
func (d *Driver) forget(o *memObj) {
	d.pend.mu.Lock()
	delete(d.pend.last, o)
	d.pend.mu.Unlock()
}

// closing checks, as o is closed or unmapped, that no operation queued
// after the last host wait used it, and forgets o.
func (d *Driver) closing(o *memObj, call string) {
	d.pend.mu.Lock()
	op, ok := d.pend.last[o]
	delete(d.pend.last, o)
	d.pend.mu.Unlock()
	if waited := d.pend.waited.Load(); ok && op > waited {
		d.violate(kindClosePending, fmt.Sprintf("%s at %#x: asynchronous operation %d of this process used the mapping [%#x, %#x), and no host wait came after it (the last came after operation %d)",
			call, o.base, op, o.base, o.base+o.size, waited))
	}
}
