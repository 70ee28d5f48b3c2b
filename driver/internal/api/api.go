// Package api is the raw CUDA driver contract that every backend implements:
// the C functions of the driver API with C semantics (thread-current context,
// out-parameters that may be nil, CUresult return codes) and no policy.
//
// The safe package driver sits above it. The conformance suite drives this
// interface directly so that it can produce every documented return code,
// including the ones the safe layer makes impossible (a nil out-parameter, no
// current context).
//
// # Threads
//
// As in CUDA, the current context belongs to the calling OS thread. A caller
// of this interface must hold runtime.LockOSThread for as long as it relies
// on the current context.
//
// # Memory
//
// Host pointers passed in (unsafe.Pointer) must stay valid for the duration of
// the call only; no backend keeps them.
package api

import (
	"unsafe"

	"github.com/seed743c36cf/cudashare/internal/uuid"
)

// Result is a CUresult.
type Result int32

// CUresult values, from cuda.h (CUDA 13.0).
const (
	Success                       Result = 0
	ErrorInvalidValue             Result = 1
	ErrorOutOfMemory              Result = 2
	ErrorNotInitialized           Result = 3
	ErrorDeinitialized            Result = 4
	ErrorNoDevice                 Result = 100
	ErrorInvalidDevice            Result = 101
	ErrorInvalidContext           Result = 201
	ErrorContextAlreadyCurrent    Result = 202
	ErrorMapFailed                Result = 205
	ErrorUnmapFailed              Result = 206
	ErrorAlreadyMapped            Result = 208
	ErrorNotMapped                Result = 211
	ErrorContextAlreadyInUse      Result = 216
	ErrorPeerAccessUnsupported    Result = 217
	ErrorInvalidHandle            Result = 400
	ErrorIllegalState             Result = 401
	ErrorNotFound                 Result = 500
	ErrorNotReady                 Result = 600
	ErrorIllegalAddress           Result = 700
	ErrorPeerAccessAlreadyEnabled Result = 704
	ErrorPeerAccessNotEnabled     Result = 705
	ErrorPrimaryContextActive     Result = 708
	ErrorContextIsDestroyed       Result = 709
	ErrorTooManyPeers             Result = 711
	ErrorNotPermitted             Result = 800
	ErrorNotSupported             Result = 801
	ErrorUnknown                  Result = 999
)

var resultNames = map[Result]string{
	Success:                       "CUDA_SUCCESS",
	ErrorInvalidValue:             "CUDA_ERROR_INVALID_VALUE",
	ErrorOutOfMemory:              "CUDA_ERROR_OUT_OF_MEMORY",
	ErrorNotInitialized:           "CUDA_ERROR_NOT_INITIALIZED",
	ErrorDeinitialized:            "CUDA_ERROR_DEINITIALIZED",
	ErrorNoDevice:                 "CUDA_ERROR_NO_DEVICE",
	ErrorInvalidDevice:            "CUDA_ERROR_INVALID_DEVICE",
	ErrorInvalidContext:           "CUDA_ERROR_INVALID_CONTEXT",
	ErrorContextAlreadyCurrent:    "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
	ErrorMapFailed:                "CUDA_ERROR_MAP_FAILED",
	ErrorUnmapFailed:              "CUDA_ERROR_UNMAP_FAILED",
	ErrorAlreadyMapped:            "CUDA_ERROR_ALREADY_MAPPED",
	ErrorNotMapped:                "CUDA_ERROR_NOT_MAPPED",
	ErrorContextAlreadyInUse:      "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
	ErrorPeerAccessUnsupported:    "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
	ErrorInvalidHandle:            "CUDA_ERROR_INVALID_HANDLE",
	ErrorIllegalState:             "CUDA_ERROR_ILLEGAL_STATE",
	ErrorNotFound:                 "CUDA_ERROR_NOT_FOUND",
	ErrorNotReady:                 "CUDA_ERROR_NOT_READY",
	ErrorIllegalAddress:           "CUDA_ERROR_ILLEGAL_ADDRESS",
	ErrorPeerAccessAlreadyEnabled: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
	ErrorPeerAccessNotEnabled:     "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
	ErrorPrimaryContextActive:     "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
	ErrorContextIsDestroyed:       "CUDA_ERROR_CONTEXT_IS_DESTROYED",
	ErrorTooManyPeers:             "CUDA_ERROR_TOO_MANY_PEERS",
	ErrorNotPermitted:             "CUDA_ERROR_NOT_PERMITTED",
	ErrorNotSupported:             "CUDA_ERROR_NOT_SUPPORTED",
	ErrorUnknown:                  "CUDA_ERROR_UNKNOWN",
}

