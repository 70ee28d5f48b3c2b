package driver

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// DevicePtr is a CUdeviceptr: an address in this process's unified address
// space. It is only meaningful inside the process that got it.
type DevicePtr uint64

// IpcMemHandle is CUipcMemHandle: 64 opaque bytes that name an allocation
// to other processes.
type IpcMemHandle [api.IpcHandleSize]byte

// IpcEventHandle is CUipcEventHandle.
type IpcEventHandle [api.IpcHandleSize]byte

// Context is a retained primary context. Every method runs its driver call
// with this context current on a locked OS thread, so no call can land on
// another context whatever thread the goroutine is on. It is safe for
// concurrent use; Close waits for calls in flight.
type Context struct {
	a   api.API
	h   api.Context
	dev *Device

	// mu: calls hold it shared, Close exclusively, so the context cannot be
	// released under a call in flight.
	mu     sync.RWMutex
	closed bool
}

// Device is the context's device.
func (c *Context) Device() *Device { return c.dev }

// Handle is the raw CUcontext, for CUDA code outside this package (cgo,
// another binding) that must run in the same context: make it current
// there (cuCtxSetCurrent) on a locked OS thread. The context is retained
// until Close; code outside must not release or destroy it.
func (c *Context) Handle() uintptr { return uintptr(c.h) }

func (c *Context) String() string { return fmt.Sprintf("primary context of %s", c.dev) }

// enter pins the goroutine to its thread and makes c current there. Every
// successful enter must be followed by exit. It allocates nothing on success.
func (c *Context) enter() error {
	c.mu.RLock()
	if c.closed {
		c.mu.RUnlock()
		return ErrClosed
	}
	runtime.LockOSThread()
	if r := c.a.CtxSetCurrent(c.h); r != api.Success {
		runtime.UnlockOSThread()
		c.mu.RUnlock()
		return check(r, "cuCtxSetCurrent")
	}
	return nil
}

func (c *Context) exit() {
	runtime.UnlockOSThread()
	c.mu.RUnlock()
}

// Close releases the primary context (cuDevicePrimaryCtxRelease_v2). It is
// idempotent. Allocations made in it must be freed first.
func (c *Context) Close() error {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// Leave no thread pointing at a context that may now be destroyed.
	var cur api.Context
	if c.a.CtxGetCurrent(&cur) == api.Success && cur == c.h {
		c.a.CtxSetCurrent(0)
	}
	return check(c.a.DevicePrimaryCtxRelease(c.dev.h), "cuDevicePrimaryCtxRelease_v2")
}

// Synchronize is cuCtxSynchronize.
func (c *Context) Synchronize() error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.CtxSynchronize(), "cuCtxSynchronize")
}

// Alloc is cuMemAlloc_v2.
func (c *Context) Alloc(size uint64) (DevicePtr, error) {
	if err := c.enter(); err != nil {
		return 0, err
	}
	defer c.exit()
	var p api.DevicePtr
	if err := check(c.a.MemAlloc(&p, size), "cuMemAlloc_v2"); err != nil {
		return 0, fmt.Errorf("alloc %d bytes on %s: %w", size, c.dev, err)
	}
	return DevicePtr(p), nil
}

// Free is cuMemFree_v2.
func (c *Context) Free(p DevicePtr) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.MemFree(api.DevicePtr(p)), "cuMemFree_v2")
}

// MemInfo is cuMemGetInfo_v2: free and total bytes on the context's device.
func (c *Context) MemInfo() (free, total uint64, err error) {
	if err := c.enter(); err != nil {
		return 0, 0, err
	}
	defer c.exit()
	err = check(c.a.MemGetInfo(&free, &total), "cuMemGetInfo_v2")
	return free, total, err
}

// AddressRange is cuMemGetAddressRange_v2: the base and size of the
// allocation that contains p.
func (c *Context) AddressRange(p DevicePtr) (base DevicePtr, size uint64, err error) {
	if err := c.enter(); err != nil {
		return 0, 0, err
	}
	defer c.exit()
	var b api.DevicePtr
	err = check(c.a.MemGetAddressRange(&b, &size, api.DevicePtr(p)), "cuMemGetAddressRange_v2")
	return DevicePtr(b), size, err
}

