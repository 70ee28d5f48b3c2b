package driver

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// HostBuffer is page-locked ("pinned") host memory from cuMemHostAlloc:
// memory the GPU reaches by DMA, so that copies from and to it on a stream
// are truly asynchronous. It is not Go memory: the garbage collector does
// not see it, and Close frees it.
type HostBuffer struct {
	ctx *Context

	mu sync.Mutex // Close against Bytes
	p  unsafe.Pointer
	b  []byte
}

// AllocHost is cuMemHostAlloc of size bytes with CU_MEMHOSTALLOC_PORTABLE:
// pinned memory that every context of the process may copy from and to.
// Pinned memory is a scarce resource of the whole machine (it cannot be
// swapped): allocate it once and reuse it, not per copy.
func (c *Context) AllocHost(size uint64) (*HostBuffer, error) {
	if err := c.enter(); err != nil {
		return nil, err
	}
	defer c.exit()
	var p unsafe.Pointer
	if err := check(c.a.MemHostAlloc(&p, size, api.MemHostAllocPortable), "cuMemHostAlloc"); err != nil {
		return nil, fmt.Errorf("pinned host memory of %d bytes: %w", size, err)
	}
	return &HostBuffer{ctx: c, p: p, b: unsafe.Slice((*byte)(p), size)}, nil
}

// Bytes is the memory, valid until Close; nil after it. Work queued on a
// stream that copies from or to it must be complete before Close.
func (h *HostBuffer) Bytes() []byte {
	if h == nil {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.b
}

// Close is cuMemFreeHost; idempotent and nil-safe. It does not wait for
// copies queued on streams: synchronize them first.
func (h *HostBuffer) Close() error {
	if h == nil {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.p == nil {
		return nil
	}
	p := h.p
	h.p, h.b = nil, nil
	if err := h.ctx.enter(); err != nil {
		return err
	}
	defer h.ctx.exit()
	return check(h.ctx.a.MemFreeHost(p), "cuMemFreeHost")
}

// CopyHtoDAsync is cuMemcpyHtoDAsync_v2 of all of src to dst, queued on s
// (nil: the NULL stream).
//
// # Memory
//
// When src is in a HostBuffer, the copy is asynchronous: it runs when s
// reaches it, and src must not be changed, nor its HostBuffer closed, until
// then (synchronize s, or an event recorded after the copy). Any other src
// (Go memory) is pageable: the driver is done with it when the call
// returns (it stages the bytes, waiting for s first if it must), so src may
// be reused at once, but the copy costs host time and may not overlap
// other work. A copy on a stream is ordered with the rest of the stream
// either way.
func (c *Context) CopyHtoDAsync(dst DevicePtr, src []byte, s *Stream) error {
	if len(src) == 0 {
		return nil
	}
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.MemcpyHtoDAsync(api.DevicePtr(dst), unsafe.Pointer(&src[0]), uint64(len(src)), s.handle()), "cuMemcpyHtoDAsync_v2")
}

// CopyDtoHAsync is cuMemcpyDtoHAsync_v2 filling all of dst from src, queued
// on s (nil: the NULL stream).
//
// # Memory
//
// When dst is in a HostBuffer, the copy is asynchronous: dst holds the
// bytes only once s has run the copy (synchronize s, or an event recorded
// after it), and the HostBuffer must not be closed before. Any other dst
// (Go memory) is pageable: the driver completes the copy before the call
// returns, so it is synchronous with the host.
func (c *Context) CopyDtoHAsync(dst []byte, src DevicePtr, s *Stream) error {
	if len(dst) == 0 {
		return nil
	}
	if err := c.enter(); err != nil {
		return err
	}
	defer c.exit()
	return check(c.a.MemcpyDtoHAsync(unsafe.Pointer(&dst[0]), api.DevicePtr(src), uint64(len(dst)), s.handle()), "cuMemcpyDtoHAsync_v2")
}
