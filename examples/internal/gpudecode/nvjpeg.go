package gpudecode

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"github.com/ebitengine/purego"
)

// ErrUnavailable: nvJPEG (or the CUDA driver) cannot be loaded here. The
// loader then decodes on the CPU.
var ErrUnavailable = errors.New("gpudecode: nvJPEG unavailable")

// ErrNvjpeg: an nvJPEG call failed; the message names the call and the
// status.
var ErrNvjpeg = errors.New("gpudecode: nvJPEG")

// nvjpegStatus_t (nvjpeg.h).
var statusNames = map[uintptr]string{
	0: "NVJPEG_STATUS_SUCCESS", 1: "NVJPEG_STATUS_NOT_INITIALIZED", 2: "NVJPEG_STATUS_INVALID_PARAMETER",
	3: "NVJPEG_STATUS_BAD_JPEG", 4: "NVJPEG_STATUS_JPEG_NOT_SUPPORTED", 5: "NVJPEG_STATUS_ALLOCATOR_FAILURE",
	6: "NVJPEG_STATUS_EXECUTION_FAILED", 7: "NVJPEG_STATUS_ARCH_MISMATCH", 8: "NVJPEG_STATUS_INTERNAL_ERROR",
	9: "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED", 10: "NVJPEG_STATUS_INCOMPLETE_BITSTREAM",
}

const (
	statusJPEGNotSupported = 4
	statusArchMismatch     = 7
	statusNotSupported     = 9
)

// Backend is nvjpegBackend_t.
type Backend int32

// nvjpegBackend_t (nvjpeg.h).
const (
	BackendDefault   Backend = 0
	BackendHybrid    Backend = 1 // Huffman decode on the CPU
	BackendGPUHybrid Backend = 2 // Huffman decode on the GPU
	BackendHardware  Backend = 3 // the GPU's JPEG engines (A100, H100, H200)
)

func (b Backend) String() string {
	switch b {
	case BackendDefault:
		return "default"
	case BackendHybrid:
		return "hybrid"
	case BackendGPUHybrid:
		return "gpu-hybrid"
	case BackendHardware:
		return "hardware"
	}
	return fmt.Sprintf("backend(%d)", int32(b))
}

// ParseBackends reads -backend: one name, or "auto" (hardware, then
// gpu-hybrid).
func ParseBackends(s string) ([]Backend, error) {
	switch s {
	case "auto", "":
		return []Backend{BackendHardware, BackendGPUHybrid}, nil
	case "hardware":
		return []Backend{BackendHardware}, nil
	case "gpu-hybrid":
		return []Backend{BackendGPUHybrid}, nil
	case "hybrid":
		return []Backend{BackendHybrid}, nil
	case "default":
		return []Backend{BackendDefault}, nil
	}
	return nil, fmt.Errorf("unknown nvJPEG backend %q: auto, hardware, gpu-hybrid, hybrid or default", s)
}

const (
	outputRGB = 3 // NVJPEG_OUTPUT_RGB: three planes, R, G, B, in channel[0..2]
	// libraryPropertyType (library_types.h)
	propMajor = 0
	propMinor = 1
	propPatch = 2
)

// image is nvjpegImage_t: unsigned char *channel[4]; size_t pitch[4].
type image struct {
	channel [4]uintptr
	pitch   [4]uint64
}

// nvjpeg is the bound library: each field a C function's address.
type nvjpeg struct {
	path string

	getProperty          uintptr // (libraryPropertyType, int*)
	createEx             uintptr // (backend, devAllocator*, pinnedAllocator*, flags, handle*)
	destroy              uintptr // (handle)
	jpegStateCreate      uintptr // (handle, state*)
	jpegStateDestroy     uintptr // (state)
	getImageInfo         uintptr // (handle, data*, size_t, int* nComponents, css*, int* widths, int* heights)
	decodeBatchedInit    uintptr // (handle, state, int batch, int maxCPUThreads, outputFormat)
	decodeBatched        uintptr // (handle, state, const uchar* const* data, const size_t* lengths, nvjpegImage_t* dst, cudaStream_t)
	jpegStreamCreate     uintptr // (handle, jpegStream*)
	jpegStreamDestroy    uintptr // (jpegStream)
	jpegStreamParse      uintptr // (handle, data*, size_t, int saveMetadata, int saveStream, jpegStream)
	decodeBatchedSupport uintptr // (handle, jpegStream, int* isSupported): 0 means supported

	// The ROI decode (CUDA 11.6 and later; 0 where the library lacks it):
	// each image decoded straight into its crop, no staging and no copy.
	decodeBatchedEx     uintptr // (handle, state, data*, lengths*, nvjpegImage_t* dst, nvjpegDecodeParams_t* params, cudaStream_t)
	decodeBatchedSuppEx uintptr // (handle, jpegStream, decodeParams, int* isSupported): 0 means supported
	decodeParamsCreate  uintptr // (handle, decodeParams*)
	decodeParamsDestroy uintptr // (decodeParams)
	decodeParamsSetFmt  uintptr // (decodeParams, outputFormat)
	decodeParamsSetROI  uintptr // (decodeParams, int x, int y, int w, int h)
}

// hasROI: the library has every call the ROI decode needs.
func (l *nvjpeg) hasROI() bool {
	return l.decodeBatchedEx != 0 && l.decodeBatchedSuppEx != 0 && l.decodeParamsCreate != 0 &&
		l.decodeParamsDestroy != 0 && l.decodeParamsSetFmt != 0 && l.decodeParamsSetROI != 0
}