// BufferID is CU_POINTER_ATTRIBUTE_BUFFER_ID: a number that the driver never
// gives to two allocations of a process, so a reused address shows up as a
// new id.
func (c *Context) BufferID(p DevicePtr) (uint64, error) {
	if err := c.enter(); err != nil {
		return 0, err
	}
	defer c.exit()
	var id uint64
	err := check(c.a.PointerGetAttribute(unsafe.Pointer(&id), api.PointerAttrBufferID, api.DevicePtr(p)), "cuPointerGetAttribute")
	return id, err
}

// Memset is cuMemsetD8_v2.
func (c *Context) Memset(p DevicePtr, value byte, n uint64) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.MemsetD8(api.DevicePtr(p), value, n), "cuMemsetD8_v2")
}

// MemsetAsync is cuMemsetD8Async on s (nil: the NULL stream).
func (c *Context) MemsetAsync(p DevicePtr, value byte, n uint64, s *Stream) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.MemsetD8Async(api.DevicePtr(p), value, n, s.handle()), "cuMemsetD8Async")
}

// CopyHtoD is cuMemcpyHtoD_v2 of all of src.
func (c *Context) CopyHtoD(dst DevicePtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.MemcpyHtoD(api.DevicePtr(dst), unsafe.Pointer(&src[0]), uint64(len(src))), "cuMemcpyHtoD_v2")
}

// CopyDtoH is cuMemcpyDtoH_v2 filling all of dst.
func (c *Context) CopyDtoH(dst []byte, src DevicePtr) error {
	if len(dst) == 0 {
		return nil
	}
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.MemcpyDtoH(unsafe.Pointer(&dst[0]), api.DevicePtr(src), uint64(len(dst))), "cuMemcpyDtoH_v2")
}

// CopyDtoD is cuMemcpyDtoD_v2.
func (c *Context) CopyDtoD(dst, src DevicePtr, n uint64) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.MemcpyDtoD(api.DevicePtr(dst), api.DevicePtr(src), n), "cuMemcpyDtoD_v2")
}

// CopyDtoDAsync is cuMemcpyDtoDAsync_v2 on s (nil: the NULL stream).
func (c *Context) CopyDtoDAsync(dst, src DevicePtr, n uint64, s *Stream) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.MemcpyDtoDAsync(api.DevicePtr(dst), api.DevicePtr(src), n, s.handle()), "cuMemcpyDtoDAsync_v2")
}

// EnablePeerAccess is cuCtxEnablePeerAccess: c may then access memory of
// peer's allocations. Access is one way.
func (c *Context) EnablePeerAccess(peer *Context) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.CtxEnablePeerAccess(peer.h, 0), "cuCtxEnablePeerAccess")
}

// DisablePeerAccess is cuCtxDisablePeerAccess.
func (c *Context) DisablePeerAccess(peer *Context) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.CtxDisablePeerAccess(peer.h), "cuCtxDisablePeerAccess")
}

// IpcGetMemHandle is cuIpcGetMemHandle. p must be the base of an allocation
// made with Alloc.
func (c *Context) IpcGetMemHandle(p DevicePtr) (IpcMemHandle, error) {
	if err := c.enter(); err != nil {
		return IpcMemHandle{}, err
	}
	defer c.exit()
	var h api.IpcMemHandle
	err := check(c.a.IpcGetMemHandle(&h, api.DevicePtr(p)), "cuIpcGetMemHandle")
	return IpcMemHandle(h.Reserved), err
}

// IpcOpenMemHandle is cuIpcOpenMemHandle_v2 with
// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, the one flag the driver accepts: a
// context on another device than the memory's gets peer access on demand.
// Opening a handle already open in this context returns the same pointer
// and counts one more reference.
func (c *Context) IpcOpenMemHandle(h IpcMemHandle) (DevicePtr, error) {
	if err := c.enter(); err != nil {
		return 0, err
	}
	defer c.exit()
	var p api.DevicePtr
	err := check(c.a.IpcOpenMemHandle(&p, api.IpcMemHandle{Reserved: h}, api.IpcMemLazyEnablePeerAccess), "cuIpcOpenMemHandle_v2")
	return DevicePtr(p), err
}

// IpcCloseMemHandle is cuIpcCloseMemHandle: drops one reference of a
// pointer from IpcOpenMemHandle; the mapping goes at zero.
func (c *Context) IpcCloseMemHandle(p DevicePtr) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.IpcCloseMemHandle(api.DevicePtr(p)), "cuIpcCloseMemHandle")
}