// Name returns the C name of r, or "CUresult(N)" for a code this package does
// not list.
func (r Result) Name() string {
	if n, ok := resultNames[r]; ok {
		return n
	}
	return "CUresult(" + itoa(int64(r)) + ")"
}

func itoa(v int64) string {
	if v == 0 {
		return "0"
	}
	neg := v < 0
	if neg {
		v = -v
	}
	var b [24]byte
	i := len(b)
	for v > 0 {
		i--
		b[i] = byte('0' + v%10)
		v /= 10
	}
	if neg {
		i--
		b[i] = '-'
	}
	return string(b[i:])
}

// Handles. Each is the C type's size; zero is the null handle.
type (
	Device    int32   // CUdevice
	Context   uintptr // CUcontext
	DevicePtr uint64  // CUdeviceptr
	Stream    uintptr // CUstream; 0 is the NULL (legacy default) stream
	Event     uintptr // CUevent
)

// IpcHandleSize is CU_IPC_HANDLE_SIZE.
const IpcHandleSize = 64

// IpcMemHandle is CUipcMemHandle, passed by value.
type IpcMemHandle struct{ Reserved [IpcHandleSize]byte }

// IpcEventHandle is CUipcEventHandle, passed by value.
type IpcEventHandle struct{ Reserved [IpcHandleSize]byte }

// UUID is CUuuid.
type UUID = uuid.UUID

// CUdevice_attribute values we rely on.
const (
	AttrUnifiedAddressing                      int32 = 41
	AttrComputeCapabilityMajor                 int32 = 75
	AttrComputeCapabilityMinor                 int32 = 76
	AttrVirtualMemoryManagementSupported       int32 = 102
	AttrHandleTypePosixFileDescriptorSupported int32 = 103
	AttrIpcEventSupported                      int32 = 125
	AttrHandleTypeFabricSupported              int32 = 128
)

// MemHandle is CUmemGenericAllocationHandle: a VMM allocation of this
// process (cuMemCreate, cuMemImportFromShareableHandle). Zero is never a
// handle.
type MemHandle uint64

// MemLocation is CUmemLocation (8 bytes).
type MemLocation struct {
	Type int32 // CUmemLocationType
	ID   int32
}

// MemAllocFlags is the allocFlags member of CUmemAllocationProp (8 bytes).
type MemAllocFlags struct {
	CompressionType      uint8
	GPUDirectRDMACapable uint8
	Usage                uint16
	Reserved             [4]uint8
}

// MemAllocationProp is CUmemAllocationProp: 32 bytes on x86-64 (measured
// with the CUDA 13.0 headers, see GPU.md).
type MemAllocationProp struct {
	Type                 int32 // CUmemAllocationType
	RequestedHandleTypes int32 // CUmemAllocationHandleType bits
	Location             MemLocation
	Win32HandleMetaData  uintptr // must be 0 off Windows
	AllocFlags           MemAllocFlags
}

// MemAccessDesc is CUmemAccessDesc (12 bytes).
type MemAccessDesc struct {
	Location MemLocation
	Flags    int32 // CUmemAccess_flags
}

