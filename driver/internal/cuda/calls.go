package cuda

import (
	"math"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Every method below is one callN (call_amd64.go) with the arguments in C
// order, one machine word each: pointers as uintptr(unsafe.Pointer(p))
// written in the call itself (so callN's //go:uintptrescapes keeps the
// object alive and in place), integers widened, CUdeviceptr and size_t as
// 64-bit words. CUresult comes back in EAX; the upper half of RAX is not
// part of it.

func result(r uintptr) api.Result { return api.Result(int32(r)) }

func (d *Driver) Init(flags uint32) api.Result {
	return result(call1(d.fns[fnInit], uintptr(flags)))
}

func (d *Driver) DriverGetVersion(version *int32) api.Result {
	return result(call1(d.fns[fnDriverGetVersion], uintptr(unsafe.Pointer(version))))
}

func (d *Driver) DeviceGetCount(count *int32) api.Result {
	return result(call1(d.fns[fnDeviceGetCount], uintptr(unsafe.Pointer(count))))
}

func (d *Driver) DeviceGet(dev *api.Device, ordinal int32) api.Result {
	return result(call2(d.fns[fnDeviceGet], uintptr(unsafe.Pointer(dev)), uintptr(ordinal)))
}

// DeviceGetName passes &name[0] and len(name) (capped at the C int range);
// an empty name passes NULL and 0, which the driver rejects.
func (d *Driver) DeviceGetName(name []byte, dev api.Device) api.Result {
	n := min(len(name), math.MaxInt32)
	return result(call3(d.fns[fnDeviceGetName], uintptr(unsafe.Pointer(unsafe.SliceData(name))), uintptr(n), uintptr(dev)))
}

func (d *Driver) DeviceGetUuid(uuid *api.UUID, dev api.Device) api.Result {
	return result(call2(d.fns[fnDeviceGetUuid], uintptr(unsafe.Pointer(uuid)), uintptr(dev)))
}

func (d *Driver) DeviceTotalMem(bytes *uint64, dev api.Device) api.Result {
	return result(call2(d.fns[fnDeviceTotalMem], uintptr(unsafe.Pointer(bytes)), uintptr(dev)))
}

func (d *Driver) DeviceGetAttribute(value *int32, attrib int32, dev api.Device) api.Result {
	return result(call3(d.fns[fnDeviceGetAttribute], uintptr(unsafe.Pointer(value)), uintptr(attrib), uintptr(dev)))
}

func (d *Driver) DevicePrimaryCtxRetain(ctx *api.Context, dev api.Device) api.Result {
	return result(call2(d.fns[fnDevicePrimaryCtxRetain], uintptr(unsafe.Pointer(ctx)), uintptr(dev)))
}

func (d *Driver) DevicePrimaryCtxRelease(dev api.Device) api.Result {
	return result(call1(d.fns[fnDevicePrimaryCtxRelease], uintptr(dev)))
}

// ctxCreateParams is CUctxCreateParams (CUDA 12.5+), for cuCtxCreate_v4.
type ctxCreateParams struct {
	execAffinityParams    uintptr // CUexecAffinityParam*
	numExecAffinityParams int32
	_                     int32
	cigParams             uintptr // CUctxCigParam*
}

// CtxCreate calls cuCtxCreate_v2, or on a driver without it cuCtxCreate_v4
// with an all-zero CUctxCreateParams, which asks for the same plain context.
func (d *Driver) CtxCreate(ctx *api.Context, flags uint32, dev api.Device) api.Result {
	if d.ctxCreateV4 {
		var params ctxCreateParams
		return result(call4(d.fns[fnCtxCreate], uintptr(unsafe.Pointer(ctx)), uintptr(unsafe.Pointer(&params)), uintptr(flags), uintptr(dev)))
	}
	return result(call3(d.fns[fnCtxCreate], uintptr(unsafe.Pointer(ctx)), uintptr(flags), uintptr(dev)))
}

func (d *Driver) CtxDestroy(ctx api.Context) api.Result {
	return result(call1(d.fns[fnCtxDestroy], uintptr(ctx)))
}

func (d *Driver) CtxSetCurrent(ctx api.Context) api.Result {
	return result(call1(d.fns[fnCtxSetCurrent], uintptr(ctx)))
}

func (d *Driver) CtxGetCurrent(ctx *api.Context) api.Result {
	return result(call1(d.fns[fnCtxGetCurrent], uintptr(unsafe.Pointer(ctx))))
}

func (d *Driver) CtxGetDevice(dev *api.Device) api.Result {
	return result(call1(d.fns[fnCtxGetDevice], uintptr(unsafe.Pointer(dev))))
}

func (d *Driver) CtxSynchronize() api.Result {
	return result(call0(d.fns[fnCtxSynchronize]))
}

func (d *Driver) CtxEnablePeerAccess(peer api.Context, flags uint32) api.Result {
	return result(call2(d.fns[fnCtxEnablePeerAccess], uintptr(peer), uintptr(flags)))
}

func (d *Driver) CtxDisablePeerAccess(peer api.Context) api.Result {
	return result(call1(d.fns[fnCtxDisablePeerAccess], uintptr(peer)))
}

func (d *Driver) DeviceCanAccessPeer(canAccess *int32, dev, peerDev api.Device) api.Result {
	return result(call3(d.fns[fnDeviceCanAccessPeer], uintptr(unsafe.Pointer(canAccess)), uintptr(dev), uintptr(peerDev)))
}

func (d *Driver) DeviceGetP2PAttribute(value *int32, attrib int32, src, dst api.Device) api.Result {
	return result(call4(d.fns[fnDeviceGetP2PAttribute], uintptr(unsafe.Pointer(value)), uintptr(attrib), uintptr(src), uintptr(dst)))
}

// DeviceGetP2PAtomicCapabilities returns CUDA_ERROR_NOT_SUPPORTED, without a
// call, on a driver that does not export cuDeviceGetP2PAtomicCapabilities
// (older than CUDA 12.8).
func (d *Driver) DeviceGetP2PAtomicCapabilities(capabilities *uint32, operations *int32, count uint32, src, dst api.Device) api.Result {
	f := d.fns[fnDeviceGetP2PAtomicCapabilities]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call5(f, uintptr(unsafe.Pointer(capabilities)), uintptr(unsafe.Pointer(operations)), uintptr(count), uintptr(src), uintptr(dst)))
}