// libraryCandidates: an explicit path first, then the sonames of CUDA 13,
// 12 and 11 (found where ld.so looks), then the toolkit's directory and
// the pip wheels' (torch brings nvJPEG with it).
func libraryCandidates(explicit string) []string {
	if explicit != "" {
		return []string{explicit}
	}
	var c []string
	if env := os.Getenv("CUDASHARE_NVJPEG"); env != "" {
		c = append(c, env)
	}
	sonames := []string{"libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so.11", "libnvjpeg.so"}
	c = append(c, sonames...)
	for _, dir := range []string{"/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib", "/usr/lib/x86_64-linux-gnu"} {
		for _, so := range sonames {
			c = append(c, filepath.Join(dir, so))
		}
	}
	for _, pat := range []string{
		"/usr/local/lib/python3*/dist-packages/nvidia/*/lib/libnvjpeg.so.*",
		"/usr/local/lib/python3*/site-packages/nvidia/*/lib/libnvjpeg.so.*",
		"/usr/lib/python3*/site-packages/nvidia/*/lib/libnvjpeg.so.*",
		"/opt/conda/lib/libnvjpeg.so.*",
		"/opt/conda/lib/python3*/site-packages/nvidia/*/lib/libnvjpeg.so.*",
	} {
		m, _ := filepath.Glob(pat)
		c = append(c, m...)
	}
	return c
}

// loadNvjpeg opens the first candidate that loads and has every symbol.
func loadNvjpeg(explicit string) (*nvjpeg, error) {
	var tried []string
	for _, path := range libraryCandidates(explicit) {
		h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err != nil {
			tried = append(tried, fmt.Sprintf("%s: %v", path, err))
			continue
		}
		l := &nvjpeg{path: path}
		var missing []string
		for _, s := range []struct {
			name string
			p    *uintptr
		}{
			{"nvjpegGetProperty", &l.getProperty},
			{"nvjpegCreateEx", &l.createEx},
			{"nvjpegDestroy", &l.destroy},
			{"nvjpegJpegStateCreate", &l.jpegStateCreate},
			{"nvjpegJpegStateDestroy", &l.jpegStateDestroy},
			{"nvjpegGetImageInfo", &l.getImageInfo},
			{"nvjpegDecodeBatchedInitialize", &l.decodeBatchedInit},
			{"nvjpegDecodeBatched", &l.decodeBatched},
			{"nvjpegJpegStreamCreate", &l.jpegStreamCreate},
			{"nvjpegJpegStreamDestroy", &l.jpegStreamDestroy},
			{"nvjpegJpegStreamParse", &l.jpegStreamParse},
			{"nvjpegDecodeBatchedSupported", &l.decodeBatchedSupport},
		} {
			p, err := purego.Dlsym(h, s.name)
			if err != nil || p == 0 {
				missing = append(missing, s.name)
				continue
			}
			*s.p = p
		}
		// Optional: without them the crop is a 2D copy from staging.
		for _, s := range []struct {
			name string
			p    *uintptr
		}{
			{"nvjpegDecodeBatchedEx", &l.decodeBatchedEx},
			{"nvjpegDecodeBatchedSupportedEx", &l.decodeBatchedSuppEx},
			{"nvjpegDecodeParamsCreate", &l.decodeParamsCreate},
			{"nvjpegDecodeParamsDestroy", &l.decodeParamsDestroy},
			{"nvjpegDecodeParamsSetOutputFormat", &l.decodeParamsSetFmt},
			{"nvjpegDecodeParamsSetROI", &l.decodeParamsSetROI},
		} {
			if p, err := purego.Dlsym(h, s.name); err == nil {
				*s.p = p
			}
		}
		if len(missing) > 0 {
			tried = append(tried, fmt.Sprintf("%s: lacks %s", path, strings.Join(missing, ", ")))
			continue
		}
		return l, nil
	}
	if len(tried) > 4 {
		tried = append(tried[:4], fmt.Sprintf("and %d more", len(tried)-4))
	}
	return nil, fmt.Errorf("%w: no libnvjpeg loads (%s); set -nvjpeg PATH or CUDASHARE_NVJPEG", ErrUnavailable, strings.Join(tried, "; "))
}

// call runs a C function that returns nvjpegStatus_t and turns a failure
// into an error naming it. It is //go:uintptrescapes, as purego.SyscallN
// is: a uintptr(unsafe.Pointer(p)) written in the call keeps *p alive and
// in place until the C function returns.
//
//go:uintptrescapes
func call(name string, fn uintptr, args ...uintptr) error {
	r, _, _ := purego.SyscallN(fn, args...)
	st := r & 0xffffffff // an enum: the low 32 bits of RAX
	if st == 0 {
		return nil
	}
	return &statusError{call: name, status: st}
}

type statusError struct {
	call   string
	status uintptr
}

func (e *statusError) Error() string {
	n, ok := statusNames[e.status]
	if !ok {
		n = fmt.Sprintf("status %d", e.status)
	}
	return fmt.Sprintf("%s: %s", e.call, n)
}

func (e *statusError) Is(target error) bool { return target == ErrNvjpeg }

// version is nvJPEG's major.minor.patch.
func (l *nvjpeg) version() string {
	var v [3]int32
	for i, p := range []uintptr{propMajor, propMinor, propPatch} {
		if call("nvjpegGetProperty", l.getProperty, p, uintptr(unsafe.Pointer(&v[i]))) != nil {
			return "unknown"
		}
	}
	return fmt.Sprintf("%d.%d.%d", v[0], v[1], v[2])
}