// VMM enums, from cuda.h (CUDA 13.0).
const (
	MemAllocationTypePinned int32 = 1 // CU_MEM_ALLOCATION_TYPE_PINNED

	MemLocationTypeInvalid int32 = 0 // CU_MEM_LOCATION_TYPE_INVALID
	MemLocationTypeDevice  int32 = 1 // CU_MEM_LOCATION_TYPE_DEVICE
	MemLocationTypeHost    int32 = 2 // CU_MEM_LOCATION_TYPE_HOST

	MemHandleTypeNone                int32 = 0x0 // CU_MEM_HANDLE_TYPE_NONE
	MemHandleTypePosixFileDescriptor int32 = 0x1 // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
	MemHandleTypeWin32               int32 = 0x2 // CU_MEM_HANDLE_TYPE_WIN32
	MemHandleTypeWin32Kmt            int32 = 0x4 // CU_MEM_HANDLE_TYPE_WIN32_KMT
	MemHandleTypeFabric              int32 = 0x8 // CU_MEM_HANDLE_TYPE_FABRIC

	MemAccessProtNone      int32 = 0 // CU_MEM_ACCESS_FLAGS_PROT_NONE
	MemAccessProtRead      int32 = 1 // CU_MEM_ACCESS_FLAGS_PROT_READ
	MemAccessProtReadWrite int32 = 3 // CU_MEM_ACCESS_FLAGS_PROT_READWRITE

	MemAllocGranularityMinimum     int32 = 0 // CU_MEM_ALLOC_GRANULARITY_MINIMUM
	MemAllocGranularityRecommended int32 = 1 // CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
)

// The layouts are the C ABI's; pin them.
var (
	_ [32 - unsafe.Sizeof(MemAllocationProp{})]struct{}
	_ [unsafe.Sizeof(MemAllocationProp{}) - 32]struct{}
	_ [12 - unsafe.Sizeof(MemAccessDesc{})]struct{}
	_ [unsafe.Sizeof(MemAccessDesc{}) - 12]struct{}
)

// CUdevice_P2PAttribute values.
const (
	P2PAttrPerformanceRank                  int32 = 1
	P2PAttrAccessSupported                  int32 = 2
	P2PAttrNativeAtomicSupported            int32 = 3
	P2PAttrCudaArrayAccessSupported         int32 = 4
	P2PAttrOnlyPartialNativeAtomicSupported int32 = 5
)

// CUatomicOperation values.
const (
	AtomicIntegerAdd       int32 = 0
	AtomicIntegerMin       int32 = 1
	AtomicIntegerMax       int32 = 2
	AtomicIntegerIncrement int32 = 3
	AtomicIntegerDecrement int32 = 4
	AtomicAnd              int32 = 5
	AtomicOr               int32 = 6
	AtomicXor              int32 = 7
	AtomicExchange         int32 = 8
	AtomicCAS              int32 = 9
	AtomicFloatAdd         int32 = 10
	AtomicFloatMin         int32 = 11
	AtomicFloatMax         int32 = 12
	atomicOperationCount         = 13
)

// AtomicOperationCount is the number of CUatomicOperation values.
const AtomicOperationCount = atomicOperationCount

// CUatomicOperationCapability bits.
const (
	AtomicCapSigned     uint32 = 1 << 0
	AtomicCapUnsigned   uint32 = 1 << 1
	AtomicCapReduction  uint32 = 1 << 2
	AtomicCapScalar32   uint32 = 1 << 3
	AtomicCapScalar64   uint32 = 1 << 4
	AtomicCapScalar128  uint32 = 1 << 5
	AtomicCapVector32x4 uint32 = 1 << 6
)

// CUpointer_attribute values.
const (
	PointerAttrContext       int32 = 1
	PointerAttrMemoryType    int32 = 2
	PointerAttrBufferID      int32 = 7
	PointerAttrDeviceOrdinal int32 = 9
	PointerAttrRangeStart    int32 = 11
	PointerAttrRangeSize     int32 = 12
)

// Flags.
const (
	IpcMemLazyEnablePeerAccess uint32 = 0x1 // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

	EventDefault       uint32 = 0x0
	EventBlockingSync  uint32 = 0x1
	EventDisableTiming uint32 = 0x2
	EventInterprocess  uint32 = 0x4

	StreamDefault     uint32 = 0x0
	StreamNonBlocking uint32 = 0x1

	MemoryTypeDevice int32 = 2 // CU_MEMORYTYPE_DEVICE

	MemHostAllocPortable      uint32 = 0x1 // CU_MEMHOSTALLOC_PORTABLE
	MemHostAllocDeviceMap     uint32 = 0x2 // CU_MEMHOSTALLOC_DEVICEMAP
	MemHostAllocWriteCombined uint32 = 0x4 // CU_MEMHOSTALLOC_WRITECOMBINED
)