func (d *Driver) MemAlloc(dptr *api.DevicePtr, bytesize uint64) api.Result {
	return result(call2(d.fns[fnMemAlloc], uintptr(unsafe.Pointer(dptr)), uintptr(bytesize)))
}

func (d *Driver) MemFree(dptr api.DevicePtr) api.Result {
	return result(call1(d.fns[fnMemFree], uintptr(dptr)))
}

func (d *Driver) MemGetInfo(free, total *uint64) api.Result {
	return result(call2(d.fns[fnMemGetInfo], uintptr(unsafe.Pointer(free)), uintptr(unsafe.Pointer(total))))
}

func (d *Driver) MemGetAddressRange(base *api.DevicePtr, size *uint64, dptr api.DevicePtr) api.Result {
	return result(call3(d.fns[fnMemGetAddressRange], uintptr(unsafe.Pointer(base)), uintptr(unsafe.Pointer(size)), uintptr(dptr)))
}

func (d *Driver) PointerGetAttribute(data unsafe.Pointer, attrib int32, ptr api.DevicePtr) api.Result {
	return result(call3(d.fns[fnPointerGetAttribute], uintptr(data), uintptr(attrib), uintptr(ptr)))
}

func (d *Driver) MemsetD8(dst api.DevicePtr, value uint8, n uint64) api.Result {
	return result(call3(d.fns[fnMemsetD8], uintptr(dst), uintptr(value), uintptr(n)))
}

func (d *Driver) MemsetD8Async(dst api.DevicePtr, value uint8, n uint64, stream api.Stream) api.Result {
	return result(call4(d.fns[fnMemsetD8Async], uintptr(dst), uintptr(value), uintptr(n), uintptr(stream)))
}

func (d *Driver) MemcpyHtoD(dst api.DevicePtr, src unsafe.Pointer, n uint64) api.Result {
	return result(call3(d.fns[fnMemcpyHtoD], uintptr(dst), uintptr(src), uintptr(n)))
}

func (d *Driver) MemcpyDtoH(dst unsafe.Pointer, src api.DevicePtr, n uint64) api.Result {
	return result(call3(d.fns[fnMemcpyDtoH], uintptr(dst), uintptr(src), uintptr(n)))
}

func (d *Driver) MemcpyDtoD(dst, src api.DevicePtr, n uint64) api.Result {
	return result(call3(d.fns[fnMemcpyDtoD], uintptr(dst), uintptr(src), uintptr(n)))
}

