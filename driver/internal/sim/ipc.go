package sim

import (
	"encoding/binary"
	"fmt"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// IPC handle layout (64 bytes, little-endian):
//
//	[0:4]   "CSIM"
//	[4]     version (1)
//	[5]     kind: 'M' memory, 'E' event
//	[8:12]  registry slot          (memory)
//	[12:16] host-global device     (memory)
//	[16:24] global buffer id       (memory) or event serial (event)
//	[24:32] allocation nonce       (memory)
//	[32:48] exporter: pid, instance, process start time
//	[48:52] exporter's PID namespace (inode; 0 if unknown)
//	[52:56] zero
//	[56:64] checksum: FNV-1a of the machine's secret and bytes [0:56]
//
// The checksum makes a garbage handle, or one minted for another state
// directory, fail as CUDA_ERROR_INVALID_VALUE rather than name a slot.
const (
	ipcMagic      = "CSIM"
	ipcVersion    = 2
	ipcKindMem    = 'M'
	ipcKindEvent  = 'E'
	ipcSumOffset  = 56
	fnvOffset64   = 14695981039346656037
	fnvPrime64    = 1099511628211
	ipcSecretSize = 8
)

type ipcFields struct {
	kind   byte
	slot   uint32
	dev    uint32
	id     uint64
	nonce  uint64
	origin procID
	ns     uint32 // the exporter's PID namespace
}

func (d *Driver) ipcSum(b *[api.IpcHandleSize]byte) uint64 {
	h := uint64(fnvOffset64)
	for i := range ipcSecretSize {
		h = (h ^ uint64(byte(d.secret>>(8*i)))) * fnvPrime64
	}
	for _, c := range b[:ipcSumOffset] {
		h = (h ^ uint64(c)) * fnvPrime64
	}
	return h
}

func (d *Driver) encodeIPC(f ipcFields) [api.IpcHandleSize]byte {
	var b [api.IpcHandleSize]byte
	le := binary.LittleEndian
	copy(b[0:4], ipcMagic)
	b[4], b[5] = ipcVersion, f.kind
	le.PutUint32(b[8:], f.slot)
	le.PutUint32(b[12:], f.dev)
	le.PutUint64(b[16:], f.id)
	le.PutUint64(b[24:], f.nonce)
	le.PutUint32(b[32:], uint32(f.origin.pid))
	le.PutUint32(b[36:], f.origin.inst)
	le.PutUint64(b[40:], f.origin.start)
	le.PutUint32(b[48:], f.ns)
	le.PutUint64(b[ipcSumOffset:], d.ipcSum(&b))
	return b
}

func (d *Driver) decodeIPC(b [api.IpcHandleSize]byte, kind byte) (ipcFields, bool) {
	le := binary.LittleEndian
	if string(b[0:4]) != ipcMagic || b[4] != ipcVersion || b[5] != kind || le.Uint64(b[ipcSumOffset:]) != d.ipcSum(&b) {
		return ipcFields{}, false
	}
	return ipcFields{
		kind: kind, slot: le.Uint32(b[8:]), dev: le.Uint32(b[12:]), id: le.Uint64(b[16:]), nonce: le.Uint64(b[24:]),
		origin: procID{pid: int32(le.Uint32(b[32:])), inst: le.Uint32(b[36:]), start: le.Uint64(b[40:])},
		ns:     le.Uint32(b[48:]),
	}, true
}

// importKey finds the mapping of a buffer in a context, for re-opens.
type importKey struct {
	ctx *ctxState
	gid uint64
}

// bindKey and binding enforce "CUipcMemHandles from each CUdevice in a given
// process may only be opened by one CUcontext per CUdevice per other
// process": handles of exporter on exporterDev are bound to one context on
// importerDev while that context holds a mapping of one of them. Measured on
// driver 580: another context opening any handle of that exporter and device
// gets CUDA_ERROR_INVALID_HANDLE, whichever context (primary or not) came
// first; one context may hold handles of several exporters; the binding ends
// when its last mapping is closed.
type bindKey struct {
	exporter    procID
	exporterDev int
	importerDev int
}

type binding struct {
	ctx *ctxState
	n   int // mappings held
}

// dropImport unmaps IPC mapping o whatever its count. mu held; registry lock
// held when regOK.
func (d *Driver) dropImport(o *memObj, regOK bool) {
	d.forget(o)
	if regOK && d.slotIsOurs(o) {
		d.reg.dropMapper(o.slot, d.self)
	}
	delete(d.imports, importKey{o.ctx, o.gid})
	if b := d.binds[o.bind]; b != nil {
		if b.n--; b.n == 0 {
			delete(d.binds, o.bind)
		}
	}
	d.removeObj(o, kindAccessAfterClose)
}

// IpcGetMemHandle implements api.API. Any pointer into an allocation of
// this process names the whole allocation (measured: the same handle); an
// IPC mapping cannot be exported again (CUDA_ERROR_INVALID_VALUE, measured).
// A current context is required (measured), any will do.
func (d *Driver) IpcGetMemHandle(handle *api.IpcMemHandle, dptr api.DevicePtr) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if handle == nil {
		return api.ErrorInvalidValue
	}
	if r := d.rlock(); r != api.Success {
		return r
	}
	defer d.mu.RUnlock()
	if _, r := d.current(); r != api.Success {
		return r
	}
	o := d.space.find(uint64(dptr))
	if o == nil || o.imported || o.vmm != nil {
		// A VMM mapping has no legacy IPC handle (unverified code).
		return api.ErrorInvalidValue
	}
	handle.Reserved = d.encodeIPC(ipcFields{
		kind: ipcKindMem, slot: uint32(o.slot), dev: uint32(o.hdev), id: o.gid, nonce: o.nonce,
		origin: d.self, ns: selfNS(),
	})
	return api.Success
}

