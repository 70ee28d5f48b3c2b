package sim

import (
	"fmt"
	"sort"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// The simulated address space of one process: host-global device n owns the
// 1 TiB region at addrBase + n<<40. Allocations and IPC mappings of memory on
// device n take the first free range of the region at allocGranularity, so
// freed ranges come back, as they do with cuMemAlloc.
const (
	addrBase         = 0x7f00_0000_0000
	regionBits       = 40
	allocGranularity = 2 << 20
	maxTombstones    = 4096
)

// memObj is an allocation of this process, or an IPC mapping of another
// process's allocation. Its fields are guarded by Driver.mu.
type memObj struct {
	base, size uint64 // size as requested; copies may not pass it
	span       uint64 // reserved address range and device memory charged
	hdev       int    // host-global device of the memory
	ctx        *ctxState
	bufID      uint64 // CU_POINTER_ATTRIBUTE_BUFFER_ID, unique in the process
	data       []byte // the mmap'd backing file
	slot       int    // registry slot
	gid, nonce uint64
	imported   bool
	refs       int     // IPC opens not yet closed
	bind       bindKey // imports only
	vmm        *vmmMap // cuMemMap mappings only; ctx is nil for them
}

// tombstone remembers a range that was freed or closed, to name the
// violation when it is used again. A new object in the range removes it.
type tombstone struct {
	base, end uint64
	kind      string // kindAccessAfterFree or kindAccessAfterClose
	bufID     uint64
}

type addrSpace struct {
	objs  []*memObj // sorted by base
	tombs []tombstone
}

func regionOf(hdev int) uint64 { return addrBase + uint64(hdev)<<regionBits }

// reserve finds the lowest free range of span bytes in hdev's region.
func (a *addrSpace) reserve(hdev int, span uint64) (uint64, bool) {
	lo, hi := regionOf(hdev), regionOf(hdev)+1<<regionBits
	cur := lo
	for _, o := range a.objs[sort.Search(len(a.objs), func(i int) bool { return a.objs[i].base >= lo }):] {
		if o.base >= hi || o.base-cur >= span {
			break
		}
		cur = o.base + o.span
	}
	if hi-cur < span {
		return 0, false
	}
	return cur, true
}

func (a *addrSpace) insert(o *memObj) {
	i := sort.Search(len(a.objs), func(i int) bool { return a.objs[i].base >= o.base })
	a.objs = append(a.objs, nil)
	copy(a.objs[i+1:], a.objs[i:])
	a.objs[i] = o
	// The new object owns its range now; what it does not cover of an old
	// one stays a tombstone.
	lo, hi := o.base, o.base+o.span
	var kept []tombstone
	for _, t := range a.tombs {
		if t.end <= lo || t.base >= hi {
			kept = append(kept, t)
			continue
		}
		if t.base < lo {
			kept = append(kept, tombstone{base: t.base, end: lo, kind: t.kind, bufID: t.bufID})
		}
		if t.end > hi {
			kept = append(kept, tombstone{base: hi, end: t.end, kind: t.kind, bufID: t.bufID})
		}
	}
	a.tombs = kept
}

func (a *addrSpace) remove(o *memObj, kind string) {
	i := sort.Search(len(a.objs), func(i int) bool { return a.objs[i].base >= o.base })
	if i < len(a.objs) && a.objs[i] == o {
		a.objs = append(a.objs[:i], a.objs[i+1:]...)
	}
	if len(a.tombs) == maxTombstones {
		a.tombs = append(a.tombs[:0], a.tombs[1:]...)
	}
	a.tombs = append(a.tombs, tombstone{base: o.base, end: o.base + o.size, kind: kind, bufID: o.bufID})
}

// find returns the live object whose [base, base+size) holds p.
func (a *addrSpace) find(p uint64) *memObj {
	i := sort.Search(len(a.objs), func(i int) bool { return a.objs[i].base > p }) - 1
	if i >= 0 && p-a.objs[i].base < a.objs[i].size {
		return a.objs[i]
	}
	return nil
}

func (a *addrSpace) tomb(p uint64) *tombstone {
	for i := len(a.tombs) - 1; i >= 0; i-- {
		if t := &a.tombs[i]; p >= t.base && p < t.end {
			return t
		}
	}
	return nil
}

// addObj gives o a buffer id and places it. mu held.
func (d *Driver) addObj(o *memObj) {
	d.lastBufID++
	o.bufID = d.lastBufID
	d.space.insert(o)
	o.ctx.objs[o] = struct{}{}
}

// removeObj unplaces and unmaps o. mu held.
func (d *Driver) removeObj(o *memObj, kind string) {
	d.space.remove(o, kind)
	delete(o.ctx.objs, o)
	_ = unix.Munmap(o.data)
	o.data = nil
}

// slotIsOurs says whether the registry slot still describes o. It always
// does unless someone reset the state directory under a running process.
// Registry lock held.
func (d *Driver) slotIsOurs(o *memObj) bool {
	s := d.reg.slot(o.slot)
	return s.state != slotEmpty && s.id == o.gid
}

// dropAllocation frees allocation o: the registry slot is released, or
// orphaned while other processes map it (a violation when check is set).
// mu held; registry lock held when regOK.
func (d *Driver) dropAllocation(o *memObj, regOK bool, l *liveness, check bool) {
	if regOK && d.slotIsOurs(o) {
		if check {
			if live := d.reg.liveMappers(o.slot, l); len(live) > 0 {
				d.violate(kindFreeWhileMapped, fmt.Sprintf("context %#x destroyed with buffer %d (global %d) at %#x mapped by %s",
					uintptr(o.ctx.h), o.bufID, o.gid, o.base, pids(live)))
			}
		}
		d.reg.disown(o.slot)
	}
	d.removeObj(o, kindAccessAfterFree)
}

func pids(ps []procID) string {
	s := "pid"
	for i, p := range ps {
		if i > 0 {
			s += ","
		}
		s += fmt.Sprint(" ", p.pid)
	}
	return s
}

// resolveObj returns the live allocation or mapping that holds [p, p+n),
// and those bytes. A miss in a freed or closed range is recorded as a
// violation. mu held.
func (d *Driver) resolveObj(p api.DevicePtr, n uint64, call string) (*memObj, []byte, api.Result) {
	o := d.space.find(uint64(p))
	if o == nil {
		if t := d.space.tomb(uint64(p)); t != nil {
			d.violate(t.kind, fmt.Sprintf("%s at %#x: buffer %d was at [%#x, %#x)", call, uint64(p), t.bufID, t.base, t.end))
		}
		return nil, nil, api.ErrorInvalidValue
	}
	off := uint64(p) - o.base
	if n > o.size-off {
		return nil, nil, api.ErrorInvalidValue
	}
	if o.vmm != nil && !d.vmmAccessible(o) {
		d.violate(kindAccessDenied, fmt.Sprintf("%s at %#x: mapping [%#x, %#x) of global %d has no access for this context's device (cuMemSetAccess)",
			call, uint64(p), o.base, o.base+o.size, o.gid))
		return nil, nil, api.ErrorInvalidValue
	}
	return o, o.data[off : off+n], api.Success
}

// copied notes a copy or set that used a and b (either may be nil):
// queued if async, else a call that waited on the host (pending.go).
func (d *Driver) copied(async bool, a, b *memObj) {
	if async {
		d.queued(a, b)
	} else {
		d.hostWaited()
	}
}

// MemAlloc implements api.API. Memory is charged to the device in
// allocGranularity units across every process of the machine; a device that
// cannot take it is CUDA_ERROR_OUT_OF_MEMORY.
func (d *Driver) MemAlloc(dptr *api.DevicePtr, bytesize uint64) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if dptr == nil || bytesize == 0 {
		return api.ErrorInvalidValue
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	c, r := d.current()
	if r != api.Success {
		return r
	}
	total := d.m.devices[c.hdev].totalMem
	if bytesize > total {
		return api.ErrorOutOfMemory
	}
	span := (bytesize + allocGranularity - 1) &^ (allocGranularity - 1)
	base, ok := d.space.reserve(c.hdev, span)
	if !ok {
		return api.ErrorOutOfMemory
	}
	if d.reg.lock() != nil {
		return api.ErrorUnknown
	}
	defer d.reg.unlock()
	i, ok := d.reg.alloc(uint32(c.hdev), bytesize, span, total, d.live())
	if !ok {
		return api.ErrorOutOfMemory
	}
	s := d.reg.slot(i)
	data, err := mapBuffer(d.reg.bufferPath(s.id), bytesize, true)
	if err != nil {
		d.reg.disown(i)
		return api.ErrorOutOfMemory
	}
	d.addObj(&memObj{
		base: base, size: bytesize, span: span, hdev: c.hdev, ctx: c, data: data,
		slot: i, gid: s.id, nonce: s.nonce,
	})
	*dptr = api.DevicePtr(base)
	return api.Success
}

// MemFree implements api.API. It takes the base of an allocation of this
// process (anything else, IPC mappings included, is
// CUDA_ERROR_INVALID_VALUE). Strict: while another live process maps the
// allocation, the free is refused with CUDA_ERROR_ILLEGAL_STATE and a
// "free-while-mapped" violation, and the memory stays intact, where the real
// driver leaves the importer undefined. No current context is needed
// (measured).
func (d *Driver) MemFree(dptr api.DevicePtr) api.Result {
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	d.hostWaited() // cuMemFree may wait for the device (pending.go)
	o := d.space.find(uint64(dptr))
	if o == nil || o.base != uint64(dptr) || o.imported || o.vmm != nil {
		return api.ErrorInvalidValue
	}
	if d.reg.lock() != nil {
		return api.ErrorUnknown
	}
	defer d.reg.unlock()
	if d.slotIsOurs(o) {
		if live := d.reg.liveMappers(o.slot, d.live()); len(live) > 0 {
			d.violate(kindFreeWhileMapped, fmt.Sprintf("cuMemFree(%#x): buffer %d (global %d, %d bytes) is mapped by %s",
				o.base, o.bufID, o.gid, o.size, pids(live)))
			return api.ErrorIllegalState
		}
	}
	d.dropAllocation(o, true, nil, false)
	return api.Success
}

// MemGetInfo implements api.API: the current context's device, with the
// memory of every live process charged to it. A nil out-parameter is
// skipped, as the real driver does (measured).
func (d *Driver) MemGetInfo(free, total *uint64) api.Result {
	if r := d.rlock(); r != api.Success {
		return r
	}
	defer d.mu.RUnlock()
	c, r := d.current()
	if r != api.Success {
		return r
	}
	if d.reg.lock() != nil {
		return api.ErrorUnknown
	}
	defer d.reg.unlock()
	d.reg.sweep(d.live())
	t := d.m.devices[c.hdev].totalMem
	if total != nil {
		*total = t
	}
	if free != nil {
		*free = t - min(t, d.reg.used(uint32(c.hdev)))
	}
	return api.Success
}

// MemGetAddressRange implements api.API. nil out-parameters are skipped. A
// current context is required (measured), though any context will do: the
// pointer is found in the unified address space. The size is the size
// requested, not rounded (measured).
func (d *Driver) MemGetAddressRange(base *api.DevicePtr, size *uint64, dptr api.DevicePtr) api.Result {
	if r := d.rlock(); r != api.Success {
		return r
	}
	defer d.mu.RUnlock()
	if _, r := d.current(); r != api.Success {
		return r
	}
	o := d.space.find(uint64(dptr))
	if o == nil {
		return api.ErrorInvalidValue
	}
	if base != nil {
		*base = api.DevicePtr(o.base)
	}
	if size != nil {
		*size = o.size
	}
	return api.Success
}

// PointerGetAttribute implements api.API. It needs no current context
// (measured). The device ordinal of an IPC mapping is that of the context
// that opened it, whichever device holds the memory (measured, also with
// that device hidden by CUDA_VISIBLE_DEVICES).
func (d *Driver) PointerGetAttribute(data unsafe.Pointer, attrib int32, ptr api.DevicePtr) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if data == nil {
		return api.ErrorInvalidValue
	}
	switch attrib {
	case api.PointerAttrContext, api.PointerAttrMemoryType, api.PointerAttrBufferID,
		api.PointerAttrDeviceOrdinal, api.PointerAttrRangeStart, api.PointerAttrRangeSize:
	default:
		return api.ErrorInvalidValue
	}
	if r := d.rlock(); r != api.Success {
		return r
	}
	defer d.mu.RUnlock()
	o := d.space.find(uint64(ptr))
	if o == nil {
		return api.ErrorInvalidValue
	}
	if o.vmm != nil {
		// A VMM mapping belongs to no context (unverified: what the real
		// driver reports for these).
		switch attrib {
		case api.PointerAttrContext:
			*(*api.Context)(data) = 0
			return api.Success
		case api.PointerAttrDeviceOrdinal:
			*(*int32)(data) = -1
			for i, h := range d.visible {
				if h == o.hdev {
					*(*int32)(data) = int32(i)
				}
			}
			return api.Success
		}
	}
	switch attrib {
	case api.PointerAttrContext:
		*(*api.Context)(data) = o.ctx.h
	case api.PointerAttrMemoryType:
		*(*int32)(data) = api.MemoryTypeDevice
	case api.PointerAttrBufferID:
		*(*uint64)(data) = o.bufID
	case api.PointerAttrDeviceOrdinal:
		*(*int32)(data) = int32(o.ctx.dev)
	case api.PointerAttrRangeStart:
		*(*api.DevicePtr)(data) = api.DevicePtr(o.base)
	case api.PointerAttrRangeSize:
		*(*uint64)(data) = o.size
	}
	return api.Success
}

