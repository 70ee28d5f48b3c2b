package gpudecode

import (
	"fmt"
	"unsafe"

	"github.com/ebitengine/purego"
)

// memcpy2D is CUDA_MEMCPY2D (cuda.h, CUDA 13.0): 16 eight-byte words on
// x86-64 (each CUmemorytype, an int, is padded to the pointer after it).
type memcpy2D struct {
	srcXInBytes   uint64
	srcY          uint64
	srcMemoryType uint32
	_             uint32
	srcHost       uintptr
	srcDevice     uint64
	srcArray      uintptr
	srcPitch      uint64
	dstXInBytes   uint64
	dstY          uint64
	dstMemoryType uint32
	_             uint32
	dstHost       uintptr
	dstDevice     uint64
	dstArray      uintptr
	dstPitch      uint64
	widthInBytes  uint64
	height        uint64
}

const memoryTypeDevice = 2 // CU_MEMORYTYPE_DEVICE

var _ [128 - unsafe.Sizeof(memcpy2D{})]byte // exactly 128 bytes
var _ [unsafe.Sizeof(memcpy2D{}) - 128]byte

// cuda is what this package calls in libcuda.so.1 itself.
type cuda struct {
	ctxSetCurrent    uintptr // CUresult cuCtxSetCurrent(CUcontext)
	memcpy2DAsync    uintptr // CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D*, CUstream)
	streamSynchonize uintptr // CUresult cuStreamSynchronize(CUstream)
}

func loadCUDA(path string) (*cuda, error) {
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrUnavailable, path, err)
	}
	c := &cuda{}
	for _, s := range []struct {
		name string
		p    *uintptr
	}{
		{"cuCtxSetCurrent", &c.ctxSetCurrent},
		{"cuMemcpy2DAsync_v2", &c.memcpy2DAsync},
		{"cuStreamSynchronize", &c.streamSynchonize},
	} {
		p, err := purego.Dlsym(h, s.name)
		if err != nil || p == 0 {
			return nil, fmt.Errorf("%w: %s lacks %s", ErrUnavailable, path, s.name)
		}
		*s.p = p
	}
	return c, nil
}

// cuCall runs a CUresult function.
//
//go:uintptrescapes
func cuCall(name string, fn uintptr, args ...uintptr) error {
	r, _, _ := purego.SyscallN(fn, args...)
	if r := int32(r); r != 0 {
		return fmt.Errorf("%s: CUresult %d", name, r)
	}
	return nil
}

// copy2D queues a device-to-device copy of a width x height block of bytes
// on stream.
func (c *cuda) copy2D(dst uint64, dstPitch uint64, src uint64, srcPitch uint64, width, height uint64, stream uintptr) error {
	p := memcpy2D{
		srcMemoryType: memoryTypeDevice, srcDevice: src, srcPitch: srcPitch,
		dstMemoryType: memoryTypeDevice, dstDevice: dst, dstPitch: dstPitch,
		widthInBytes: width, height: height,
	}
	return cuCall("cuMemcpy2DAsync_v2", c.memcpy2DAsync, uintptr(unsafe.Pointer(&p)), stream)
}