// IpcOpenMemHandle implements api.API. Order of checks: pointer and flags
// (CUDA_ERROR_INVALID_VALUE, measured for flags 0 and 2), current context,
// handle format (all-zero or random: CUDA_ERROR_INVALID_VALUE, measured),
// re-open in this context (count up, same pointer and buffer id: measured),
// handle staleness, exporter is this process (CUDA_ERROR_INVALID_CONTEXT,
// measured), one context per device per exporter
// (CUDA_ERROR_INVALID_HANDLE, measured), peer access, mapping.
func (d *Driver) IpcOpenMemHandle(dptr *api.DevicePtr, handle api.IpcMemHandle, flags uint32) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if dptr == nil || flags != api.IpcMemLazyEnablePeerAccess {
		return api.ErrorInvalidValue
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	cur, r := d.current()
	if r != api.Success {
		return r
	}
	f, ok := d.decodeIPC(handle.Reserved, ipcKindMem)
	if !ok || f.slot >= regSlots || int(f.dev) >= len(d.m.devices) {
		return api.ErrorInvalidValue
	}
	if o := d.imports[importKey{cur, f.id}]; o != nil {
		o.refs++
		*dptr = api.DevicePtr(o.base)
		return api.Success
	}
	if d.reg.lock() != nil {
		return api.ErrorUnknown
	}
	defer d.reg.unlock()
	l := d.live()
	i := int(f.slot)
	d.reg.sweepSlot(i, l)
	s := d.reg.slot(i)
	if s.state != slotLive || s.id != f.id || s.nonce != f.nonce || s.dev != f.dev {
		// The exporter exited: CUDA_ERROR_INVALID_HANDLE (measured on an
		// H100 for a process that never mapped from it; when the importer
		// still mapped another allocation of the dead exporter, the real
		// driver was seen to open the handle, and the sim refuses: a handle
		// must not outlive its exporter). The exporter lives but freed the
		// allocation, or destroyed its context: CUDA_ERROR_INVALID_VALUE
		// (measured).
		if !l.aliveIn(f.origin, f.ns) {
			return api.ErrorInvalidHandle
		}
		return api.ErrorInvalidValue
	}
	if s.owner == d.self {
		return api.ErrorInvalidContext
	}
	if !nsRelated(s.ownerNS) {
		// Exporter and importer in sibling PID namespaces (two containers):
		// CUDA_ERROR_INVALID_CONTEXT (measured on two H200s, GPU.md).
		// Parent and child namespaces, either way, open.
		return api.ErrorInvalidContext
	}
	hdev := int(s.dev)
	bk := bindKey{exporter: s.owner, exporterDev: hdev, importerDev: cur.hdev}
	if b := d.binds[bk]; b != nil && b.ctx != cur {
		return api.ErrorInvalidHandle
	}
	lazy := hdev != cur.hdev && !cur.reaches(hdev)
	if lazy {
		// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: enable access to the memory's
		// device for this context. Measured: the open succeeds across
		// devices, and the access it enables is not the peer context's
		// (cuCtxEnablePeerAccess to a context on that device still
		// succeeds). A pair without access is
		// CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, and the lazily enabled device
		// counts toward CUDA_ERROR_TOO_MANY_PEERS (both unverified: no probe
		// machine lacks peer access or has more than 8 GPUs).
		if !d.m.links[cur.hdev][hdev].access {
			return api.ErrorPeerAccessUnsupported
		}
		if cur.peerDevices() >= d.m.maxPeers {
			return api.ErrorTooManyPeers
		}
	}
	base, ok := d.space.reserve(hdev, s.span)
	if !ok {
		return api.ErrorMapFailed
	}
	if !d.reg.addMapper(i, l) {
		return api.ErrorMapFailed
	}
	data, err := mapBuffer(d.reg.bufferPath(s.id), s.size, false)
	if err != nil {
		d.reg.dropMapper(i, d.self)
		return api.ErrorMapFailed
	}
	if lazy {
		cur.lazyPeers[hdev] = struct{}{}
	}
	o := &memObj{
		base: base, size: s.size, span: s.span, hdev: hdev, ctx: cur, data: data,
		slot: i, gid: s.id, nonce: s.nonce, imported: true, refs: 1, bind: bk,
	}
	d.addObj(o)
	d.imports[importKey{cur, o.gid}] = o
	b := d.binds[bk]
	if b == nil {
		b = &binding{ctx: cur}
		d.binds[bk] = b
	}
	b.n++
	*dptr = api.DevicePtr(base)
	return api.Success
}