// copyCall is the common head of the copy and set calls: init, and a
// current context for the synchronous forms and the default streams, or a
// live stream, which names its own context (measured: an explicit stream
// needs no current context).
func (d *Driver) copyCall(stream api.Stream, async bool) api.Result {
	if r := d.rlock(); r != api.Success {
		return r
	}
	r := api.Success
	if async {
		_, r = d.streamContext(stream)
	} else {
		_, r = d.current()
	}
	if r != api.Success {
		d.mu.RUnlock()
	}
	return r
}

func (d *Driver) memset(dst api.DevicePtr, value uint8, n uint64, stream api.Stream, async bool) api.Result {
	if r := d.copyCall(stream, async); r != api.Success {
		return r
	}
	defer d.mu.RUnlock()
	if n == 0 {
		return api.Success
	}
	o, b, r := d.resolveObj(dst, n, "cuMemsetD8")
	if r != api.Success {
		return r
	}
	for i := range b {
		b[i] = value
	}
	d.copied(async, o, nil)
	return api.Success
}

// MemsetD8 implements api.API.
func (d *Driver) MemsetD8(dst api.DevicePtr, value uint8, n uint64) api.Result {
	return d.memset(dst, value, n, 0, false)
}

// MemsetD8Async implements api.API. It completes before it returns.
func (d *Driver) MemsetD8Async(dst api.DevicePtr, value uint8, n uint64, stream api.Stream) api.Result {
	return d.memset(dst, value, n, stream, true)
}

