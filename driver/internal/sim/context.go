package sim

import (
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// CUctx_flags: a scheduling mode in the low three bits (AUTO 0, SPIN 1,
// YIELD 2, BLOCKING_SYNC 4) plus MAP_HOST, LMEM_RESIZE_TO_MAX,
// COREDUMP_ENABLE, USER_COREDUMP_ENABLE and SYNC_MEMOPS.
const (
	ctxSchedMask  = 0x07
	ctxFlagsValid = 0xff
)

// newContext makes a context on local device dev. mu held.
func (d *Driver) newContext(dev api.Device, primary bool) (*ctxState, api.Result) {
	_, c, ok := d.ctxs.add(func(h uintptr) *ctxState {
		return &ctxState{
			h: api.Context(h), dev: dev, hdev: d.visible[dev], primary: primary,
			objs:      make(map[*memObj]struct{}),
			streams:   make(map[*streamState]struct{}),
			events:    make(map[*eventState]struct{}),
			peers:     make(map[*ctxState]struct{}),
			lazyPeers: make(map[int]struct{}),
		}
	})
	if !ok {
		return nil, api.ErrorOutOfMemory
	}
	d.contexts[c] = struct{}{}
	return c, api.Success
}

// liveContext resolves a context handle; destroyed and unknown handles give
// nil.
func (d *Driver) liveContext(h api.Context) *ctxState {
	c := d.ctxs.get(uintptr(h))
	if c == nil || c.destroyed.Load() {
		return nil
	}
	return c
}

// peerContext resolves the peer argument of cuCtxEnablePeerAccess and
// cuCtxDisablePeerAccess: an unknown handle is CUDA_ERROR_INVALID_CONTEXT,
// a destroyed context (or an inactive primary one)
// CUDA_ERROR_CONTEXT_IS_DESTROYED (measured for enable on an H100; the same
// for disable is unverified).
func (d *Driver) peerContext(h api.Context) (*ctxState, api.Result) {
	c := d.ctxs.get(uintptr(h))
	switch {
	case c == nil:
		return nil, api.ErrorInvalidContext
	case c.destroyed.Load():
		return nil, api.ErrorContextIsDestroyed
	}
	return c, api.Success
}

// destroyContext ends c and everything made in it: streams, events, peer
// access both ways, IPC mappings (closed) and allocations (freed). Freeing
// memory that another live process maps is a violation, unless the process
// is exiting (Deinit), which the sim treats as the process dying. The
// handle stays in the table, marked destroyed, so that it is told apart from
// garbage (and a primary context is found again by the next retain). mu
// held.
func (d *Driver) destroyContext(c *ctxState, exiting bool) {
	c.destroyed.Store(true)
	for s := range c.streams {
		d.streams.remove(uintptr(s.h))
	}
	for e := range c.events {
		d.events.remove(uintptr(e.h))
	}
	clear(c.streams)
	clear(c.events)
	clear(c.peers)
	clear(c.lazyPeers)
	for o := range d.contexts {
		delete(o.peers, c)
	}
	delete(d.contexts, c)
	if len(c.objs) == 0 {
		return
	}
	regOK := d.reg.lock() == nil
	l := d.live()
	for o := range c.objs {
		if o.imported {
			d.dropImport(o, regOK)
		} else {
			d.dropAllocation(o, regOK, l, !exiting)
		}
	}
	if regOK {
		d.reg.unlock()
	}
}

// reaches says whether c has peer access to host-global device hdev.
func (c *ctxState) reaches(hdev int) bool {
	if _, ok := c.lazyPeers[hdev]; ok {
		return true
	}
	for p := range c.peers {
		if p.hdev == hdev {
			return true
		}
	}
	return false
}

// peerDevices counts the distinct devices c has peer access to: the
// resource that CUDA_ERROR_TOO_MANY_PEERS runs out of.
func (c *ctxState) peerDevices() int {
	n := len(c.lazyPeers)
	seen := make(map[int]struct{}, len(c.peers))
	for p := range c.peers {
		if _, lazy := c.lazyPeers[p.hdev]; !lazy {
			seen[p.hdev] = struct{}{}
		}
	}
	return n + len(seen)
}

// DevicePrimaryCtxRetain implements api.API.
func (d *Driver) DevicePrimaryCtxRetain(ctx *api.Context, dev api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if ctx == nil {
		return api.ErrorInvalidValue
	}
	if _, ok := d.device(dev); !ok {
		return api.ErrorInvalidDevice
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	c := d.primary[dev]
	switch {
	case c == nil:
		var r api.Result
		if c, r = d.newContext(dev, true); r != api.Success {
			return r
		}
		d.primary[dev] = c
	case d.primaryRefs[dev] == 0:
		c.destroyed.Store(false)
		d.contexts[c] = struct{}{}
	}
	d.primaryRefs[dev]++
	*ctx = c.h
	return api.Success
}

// DevicePrimaryCtxRelease implements api.API. The release that drops the
// count to zero destroys what the context holds and leaves it inactive: a
// thread that has it current gets CUDA_ERROR_CONTEXT_IS_DESTROYED until a
// retain activates it again under the same handle (all measured). Releasing
// a primary context that is not retained is CUDA_ERROR_INVALID_CONTEXT
// (measured).
func (d *Driver) DevicePrimaryCtxRelease(dev api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if _, ok := d.device(dev); !ok {
		return api.ErrorInvalidDevice
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	if d.primaryRefs[dev] == 0 {
		return api.ErrorInvalidContext
	}
	if d.primaryRefs[dev]--; d.primaryRefs[dev] == 0 {
		d.hostWaited() // destroying it waits for its work (pending.go)
		d.destroyContext(d.primary[dev], false)
	}
	return api.Success
}

// pushCurrent makes c current on thread tid above the context current
// there, as cuCtxCreate does. mu held.
func (d *Driver) pushCurrent(tid int32, c *ctxState) {
	if top := d.threads.get(tid); top != nil {
		d.stacks[tid] = append(d.stacks[tid], top)
		d.stacked.Add(1)
	}
	d.threads.set(tid, c)
}

// popCurrent pops thread tid's context stack: the context below the top, if
// any, becomes current. mu held.
func (d *Driver) popCurrent(tid int32) {
	var next *ctxState
	if s := d.stacks[tid]; len(s) > 0 {
		next = s[len(s)-1]
		if len(s) == 1 {
			delete(d.stacks, tid)
		} else {
			d.stacks[tid] = s[:len(s)-1]
		}
		d.stacked.Add(-1)
	}
	d.threads.set(tid, next)
}

// CtxCreate implements api.API: the new context is pushed on the calling
// thread's context stack (measured). Order: ctx, flags, device. Flags are
// checked against the CUctx_flags of cuda.h (unverified).
func (d *Driver) CtxCreate(ctx *api.Context, flags uint32, dev api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if ctx == nil || flags&^ctxFlagsValid != 0 || flags&ctxSchedMask == 3 || flags&ctxSchedMask > 4 {
		return api.ErrorInvalidValue
	}
	if _, ok := d.device(dev); !ok {
		return api.ErrorInvalidDevice
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	c, r := d.newContext(dev, false)
	if r != api.Success {
		return r
	}
	d.pushCurrent(gettid(), c)
	*ctx = c.h
	return api.Success
}

// CtxDestroy implements api.API. When the context is current on the calling
// thread it is popped, and the one below it becomes current (measured);
// other threads that have it current get CUDA_ERROR_CONTEXT_IS_DESTROYED. A
// primary context cannot be destroyed this way: CUDA_ERROR_INVALID_CONTEXT
// (measured).
func (d *Driver) CtxDestroy(ctx api.Context) api.Result {
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	c := d.liveContext(ctx)
	if c == nil || c.primary {
		return api.ErrorInvalidContext
	}
	d.hostWaited() // it waits for the context's work (pending.go)
	d.destroyContext(c, false)
	if tid := gettid(); d.threads.get(tid) == c {
		d.popCurrent(tid)
	}
	return api.Success
}

// CtxSetCurrent implements api.API. It replaces the top of the calling
// thread's context stack; zero pops it (measured: the context below becomes
// current). An inactive primary context may be made current, its handle
// staying valid, and calls then give CUDA_ERROR_CONTEXT_IS_DESTROYED
// (measured). A destroyed context is CUDA_ERROR_INVALID_CONTEXT
// (unverified).
func (d *Driver) CtxSetCurrent(ctx api.Context) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	tid := gettid()
	if ctx != 0 {
		c := d.ctxs.get(uintptr(ctx))
		if c == nil || c.destroyed.Load() && !c.primary {
			return api.ErrorInvalidContext
		}
		d.threads.set(tid, c)
		return api.Success
	}
	if d.stacked.Load() == 0 {
		d.threads.set(tid, nil)
		return api.Success
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	d.popCurrent(tid)
	return api.Success
}

// CtxGetCurrent implements api.API: zero when none is current, and the
// handle of a destroyed context that is still current.
func (d *Driver) CtxGetCurrent(ctx *api.Context) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if ctx == nil {
		return api.ErrorInvalidValue
	}
	*ctx = 0
	if c := d.threads.get(gettid()); c != nil {
		*ctx = c.h
	}
	return api.Success
}

// CtxGetDevice implements api.API.
func (d *Driver) CtxGetDevice(dev *api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if dev == nil {
		return api.ErrorInvalidValue
	}
	c, r := d.current()
	if r != api.Success {
		return r
	}
	*dev = c.dev
	return api.Success
}

// CtxSynchronize implements api.API. Work is synchronous in the sim.
func (d *Driver) CtxSynchronize() api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if _, r := d.current(); r != api.Success {
		return r
	}
	d.hostWaited()
	return api.Success
}

// CtxEnablePeerAccess implements api.API. Order: flags, current context,
// peer context, device pair, already enabled, peer limit. A context and
// itself, or two contexts on one device: cuDeviceCanAccessPeer(dev, dev) is
// 0, so CUDA_ERROR_PEER_ACCESS_UNSUPPORTED (both measured; the page says
// INVALID_CONTEXT for the first, the driver does not).
func (d *Driver) CtxEnablePeerAccess(peer api.Context, flags uint32) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if flags != 0 {
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
	p, r := d.peerContext(peer)
	if r != api.Success {
		return r
	}
	if !d.m.links[cur.hdev][p.hdev].access {
		return api.ErrorPeerAccessUnsupported
	}
	if _, ok := cur.peers[p]; ok {
		return api.ErrorPeerAccessAlreadyEnabled
	}
	if !cur.reaches(p.hdev) && cur.peerDevices() >= d.m.maxPeers {
		return api.ErrorTooManyPeers
	}
	cur.peers[p] = struct{}{}
	return api.Success
}

// CtxDisablePeerAccess implements api.API. Access that an IPC open enabled
// lazily is not the peer context's and stays.
func (d *Driver) CtxDisablePeerAccess(peer api.Context) api.Result {
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	cur, r := d.current()
	if r != api.Success {
		return r
	}
	p, r := d.peerContext(peer)
	if r != api.Success {
		return r
	}
	if _, ok := cur.peers[p]; !ok {
		return api.ErrorPeerAccessNotEnabled
	}
	delete(cur.peers, p)
	return api.Success
}

// link resolves two local ordinals to their host-global link. The P2P
// queries check out-pointers first (CUDA_ERROR_INVALID_VALUE), then the
// devices (CUDA_ERROR_INVALID_DEVICE), then the attribute or operations
// (CUDA_ERROR_INVALID_VALUE): measured on driver 580 with an invalid
// attribute on the same device (INVALID_DEVICE), a nil value with a bad
// device (INVALID_VALUE) and a bad operation on the same device
// (INVALID_DEVICE).
func (d *Driver) link(src, dst api.Device) (*link, api.Result) {
	if _, ok := d.device(src); !ok {
		return nil, api.ErrorInvalidDevice
	}
	if _, ok := d.device(dst); !ok || src == dst {
		return nil, api.ErrorInvalidDevice
	}
	return &d.m.links[d.visible[src]][d.visible[dst]], api.Success
}

// DeviceCanAccessPeer implements api.API. A device and itself: 0, as the
// real driver answers.
func (d *Driver) DeviceCanAccessPeer(canAccess *int32, dev, peerDev api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if canAccess == nil {
		return api.ErrorInvalidValue
	}
	if _, ok := d.device(dev); !ok {
		return api.ErrorInvalidDevice
	}
	if _, ok := d.device(peerDev); !ok {
		return api.ErrorInvalidDevice
	}
	*canAccess = 0
	if dev != peerDev && d.m.links[d.visible[dev]][d.visible[peerDev]].access {
		*canAccess = 1
	}
	return api.Success
}

// DeviceGetP2PAttribute implements api.API. Order: value, devices,
// attribute (measured).
func (d *Driver) DeviceGetP2PAttribute(value *int32, attrib int32, src, dst api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if value == nil {
		return api.ErrorInvalidValue
	}
	l, r := d.link(src, dst)
	if r != api.Success {
		return r
	}
	if attrib < api.P2PAttrPerformanceRank || attrib > api.P2PAttrOnlyPartialNativeAtomicSupported {
		return api.ErrorInvalidValue
	}
	var v bool
	switch attrib {
	case api.P2PAttrPerformanceRank:
		*value = l.perfRank
		return api.Success
	case api.P2PAttrAccessSupported:
		v = l.access
	case api.P2PAttrNativeAtomicSupported:
		v = l.nativeAtomic
	case api.P2PAttrCudaArrayAccessSupported:
		v = l.arrayAccess
	case api.P2PAttrOnlyPartialNativeAtomicSupported:
		v = l.partialAtomic
	}
	*value = 0
	if v {
		*value = 1
	}
	return api.Success
}

// DeviceGetP2PAtomicCapabilities implements api.API. Order: capabilities,
// operations, count, devices, then each operation (devices before
// operations: measured).
func (d *Driver) DeviceGetP2PAtomicCapabilities(capabilities *uint32, operations *int32, count uint32, src, dst api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if capabilities == nil || operations == nil || count == 0 {
		return api.ErrorInvalidValue
	}
	l, r := d.link(src, dst)
	if r != api.Success {
		return r
	}
	ops := unsafe.Slice(operations, count)
	for _, op := range ops {
		if op < 0 || op >= api.AtomicOperationCount {
			return api.ErrorInvalidValue
		}
	}
	caps := unsafe.Slice(capabilities, count)
	for i, op := range ops {
		caps[i] = l.atomicCaps[op]
	}
	return api.Success
}
