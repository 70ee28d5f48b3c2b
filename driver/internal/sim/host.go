package sim

import (
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Page-locked host memory and the copies between host and device memory
// on a stream.
//
// Work in the sim is synchronous (stream.go), so an async copy has
// completed when its call returns, from pinned memory as from pageable
// memory; what it checks is what the real driver checks: the stream (a live
// stream of this process, which names its own context, or a default stream
// with a current context), the device range, and the host pointer.

// hostState is the memory of cuMemHostAlloc: anonymous mappings outside
// the Go heap, as the real driver's are, so the safe layer can treat both
// alike. It has a lock of its own: host memory is not device state.
type hostState struct {
	mu     sync.Mutex
	blocks map[uintptr][]byte // by base address
}

// MemHostAlloc implements api.API. It needs a current context, as the real
// driver does; a size of 0 or a NULL pp is CUDA_ERROR_INVALID_VALUE, and
// unknown flags too. The memory is the process's: unlike the real driver,
// the sim does not free it with the context (nor at Deinit, so that a
// caller still holding it cannot fault), only with MemFreeHost.
func (d *Driver) MemHostAlloc(pp *unsafe.Pointer, bytesize uint64, flags uint32) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	const valid = api.MemHostAllocPortable | api.MemHostAllocDeviceMap | api.MemHostAllocWriteCombined
	if pp == nil || bytesize == 0 || flags&^valid != 0 {
		return api.ErrorInvalidValue
	}
	if r := d.rlock(); r != api.Success {
		return r
	}
	_, r := d.current()
	d.mu.RUnlock()
	if r != api.Success {
		return r
	}
	if bytesize > 1<<40 {
		return api.ErrorOutOfMemory
	}
	b, err := unix.Mmap(-1, 0, int(bytesize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return api.ErrorOutOfMemory
	}
	base := unsafe.Pointer(unsafe.SliceData(b))
	d.host.mu.Lock()
	if d.host.blocks == nil {
		d.host.blocks = make(map[uintptr][]byte)
	}
	d.host.blocks[uintptr(base)] = b
	d.host.mu.Unlock()
	*pp = base
	return api.Success
}

// MemFreeHost implements api.API: p must be what MemHostAlloc returned and
// not yet freed, else CUDA_ERROR_INVALID_VALUE.
func (d *Driver) MemFreeHost(p unsafe.Pointer) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	d.hostWaited() // cuMemFreeHost may wait for the device (pending.go)
	d.host.mu.Lock()
	b, ok := d.host.blocks[uintptr(p)]
	delete(d.host.blocks, uintptr(p))
	d.host.mu.Unlock()
	if !ok {
		return api.ErrorInvalidValue
	}
	if unix.Munmap(b) != nil {
		return api.ErrorUnknown
	}
	return api.Success
}

// MemcpyHtoDAsync implements api.API. The stream is checked before the
// size, so a bad stream is CUDA_ERROR_INVALID_HANDLE even for 0 bytes.
func (d *Driver) MemcpyHtoDAsync(dst api.DevicePtr, src unsafe.Pointer, n uint64, stream api.Stream) api.Result {
	return d.memcpyHost(dst, src, n, stream, true, true, "cuMemcpyHtoDAsync")
}

// MemcpyDtoHAsync implements api.API.
func (d *Driver) MemcpyDtoHAsync(dst unsafe.Pointer, src api.DevicePtr, n uint64, stream api.Stream) api.Result {
	return d.memcpyHost(src, dst, n, stream, true, false, "cuMemcpyDtoHAsync")
}