// MemcpyHtoD implements api.API.
func (d *Driver) MemcpyHtoD(dst api.DevicePtr, src unsafe.Pointer, n uint64) api.Result {
	return d.memcpyHost(dst, src, n, 0, false, true, "cuMemcpyHtoD")
}

// MemcpyDtoH implements api.API.
func (d *Driver) MemcpyDtoH(dst unsafe.Pointer, src api.DevicePtr, n uint64) api.Result {
	return d.memcpyHost(src, dst, n, 0, false, false, "cuMemcpyDtoH")
}

// memcpyHost copies n bytes between device memory at dev and host memory
// at host, toDevice saying which way; the async forms check stream first
// (copyCall), so a bad stream is CUDA_ERROR_INVALID_HANDLE even for 0
// bytes. Work is synchronous in the simulator.
func (d *Driver) memcpyHost(dev api.DevicePtr, host unsafe.Pointer, n uint64, stream api.Stream, async, toDevice bool, call string) api.Result {
	if r := d.copyCall(stream, async); r != api.Success {
		return r
	}
	defer d.mu.RUnlock()
	if n == 0 {
		return api.Success
	}
	if host == nil {
		return api.ErrorInvalidValue
	}
	o, b, r := d.resolveObj(dev, n, call)
	if r != api.Success {
		return r
	}
	if toDevice {
		copy(b, unsafe.Slice((*byte)(host), n))
	} else {
		copy(unsafe.Slice((*byte)(host), n), b)
	}
	d.copied(async, o, nil)
	return api.Success
}

