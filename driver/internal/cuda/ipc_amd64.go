package cuda

import (
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// The two calls that take a 64-byte struct by value:
//
//	CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags);
//	CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle);
//
// callHandle (call_amd64.go) lays the struct out on the stack as the System
// V amd64 ABI requires. TestIpcHandleByValue checks the layout against a C
// library compiled by gcc, and against purego.RegisterFunc's own struct
// support (placeStack in purego's struct_amd64.go), which agrees but costs
// reflection and allocations on every call.

func (d *Driver) IpcOpenMemHandle(dptr *api.DevicePtr, handle api.IpcMemHandle, flags uint32) api.Result {
	return result(callHandle(d.fns[fnIpcOpenMemHandle], uintptr(unsafe.Pointer(dptr)), uintptr(flags), &handle.Reserved))
}

func (d *Driver) IpcOpenEventHandle(event *api.Event, handle api.IpcEventHandle) api.Result {
	return result(callHandle(d.fns[fnIpcOpenEventHandle], uintptr(unsafe.Pointer(event)), 0, &handle.Reserved))
}