func (d *Driver) MemcpyDtoDAsync(dst, src api.DevicePtr, n uint64, stream api.Stream) api.Result {
	return result(call4(d.fns[fnMemcpyDtoDAsync], uintptr(dst), uintptr(src), uintptr(n), uintptr(stream)))
}

func (d *Driver) MemcpyPeer(dst api.DevicePtr, dstCtx api.Context, src api.DevicePtr, srcCtx api.Context, n uint64) api.Result {
	return result(call5(d.fns[fnMemcpyPeer], uintptr(dst), uintptr(dstCtx), uintptr(src), uintptr(srcCtx), uintptr(n)))
}

func (d *Driver) MemcpyHtoDAsync(dst api.DevicePtr, src unsafe.Pointer, n uint64, stream api.Stream) api.Result {
	return result(call4(d.fns[fnMemcpyHtoDAsync], uintptr(dst), uintptr(src), uintptr(n), uintptr(stream)))
}

func (d *Driver) MemcpyDtoHAsync(dst unsafe.Pointer, src api.DevicePtr, n uint64, stream api.Stream) api.Result {
	return result(call4(d.fns[fnMemcpyDtoHAsync], uintptr(dst), uintptr(src), uintptr(n), uintptr(stream)))
}

func (d *Driver) MemHostAlloc(pp *unsafe.Pointer, bytesize uint64, flags uint32) api.Result {
	return result(call3(d.fns[fnMemHostAlloc], uintptr(unsafe.Pointer(pp)), uintptr(bytesize), uintptr(flags)))
}

func (d *Driver) MemFreeHost(p unsafe.Pointer) api.Result {
	return result(call1(d.fns[fnMemFreeHost], uintptr(p)))
}

func (d *Driver) StreamCreate(stream *api.Stream, flags uint32) api.Result {
	return result(call2(d.fns[fnStreamCreate], uintptr(unsafe.Pointer(stream)), uintptr(flags)))
}

func (d *Driver) StreamDestroy(stream api.Stream) api.Result {
	return result(call1(d.fns[fnStreamDestroy], uintptr(stream)))
}

func (d *Driver) StreamSynchronize(stream api.Stream) api.Result {
	return result(call1(d.fns[fnStreamSynchronize], uintptr(stream)))
}

func (d *Driver) StreamWaitEvent(stream api.Stream, event api.Event, flags uint32) api.Result {
	return result(call3(d.fns[fnStreamWaitEvent], uintptr(stream), uintptr(event), uintptr(flags)))
}

func (d *Driver) StreamGetCtx(stream api.Stream, ctx *api.Context) api.Result {
	return result(call2(d.fns[fnStreamGetCtx], uintptr(stream), uintptr(unsafe.Pointer(ctx))))
}

func (d *Driver) EventCreate(event *api.Event, flags uint32) api.Result {
	return result(call2(d.fns[fnEventCreate], uintptr(unsafe.Pointer(event)), uintptr(flags)))
}

func (d *Driver) EventDestroy(event api.Event) api.Result {
	return result(call1(d.fns[fnEventDestroy], uintptr(event)))
}

func (d *Driver) EventRecord(event api.Event, stream api.Stream) api.Result {
	return result(call2(d.fns[fnEventRecord], uintptr(event), uintptr(stream)))
}

func (d *Driver) EventSynchronize(event api.Event) api.Result {
	return result(call1(d.fns[fnEventSynchronize], uintptr(event)))
}

func (d *Driver) EventQuery(event api.Event) api.Result {
	return result(call1(d.fns[fnEventQuery], uintptr(event)))
}

func (d *Driver) EventElapsedTime(ms *float32, start, end api.Event) api.Result {
	return result(call3(d.fns[fnEventElapsedTime], uintptr(unsafe.Pointer(ms)), uintptr(start), uintptr(end)))
}

func (d *Driver) IpcGetEventHandle(handle *api.IpcEventHandle, event api.Event) api.Result {
	return result(call2(d.fns[fnIpcGetEventHandle], uintptr(unsafe.Pointer(handle)), uintptr(event)))
}

func (d *Driver) IpcGetMemHandle(handle *api.IpcMemHandle, dptr api.DevicePtr) api.Result {
	return result(call2(d.fns[fnIpcGetMemHandle], uintptr(unsafe.Pointer(handle)), uintptr(dptr)))
}