func (d *Driver) memcpyDtoD(dst, src api.DevicePtr, n uint64, async bool, call string) api.Result {
	if n == 0 {
		return api.Success
	}
	so, s, r := d.resolveObj(src, n, call)
	if r != api.Success {
		return r
	}
	to, t, r := d.resolveObj(dst, n, call)
	if r != api.Success {
		return r
	}
	copy(t, s)
	d.copied(async, to, so)
	return api.Success
}

// MemcpyDtoD implements api.API.
func (d *Driver) MemcpyDtoD(dst, src api.DevicePtr, n uint64) api.Result {
	if r := d.copyCall(0, false); r != api.Success {
		return r
	}
	defer d.mu.RUnlock()
	return d.memcpyDtoD(dst, src, n, false, "cuMemcpyDtoD")
}

// MemcpyDtoDAsync implements api.API. It completes before it returns.
func (d *Driver) MemcpyDtoDAsync(dst, src api.DevicePtr, n uint64, stream api.Stream) api.Result {
	if r := d.copyCall(stream, true); r != api.Success {
		return r
	}
	defer d.mu.RUnlock()
	return d.memcpyDtoD(dst, src, n, true, "cuMemcpyDtoDAsync")
}

// MemcpyPeer implements api.API. It needs a current context (measured), and
// both contexts must be live; the pointers are found in this process's
// unified address space, as with UVA, and need not belong to the contexts
// named.
func (d *Driver) MemcpyPeer(dst api.DevicePtr, dstCtx api.Context, src api.DevicePtr, srcCtx api.Context, n uint64) api.Result {
	if r := d.copyCall(0, false); r != api.Success {
		return r
	}
	defer d.mu.RUnlock()
	if d.liveContext(dstCtx) == nil || d.liveContext(srcCtx) == nil {
		return api.ErrorInvalidContext
	}
	return d.memcpyDtoD(dst, src, n, false, "cuMemcpyPeer")
}