// IpcCloseMemHandle implements api.API. It takes the pointer an open
// returned; each close undoes one open and the last unmaps. Any other
// pointer (never opened, already closed, an allocation) is
// CUDA_ERROR_INVALID_VALUE (measured for a third close after two opens) and
// a "close-unopened" violation. A current context is required (unverified),
// but any will do (measured: another context's mapping closes).
func (d *Driver) IpcCloseMemHandle(dptr api.DevicePtr) api.Result {
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	if _, r := d.current(); r != api.Success {
		return r
	}
	o := d.space.find(uint64(dptr))
	if o == nil || o.base != uint64(dptr) || !o.imported {
		d.violate(kindCloseUnopened, fmt.Sprintf("cuIpcCloseMemHandle(%#x): no IPC mapping opened at that address", uint64(dptr)))
		return api.ErrorInvalidValue
	}
	if o.refs--; o.refs > 0 {
		return api.Success
	}
	d.closing(o, "cuIpcCloseMemHandle")
	regOK := d.reg.lock() == nil
	d.dropImport(o, regOK)
	if regOK {
		d.reg.unlock()
	}
	return api.Success
}

// IpcGetEventHandle implements api.API. The event must have been created
// with CU_EVENT_INTERPROCESS, else CUDA_ERROR_INVALID_HANDLE (measured on an
// H100). A current context is required (measured).
func (d *Driver) IpcGetEventHandle(handle *api.IpcEventHandle, event api.Event) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if handle == nil {
		return api.ErrorInvalidValue
	}
	if _, r := d.current(); r != api.Success {
		return r
	}
	e := d.events.get(uintptr(event))
	if e == nil {
		return api.ErrorInvalidHandle
	}
	if e.flags&api.EventInterprocess == 0 {
		return api.ErrorInvalidHandle
	}
	handle.Reserved = d.encodeIPC(ipcFields{kind: ipcKindEvent, id: e.serial, origin: e.origin, ns: selfNS()})
	return api.Success
}

// IpcOpenEventHandle implements api.API. The opened event belongs to the
// current context and, work being synchronous, is always complete. A
// malformed handle (all-zero or random) is CUDA_ERROR_MAP_FAILED, and
// opening in the exporting process, or in a sibling PID namespace of the
// exporter's, CUDA_ERROR_INVALID_CONTEXT (all measured). Whether the exporter still lives, or still has the event, is
// not checked (unverified: the real driver may refuse).
func (d *Driver) IpcOpenEventHandle(event *api.Event, handle api.IpcEventHandle) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if event == nil {
		return api.ErrorInvalidValue
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	cur, r := d.current()
	if r != api.Success {
		return r
	}
	f, ok := d.decodeIPC(handle.Reserved, ipcKindEvent)
	if !ok {
		return api.ErrorMapFailed
	}
	// The process identity includes the PID namespace: the first
	// processes of two sibling namespaces can share pid, instance and
	// start tick.
	if f.origin == d.self && f.ns == selfNS() {
		return api.ErrorInvalidContext
	}
	if !nsRelated(f.ns) {
		// Sibling PID namespaces (two containers): refused as memory
		// handles are (measured on an H100, driver 580).
		return api.ErrorInvalidContext
	}
	e, r := d.newEvent(cur, api.EventDisableTiming|api.EventInterprocess, f.origin, f.id)
	if r != api.Success {
		return r
	}
	*event = e.h
	return api.Success
}