func (d *Driver) IpcCloseMemHandle(dptr api.DevicePtr) api.Result {
	return result(call1(d.fns[fnIpcCloseMemHandle], uintptr(dptr)))
}

// ErrorName is the driver's name for r (cuGetErrorName), which covers codes
// that api.Result.Name does not list; for a code the driver does not know
// either, it is r.Name(). It is for messages, not a hot path: it allocates.
func (d *Driver) ErrorName(r api.Result) string {
	var s *byte // set by the driver to a static C string
	rc := call2(d.fns[fnGetErrorName], uintptr(uint32(r)), uintptr(unsafe.Pointer(&s)))
	if result(rc) != api.Success || s == nil {
		return r.Name()
	}
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(s), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(s, n))
}

// The VMM calls return CUDA_ERROR_NOT_SUPPORTED, without a call, on a driver
// that does not export them. CUmemGenericAllocationHandle is an unsigned
// long long, and the flags are unsigned long long: one word each.

func (d *Driver) MemGetAllocationGranularity(granularity *uint64, prop *api.MemAllocationProp, option int32) api.Result {
	f := d.fns[fnMemGetAllocationGranularity]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call3(f, uintptr(unsafe.Pointer(granularity)), uintptr(unsafe.Pointer(prop)), uintptr(option)))
}

func (d *Driver) MemCreate(handle *api.MemHandle, size uint64, prop *api.MemAllocationProp, flags uint64) api.Result {
	f := d.fns[fnMemCreate]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call4(f, uintptr(unsafe.Pointer(handle)), uintptr(size), uintptr(unsafe.Pointer(prop)), uintptr(flags)))
}

func (d *Driver) MemRelease(handle api.MemHandle) api.Result {
	f := d.fns[fnMemRelease]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call1(f, uintptr(handle)))
}

func (d *Driver) MemExportToShareableHandle(shareableHandle unsafe.Pointer, handle api.MemHandle, handleType int32, flags uint64) api.Result {
	f := d.fns[fnMemExportToShareableHandle]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call4(f, uintptr(shareableHandle), uintptr(handle), uintptr(handleType), uintptr(flags)))
}

// MemImportFromShareableHandle passes osHandle as the pointer-sized value
// itself: for a POSIX fd, the fd (measured on driver 580, GPU.md).
func (d *Driver) MemImportFromShareableHandle(handle *api.MemHandle, osHandle uintptr, handleType int32) api.Result {
	f := d.fns[fnMemImportFromShareableHandle]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call3(f, uintptr(unsafe.Pointer(handle)), osHandle, uintptr(handleType)))
}

func (d *Driver) MemAddressReserve(ptr *api.DevicePtr, size, alignment uint64, addr api.DevicePtr, flags uint64) api.Result {
	f := d.fns[fnMemAddressReserve]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call5(f, uintptr(unsafe.Pointer(ptr)), uintptr(size), uintptr(alignment), uintptr(addr), uintptr(flags)))
}

func (d *Driver) MemAddressFree(ptr api.DevicePtr, size uint64) api.Result {
	f := d.fns[fnMemAddressFree]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call2(f, uintptr(ptr), uintptr(size)))
}

func (d *Driver) MemMap(ptr api.DevicePtr, size, offset uint64, handle api.MemHandle, flags uint64) api.Result {
	f := d.fns[fnMemMap]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call5(f, uintptr(ptr), uintptr(size), uintptr(offset), uintptr(handle), uintptr(flags)))
}

func (d *Driver) MemUnmap(ptr api.DevicePtr, size uint64) api.Result {
	f := d.fns[fnMemUnmap]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call2(f, uintptr(ptr), uintptr(size)))
}

func (d *Driver) MemSetAccess(ptr api.DevicePtr, size uint64, desc *api.MemAccessDesc, count uint64) api.Result {
	f := d.fns[fnMemSetAccess]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call4(f, uintptr(ptr), uintptr(size), uintptr(unsafe.Pointer(desc)), uintptr(count)))
}

func (d *Driver) MemGetAccess(flags *uint64, location *api.MemLocation, ptr api.DevicePtr) api.Result {
	f := d.fns[fnMemGetAccess]
	if f == 0 {
		return api.ErrorNotSupported
	}
	return result(call3(f, uintptr(unsafe.Pointer(flags)), uintptr(unsafe.Pointer(location)), uintptr(ptr)))
}
