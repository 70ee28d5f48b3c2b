package driver

import (
	"bytes"
	"testing"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Conformance cases for the calls that let cudashare join CUDA work made
// elsewhere: the async copies between host and device, page-locked host
// memory, and cuStreamGetCtx (how WrapStream checks a foreign stream).
// The codes are those of the CUDA 13.0 reference pages (group CUDA_MEM and
// CUDA_STREAM). These cases have not run on a GPU yet: the first run on
// the GPU machine decides, and the simulator changes where they disagree.

const notRealDeadHandle = "a destroyed or made-up CUstream is undefined on the real driver (a pointer to freed driver state; it may crash)"

// asyncFix is device 0's primary context, current on a locked thread, a
// stream of it and a 64 KiB allocation, undone when the test ends.
type asyncFix struct {
	ctx    api.Context
	stream api.Stream
	p      api.DevicePtr
}

const asyncSize = 64 << 10

func newAsyncFix(t *testing.T, e *confEnv) *asyncFix {
	t.Helper()
	e.needDevices(t, 1)
	lockThread(t)
	f := &asyncFix{ctx: e.primary(t, 0)}
	e.setCurrent(t, f.ctx)
	if r := e.a.StreamCreate(&f.stream, api.StreamNonBlocking); r != api.Success {
		t.Fatalf("cuStreamCreate: %s", r.Name())
	}
	t.Cleanup(func() { e.a.CtxSetCurrent(f.ctx); e.a.StreamDestroy(f.stream) })
	f.p = e.alloc(t, f.ctx, asyncSize)
	return f
}

// hostAlloc is cuMemHostAlloc, freed when the test ends.
func (f *asyncFix) hostAlloc(t *testing.T, e *confEnv, n uint64) []byte {
	t.Helper()
	var p unsafe.Pointer
	if r := e.a.MemHostAlloc(&p, n, api.MemHostAllocPortable); r != api.Success {
		t.Fatalf("cuMemHostAlloc: %s", r.Name())
	}
	t.Cleanup(func() { e.a.CtxSetCurrent(f.ctx); e.a.MemFreeHost(p) })
	return unsafe.Slice((*byte)(p), n)
}

// deadStream is a stream handle destroyed already.
func (f *asyncFix) deadStream(t *testing.T, e *confEnv) api.Stream {
	t.Helper()
	var s api.Stream
	if r := e.a.StreamCreate(&s, 0); r != api.Success {
		t.Fatalf("cuStreamCreate: %s", r.Name())
	}
	if r := e.a.StreamDestroy(s); r != api.Success {
		t.Fatalf("cuStreamDestroy: %s", r.Name())
	}
	return s
}

func asyncCases() []confCase {
	var cs []confCase
	add := func(c confCase) { cs = append(cs, c) }

	type copyFn func(e *confEnv, host unsafe.Pointer, dev api.DevicePtr, n uint64, s api.Stream) api.Result
	copies := []struct {
		fn string
		do copyFn
	}{
		{"cuMemcpyHtoDAsync_v2", func(e *confEnv, h unsafe.Pointer, d api.DevicePtr, n uint64, s api.Stream) api.Result {
			return e.a.MemcpyHtoDAsync(d, h, n, s)
		}},
		{"cuMemcpyDtoHAsync_v2", func(e *confEnv, h unsafe.Pointer, d api.DevicePtr, n uint64, s api.Stream) api.Result {
			return e.a.MemcpyDtoHAsync(h, d, n, s)
		}},
	}
	for _, c := range copies {
		c := c
		add(confCase{fn: c.fn, code: api.Success, what: "pinned host memory, a stream of the context, then a stream synchronize",
			run: func(t *testing.T, e *confEnv) api.Result {
				f := newAsyncFix(t, e)
				h := f.hostAlloc(t, e, asyncSize)
				for i := range h {
					h[i] = byte(i * 5)
				}
				want := bytes.Clone(h)
				if c.fn == "cuMemcpyDtoHAsync_v2" {
					// Put the pattern on the device first, then clear h.
					if r := e.a.MemcpyHtoD(f.p, unsafe.Pointer(&h[0]), asyncSize); r != api.Success {
						t.Fatalf("cuMemcpyHtoD_v2: %s", r.Name())
					}
					clear(h)
				}
				if r := c.do(e, unsafe.Pointer(&h[0]), f.p, asyncSize, f.stream); r != api.Success {
					return r
				}
				if r := e.a.StreamSynchronize(f.stream); r != api.Success {
					t.Fatalf("cuStreamSynchronize: %s", r.Name())
				}
				got := h
				if c.fn == "cuMemcpyHtoDAsync_v2" {
					got = make([]byte, asyncSize)
					if r := e.a.MemcpyDtoH(unsafe.Pointer(&got[0]), f.p, asyncSize); r != api.Success {
						t.Fatalf("cuMemcpyDtoH_v2: %s", r.Name())
					}
				}
				if !bytes.Equal(got, want) {
					t.Error("the bytes did not arrive")
				}
				return api.Success
			}})
		add(confCase{fn: c.fn, code: api.Success, what: "pageable (Go) memory on the NULL stream",
			run: func(t *testing.T, e *confEnv) api.Result {
				f := newAsyncFix(t, e)
				h := make([]byte, 4096)
				return c.do(e, unsafe.Pointer(&h[0]), f.p, 4096, 0)
			}})
		add(confCase{fn: c.fn, code: api.Success, what: "0 bytes",
			run: func(t *testing.T, e *confEnv) api.Result {
				f := newAsyncFix(t, e)
				h := make([]byte, 1)
				return c.do(e, unsafe.Pointer(&h[0]), f.p, 0, f.stream)
			}})
		add(confCase{fn: c.fn, code: api.ErrorInvalidValue, what: "the host pointer is NULL",
			run: func(t *testing.T, e *confEnv) api.Result {
				f := newAsyncFix(t, e)
				return c.do(e, nil, f.p, 4096, f.stream)
			}})
		add(confCase{fn: c.fn, code: api.ErrorInvalidValue, what: "the device pointer is 0",
			run: func(t *testing.T, e *confEnv) api.Result {
				f := newAsyncFix(t, e)
				h := make([]byte, 4096)
				return c.do(e, unsafe.Pointer(&h[0]), 0, 4096, f.stream)
			}})
		add(confCase{fn: c.fn, code: api.ErrorInvalidValue, what: "past the end of the allocation",
			run: func(t *testing.T, e *confEnv) api.Result {
				f := newAsyncFix(t, e)
				h := make([]byte, 2)
				return c.do(e, unsafe.Pointer(&h[0]), f.p+asyncSize-1, 2, f.stream)
			}})
		add(confCase{fn: c.fn, code: api.ErrorInvalidHandle, what: "a destroyed stream", notReal: notRealDeadHandle,
			run: func(t *testing.T, e *confEnv) api.Result {
				f := newAsyncFix(t, e)
				h := make([]byte, 4096)
				return c.do(e, unsafe.Pointer(&h[0]), f.p, 4096, f.deadStream(t, e))
			}})
		add(confCase{fn: c.fn, code: api.ErrorInvalidContext, what: "the NULL stream with no current context",
			run: func(t *testing.T, e *confEnv) api.Result {
				f := newAsyncFix(t, e)
				h := make([]byte, 4096)
				e.setCurrent(t, 0)
				return c.do(e, unsafe.Pointer(&h[0]), f.p, 4096, 0)
			}})
	}

	add(confCase{fn: "cuMemHostAlloc", code: api.Success, what: "portable, 1 MiB, writable from the host",
		run: func(t *testing.T, e *confEnv) api.Result {
			f := newAsyncFix(t, e)
			h := f.hostAlloc(t, e, 1<<20)
			h[0], h[len(h)-1] = 1, 2
			return api.Success
		}})
	add(confCase{fn: "cuMemHostAlloc", code: api.ErrorInvalidValue, what: "pp is NULL",
		run: func(t *testing.T, e *confEnv) api.Result {
			newAsyncFix(t, e)
			return e.a.MemHostAlloc(nil, 4096, 0)
		}})
	add(confCase{fn: "cuMemHostAlloc", code: api.ErrorInvalidValue, what: "an unknown flag (0x80)",
		run: func(t *testing.T, e *confEnv) api.Result {
			newAsyncFix(t, e)
			var p unsafe.Pointer
			r := e.a.MemHostAlloc(&p, 4096, 0x80)
			if r == api.Success {
				e.a.MemFreeHost(p)
			}
			return r
		}})
	add(confCase{fn: "cuMemHostAlloc", code: api.ErrorInvalidContext, what: "no current context",
		run: func(t *testing.T, e *confEnv) api.Result {
			newAsyncFix(t, e)
			e.setCurrent(t, 0)
			var p unsafe.Pointer
			r := e.a.MemHostAlloc(&p, 4096, 0)
			if r == api.Success {
				e.a.MemFreeHost(p)
			}
			return r
		}})
	add(confCase{fn: "cuMemFreeHost", code: api.Success, what: "memory of cuMemHostAlloc",
		run: func(t *testing.T, e *confEnv) api.Result {
			newAsyncFix(t, e)
			var p unsafe.Pointer
			if r := e.a.MemHostAlloc(&p, 4096, 0); r != api.Success {
				t.Fatalf("cuMemHostAlloc: %s", r.Name())
			}
			return e.a.MemFreeHost(p)
		}})
	add(confCase{fn: "cuMemFreeHost", code: api.ErrorInvalidValue, what: "Go memory, never allocated by the driver",
		run: func(t *testing.T, e *confEnv) api.Result {
			newAsyncFix(t, e)
			h := make([]byte, 4096)
			return e.a.MemFreeHost(unsafe.Pointer(&h[0]))
		}})

	add(confCase{fn: "cuStreamGetCtx", code: api.Success, what: "a stream of the primary context, and the NULL stream: that context",
		run: func(t *testing.T, e *confEnv) api.Result {
			f := newAsyncFix(t, e)
			for _, s := range []api.Stream{f.stream, 0} {
				var c api.Context
				if r := e.a.StreamGetCtx(s, &c); r != api.Success {
					return r
				}
				if c != f.ctx {
					t.Errorf("stream %#x: context %#x, want %#x", uintptr(s), uintptr(c), uintptr(f.ctx))
				}
			}
			return api.Success
		}})
	add(confCase{fn: "cuStreamGetCtx", code: api.ErrorInvalidValue, what: "pctx is NULL",
		run: func(t *testing.T, e *confEnv) api.Result {
			f := newAsyncFix(t, e)
			return e.a.StreamGetCtx(f.stream, nil)
		}})
	add(confCase{fn: "cuStreamGetCtx", code: api.ErrorInvalidHandle, what: "a destroyed stream", notReal: notRealDeadHandle,
		run: func(t *testing.T, e *confEnv) api.Result {
			f := newAsyncFix(t, e)
			var c api.Context
			return e.a.StreamGetCtx(f.deadStream(t, e), &c)
		}})
	add(confCase{fn: "cuStreamGetCtx", code: api.ErrorInvalidContext, what: "the NULL stream with no current context",
		run: func(t *testing.T, e *confEnv) api.Result {
			newAsyncFix(t, e)
			e.setCurrent(t, 0)
			var c api.Context
			return e.a.StreamGetCtx(0, &c)
		}})
	return cs
}
