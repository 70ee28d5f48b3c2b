package sim

import (
	"sync"
	"sync/atomic"
)

// Handle values. A handle is tag<<56 | salt<<48 | generation<<20 | index:
// the tag tells a stream from an event from a context, the salt tells this
// Driver's handles from another's, and the generation makes a destroyed
// handle stay invalid after its index is reused. Zero is never a handle.
const (
	tagContext = 0xc7
	tagStream  = 0x57
	tagEvent   = 0xe7

	handleIdxBits = 20
	handleGenBits = 28
	handleChunk   = 1 << 10
	handleChunks  = 1 << handleIdxBits / handleChunk
)

type cell[T any] struct {
	h uintptr
	v *T
}

// table maps handles to objects. Lookups take no lock and allocate nothing:
// they run on the per-handoff path (cuEventRecord, cuStreamWaitEvent).
type table[T any] struct {
	tag, salt uintptr
	chunks    [handleChunks]atomic.Pointer[[handleChunk]atomic.Pointer[cell[T]]]

	mu   sync.Mutex
	gens []uint32 // by index
	free []uint32 // FIFO, so a destroyed handle's index rests before reuse
}

func (t *table[T]) get(h uintptr) *T {
	if h>>56 != t.tag || h>>48&0xff != t.salt {
		return nil
	}
	idx := h & (1<<handleIdxBits - 1)
	ch := t.chunks[idx/handleChunk].Load()
	if ch == nil {
		return nil
	}
	c := ch[idx%handleChunk].Load()
	if c == nil || c.h != h {
		return nil
	}
	return c.v
}

// add stores the object that mk builds for a new handle. It returns false
// when the table is full.
func (t *table[T]) add(mk func(h uintptr) *T) (uintptr, *T, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var idx uint32
	if len(t.free) > 0 && (len(t.free) > 64 || len(t.gens) == 1<<handleIdxBits) {
		idx = t.free[0]
		t.free = t.free[1:]
	} else if len(t.gens) < 1<<handleIdxBits {
		idx = uint32(len(t.gens))
		t.gens = append(t.gens, 0)
	} else {
		return 0, nil, false
	}
	t.gens[idx] = (t.gens[idx] + 1) & (1<<handleGenBits - 1)
	h := t.tag<<56 | t.salt<<48 | uintptr(t.gens[idx])<<handleIdxBits | uintptr(idx)
	ch := t.chunks[idx/handleChunk].Load()
	if ch == nil {
		ch = new([handleChunk]atomic.Pointer[cell[T]])
		t.chunks[idx/handleChunk].Store(ch)
	}
	v := mk(h)
	ch[idx%handleChunk].Store(&cell[T]{h: h, v: v})
	return h, v, true
}

func (t *table[T]) remove(h uintptr) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.get(h) == nil {
		return
	}
	idx := h & (1<<handleIdxBits - 1)
	t.chunks[idx/handleChunk].Load()[idx%handleChunk].Store(nil)
	t.free = append(t.free, uint32(idx))
}

// threadTable holds the current context of each OS thread, by thread id.
// Only a thread itself sets its entry, so an open-addressing array whose
// slots are claimed once and never given back needs no lock to read.
// A thread id reused by the kernel inherits the old thread's entry; Go keeps
// its threads for the life of the process unless a locked goroutine exits.
type threadTable struct {
	slots [threadSlots]struct {
		tid atomic.Int32
		ctx atomic.Pointer[ctxState]
	}
	mu       sync.Mutex
	overflow map[int32]*ctxState
}

const threadSlots = 4096

func threadHash(tid int32) uint32 { return uint32(tid) * 0x9e3779b1 >> 20 }

func (t *threadTable) get(tid int32) *ctxState {
	i := threadHash(tid)
	for range threadSlots {
		s := &t.slots[i]
		switch s.tid.Load() {
		case tid:
			return s.ctx.Load()
		case 0:
			return nil
		}
		i = (i + 1) % threadSlots
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.overflow[tid]
}

func (t *threadTable) set(tid int32, c *ctxState) {
	i := threadHash(tid)
	for range threadSlots {
		s := &t.slots[i]
		if s.tid.Load() == tid || s.tid.CompareAndSwap(0, tid) {
			s.ctx.Store(c)
			return
		}
		i = (i + 1) % threadSlots
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.overflow == nil {
		t.overflow = make(map[int32]*ctxState)
	}
	t.overflow[tid] = c
}