// API is the CUDA driver API subset that cudashare uses, with C semantics.
// Each method is the C function of the same name with the "cu" prefix
// removed and versioned symbols resolved (MemAlloc is cuMemAlloc_v2, and so
// on). Sizes are 64-bit, as in the _v2 symbols.
type API interface {
	// Backend is "cuda" or "sim".
	Backend() string

	Init(flags uint32) Result
	DriverGetVersion(version *int32) Result

	DeviceGetCount(count *int32) Result
	DeviceGet(dev *Device, ordinal int32) Result
	// DeviceGetName writes a NUL-terminated name into name[:len(name)].
	DeviceGetName(name []byte, dev Device) Result
	DeviceGetUuid(uuid *UUID, dev Device) Result
	DeviceTotalMem(bytes *uint64, dev Device) Result
	DeviceGetAttribute(value *int32, attrib int32, dev Device) Result

	DevicePrimaryCtxRetain(ctx *Context, dev Device) Result
	DevicePrimaryCtxRelease(dev Device) Result
	// CtxCreate and CtxDestroy make non-primary contexts; the conformance
	// suite uses them to reach the one-context-per-device IPC restriction.
	// CtxCreate makes the new context current, as cuCtxCreate does.
	CtxCreate(ctx *Context, flags uint32, dev Device) Result
	CtxDestroy(ctx Context) Result
	CtxSetCurrent(ctx Context) Result
	CtxGetCurrent(ctx *Context) Result
	CtxGetDevice(dev *Device) Result
	CtxSynchronize() Result

	CtxEnablePeerAccess(peer Context, flags uint32) Result
	CtxDisablePeerAccess(peer Context) Result
	DeviceCanAccessPeer(canAccess *int32, dev, peerDev Device) Result
	DeviceGetP2PAttribute(value *int32, attrib int32, src, dst Device) Result
	// DeviceGetP2PAtomicCapabilities: operations is a plain array, as cuda.h
	// declares it (the documentation page prints **).
	DeviceGetP2PAtomicCapabilities(capabilities *uint32, operations *int32, count uint32, src, dst Device) Result

	MemAlloc(dptr *DevicePtr, bytesize uint64) Result
	MemFree(dptr DevicePtr) Result
	MemGetInfo(free, total *uint64) Result
	MemGetAddressRange(base *DevicePtr, size *uint64, dptr DevicePtr) Result
	PointerGetAttribute(data unsafe.Pointer, attrib int32, ptr DevicePtr) Result
	MemsetD8(dst DevicePtr, value uint8, n uint64) Result
	MemsetD8Async(dst DevicePtr, value uint8, n uint64, stream Stream) Result
	MemcpyHtoD(dst DevicePtr, src unsafe.Pointer, n uint64) Result
	MemcpyDtoH(dst unsafe.Pointer, src DevicePtr, n uint64) Result
	MemcpyDtoD(dst, src DevicePtr, n uint64) Result
	MemcpyDtoDAsync(dst, src DevicePtr, n uint64, stream Stream) Result
	MemcpyPeer(dst DevicePtr, dstCtx Context, src DevicePtr, srcCtx Context, n uint64) Result
	// MemcpyHtoDAsync and MemcpyDtoHAsync are the _v2 async copies. From or
	// to pageable memory the driver is done with the host buffer when the
	// call returns (it stages HtoD and completes DtoH first); from or to
	// memory of MemHostAlloc it may read or write it until the stream
	// reaches the copy.
	MemcpyHtoDAsync(dst DevicePtr, src unsafe.Pointer, n uint64, stream Stream) Result
	MemcpyDtoHAsync(dst unsafe.Pointer, src DevicePtr, n uint64, stream Stream) Result
	// MemHostAlloc is cuMemHostAlloc: page-locked host memory, written to
	// *pp. It is not Go memory; MemFreeHost frees it.
	MemHostAlloc(pp *unsafe.Pointer, bytesize uint64, flags uint32) Result
	MemFreeHost(p unsafe.Pointer) Result

	StreamCreate(stream *Stream, flags uint32) Result
	StreamDestroy(stream Stream) Result
	StreamSynchronize(stream Stream) Result
	StreamWaitEvent(stream Stream, event Event, flags uint32) Result
	// StreamGetCtx is cuStreamGetCtx: the context of a stream (for a
	// default stream, the current context).
	StreamGetCtx(stream Stream, ctx *Context) Result

	EventCreate(event *Event, flags uint32) Result
	EventDestroy(event Event) Result
	EventRecord(event Event, stream Stream) Result
	EventSynchronize(event Event) Result
	EventQuery(event Event) Result
	EventElapsedTime(ms *float32, start, end Event) Result

	IpcGetEventHandle(handle *IpcEventHandle, event Event) Result
	IpcOpenEventHandle(event *Event, handle IpcEventHandle) Result
	IpcGetMemHandle(handle *IpcMemHandle, dptr DevicePtr) Result
	IpcOpenMemHandle(dptr *DevicePtr, handle IpcMemHandle, flags uint32) Result
	IpcCloseMemHandle(dptr DevicePtr) Result

	// Virtual memory management. None of these has a versioned symbol in
	// cuda.h 13.0. osHandle of cuMemImportFromShareableHandle is a void*
	// that for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR carries the fd
	// itself, so it is a uintptr here, not a pointer; shareableHandle of the
	// export points to an int for that type.
	MemGetAllocationGranularity(granularity *uint64, prop *MemAllocationProp, option int32) Result
	MemCreate(handle *MemHandle, size uint64, prop *MemAllocationProp, flags uint64) Result
	MemRelease(handle MemHandle) Result
	MemExportToShareableHandle(shareableHandle unsafe.Pointer, handle MemHandle, handleType int32, flags uint64) Result
	MemImportFromShareableHandle(handle *MemHandle, osHandle uintptr, handleType int32) Result
	MemAddressReserve(ptr *DevicePtr, size, alignment uint64, addr DevicePtr, flags uint64) Result
	MemAddressFree(ptr DevicePtr, size uint64) Result
	MemMap(ptr DevicePtr, size, offset uint64, handle MemHandle, flags uint64) Result
	MemUnmap(ptr DevicePtr, size uint64) Result
	MemSetAccess(ptr DevicePtr, size uint64, desc *MemAccessDesc, count uint64) Result
	MemGetAccess(flags *uint64, location *MemLocation, ptr DevicePtr) Result
}

// Violation is one breach of a lifetime rule that the real driver leaves
// undefined (a free while another process maps the memory, a close of a
// pointer never opened, an access after close). Only strict backends record
// them.
type Violation struct {
	Kind   string `json:"kind"`   // "free-while-mapped", "close-unopened", "access-after-close", ...
	PID    int    `json:"pid"`    // the process that broke the rule
	Detail string `json:"detail"` // human-readable: which pointer, which peer
}

// Strict is implemented by backends that check the lifetime rules the real
// driver leaves undefined. The sim backend records violations in its shared
// state, so Violations sees those of every process that shares it.
type Strict interface {
	Violations() ([]Violation, error)
}

// ImportExplainer is implemented by backends that can say why
// MemImportFromShareableHandle refused a handle, which the CUresult does
// not: the simulator names what is wrong with a descriptor (not one of its
// allocations, not sealed against resizing, the wrong size). It returns
// nil when it sees nothing wrong.
type ImportExplainer interface {
	ExplainImport(osHandle uintptr, handleType int32) error
}

// ResultNames lists every CUresult this package names, for tests.
func ResultNames() map[Result]string {
	m := make(map[Result]string, len(resultNames))
	for k, v := range resultNames {
		m[k] = v
	}
	return m
}
