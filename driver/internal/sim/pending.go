package sim

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Work is synchronous in the sim, but one rule of asynchronous work is
// checked: a process must not close its mapping of another process's
// memory (cuIpcCloseMemHandle, cuMemUnmap of an imported allocation) while
// work it queued on a stream may still use it. A consumer that releases
// stream-ordered must wait for that work on the host before it closes a
// retired allocation (PROTOCOL.md, section 4), and no other check of the
// sim would notice if it did not.
//
// The sim counts each created stream's asynchronous copies and sets,
// notes for each foreign mapping the last of them that touched it, and
// counts as done what a host wait covered: cuStreamSynchronize,
// cuCtxSynchronize, cuEventSynchronize or cuEventQuery (which succeed at
// once in the sim) of an event recorded after the work, and a synchronous
// copy or set, which on the legacy default stream waits for the work
// before it on every blocking stream of the context (CUDA's legacy default
// stream semantics). Closing
// the mapping otherwise is a "close-with-pending-work" violation. Work on
// the default streams is not tracked, so the check can only miss, never
// accuse wrongly.
const kindClosePending = "close-with-pending-work"

// streamWork is a created stream's count of queued copies and sets, and
// how many of them a host wait covered.
type streamWork struct {
	ops, done atomic.Uint64
}

// finish records that the stream's first n operations are done.
func (w *streamWork) finish(n uint64) {
	for {
		cur := w.done.Load()
		if n <= cur || w.done.CompareAndSwap(cur, n) {
			return
		}
	}
}

// eventTip is where an event was last recorded: a created stream and its
// operation count then (nil stream: a default stream, not tracked).
type eventTip struct {
	stream atomic.Pointer[streamState]
	ops    atomic.Uint64
}

// pendingWork is, per foreign mapping, the last operation of each stream
// that touched it.
type pendingWork struct {
	mu sync.Mutex
	m  map[*memObj]map[*streamState]uint64
}

// foreign reports whether o maps memory another process allocated.
func (o *memObj) foreign() bool {
	return o.imported || o.vmm != nil && o.vmm.foreign
}

// createdStream returns the state of stream if the application created
// it; nil for the default streams and unknown handles.
func (d *Driver) createdStream(stream api.Stream) *streamState {
	switch stream {
	case 0, streamLegacy, streamPerThread:
		return nil
	}
	return d.streams.get(uintptr(stream))
}

// queued records one asynchronous operation on stream that used the
// mappings a and b (either may be nil). mu held, for reading at least.
func (d *Driver) queued(stream api.Stream, a, b *memObj) {
	st := d.createdStream(stream)
	if st == nil {
		return
	}
	op := st.work.ops.Add(1)
	for _, o := range [2]*memObj{a, b} {
		if o == nil || !o.foreign() {
			continue
		}
		d.pend.mu.Lock()
		if d.pend.m == nil {
			d.pend.m = make(map[*memObj]map[*streamState]uint64)
		}
		ss := d.pend.m[o]
		if ss == nil {
			ss = make(map[*streamState]uint64, 1)
			d.pend.m[o] = ss
		}
		ss[st] = op
		d.pend.mu.Unlock()
	}
}

// syncedBlocking records that the work queued so far on every blocking
// stream of c is done: a synchronous copy or set on the legacy default
// stream waited for it. mu held, for reading at least.
func (d *Driver) syncedBlocking(c *ctxState) {
	for st := range c.streams {
		if st.flags&api.StreamNonBlocking == 0 {
			st.work.finish(st.work.ops.Load())
		}
	}
}

// syncedAll records that the work queued so far on every stream of c is
// done (cuCtxSynchronize). mu held, for reading at least.
func (d *Driver) syncedAll(c *ctxState) {
	for st := range c.streams {
		st.work.finish(st.work.ops.Load())
	}
}

// recorded notes where event e was recorded: on stream, after the work
// queued on it so far.
func (d *Driver) recorded(e *eventState, stream api.Stream) {
	st := d.createdStream(stream)
	if st != nil {
		e.tip.ops.Store(st.work.ops.Load())
	}
	e.tip.stream.Store(st)
}

// eventDone records that the work before e's last record is done.
func (d *Driver) eventDone(e *eventState) {
	if st := e.tip.stream.Load(); st != nil {
		st.work.finish(e.tip.ops.Load())
	}
}

// forget drops what is noted of o, which is gone.
func (d *Driver) forget(o *memObj) {
	d.pend.mu.Lock()
	delete(d.pend.m, o)
	d.pend.mu.Unlock()
}

// closing checks, as o is closed or unmapped, that no work queued on a
// stream may still use it, and forgets o.
func (d *Driver) closing(o *memObj, call string) {
	d.pend.mu.Lock()
	ss := d.pend.m[o]
	delete(d.pend.m, o)
	d.pend.mu.Unlock()
	for st, op := range ss {
		if done := st.work.done.Load(); op > done {
			d.violate(kindClosePending, fmt.Sprintf("%s at %#x: operation %d of stream %#x used the mapping [%#x, %#x), and no host wait covered it (done: %d)",
				call, o.base, op, uint64(st.h), o.base, o.base+o.size, done))
			return
		}
	}
}
