package cuda

import (
	"errors"
	"fmt"
	"strings"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// DefaultLibrary is the library Load opens when given "": the versioned
// soname that the NVIDIA driver installs (the unversioned libcuda.so comes
// only with the toolkit's development files).
const DefaultLibrary = "libcuda.so.1"

var (
	// ErrLibraryNotFound reports that the driver library could not be
	// loaded: it is missing, or dlopen refused it. The error that wraps it
	// carries dlopen's message.
	ErrLibraryNotFound = errors.New("cuda: driver library not found")
	// ErrSymbolNotFound reports that the library lacks a function this
	// package needs (an old driver, or not libcuda at all). The error that
	// wraps it names every missing symbol.
	ErrSymbolNotFound = errors.New("cuda: symbol not found")
)

// fn indexes Driver.fns and bindings.
type fn int

const (
	fnInit fn = iota
	fnDriverGetVersion
	fnDeviceGetCount
	fnDeviceGet
	fnDeviceGetName
	fnDeviceGetUuid
	fnDeviceTotalMem
	fnDeviceGetAttribute
	fnDevicePrimaryCtxRetain
	fnDevicePrimaryCtxRelease
	fnCtxCreate
	fnCtxDestroy
	fnCtxSetCurrent
	fnCtxGetCurrent
	fnCtxGetDevice
	fnCtxSynchronize
	fnCtxEnablePeerAccess
	fnCtxDisablePeerAccess
	fnDeviceCanAccessPeer
	fnDeviceGetP2PAttribute
	fnDeviceGetP2PAtomicCapabilities
	fnMemAlloc
	fnMemFree
	fnMemGetInfo
	fnMemGetAddressRange
	fnPointerGetAttribute
	fnMemsetD8
	fnMemsetD8Async
	fnMemcpyHtoD
	fnMemcpyDtoH
	fnMemcpyDtoD
	fnMemcpyDtoDAsync
	fnMemcpyPeer
	fnMemcpyHtoDAsync
	fnMemcpyDtoHAsync
	fnMemHostAlloc
	fnMemFreeHost
	fnStreamCreate
	fnStreamDestroy
	fnStreamSynchronize
	fnStreamWaitEvent
	fnStreamGetCtx
	fnEventCreate
	fnEventDestroy
	fnEventRecord
	fnEventSynchronize
	fnEventQuery
	fnEventElapsedTime
	fnIpcGetEventHandle
	fnIpcOpenEventHandle
	fnIpcGetMemHandle
	fnIpcOpenMemHandle
	fnIpcCloseMemHandle
	fnMemGetAllocationGranularity
	fnMemCreate
	fnMemRelease
	fnMemExportToShareableHandle
	fnMemImportFromShareableHandle
	fnMemAddressReserve
	fnMemAddressFree
	fnMemMap
	fnMemUnmap
	fnMemSetAccess
	fnMemGetAccess
	fnGetErrorName
	numFns
)

// binding is one row of the symbol table.
type binding struct {
	method   string   // the Driver method that calls it
	symbols  []string // C symbols, preferred first; Load binds the first one exported
	optional bool     // absent: the method returns CUDA_ERROR_NOT_SUPPORTED instead of Load failing
}

// bindings is the symbol table: which C symbol backs which method. The
// versioned names are the ones cuda.h (CUDA 13.0) maps the plain names to;
// the unversioned originals of the _v2 symbols take 32-bit sizes or have
// pre-4.0 semantics and are never bound.
//
// Alternatives, all with the same meaning for our use:
//   - cuDeviceGetUuid_v2 (CUDA 11.4+; what cuda.h maps cuDeviceGetUuid to)
//     falls back to cuDeviceGetUuid, same signature.
//   - cuCtxCreate_v2 is preferred: it has the (ctx*, flags, dev) signature of
//     api.API and every driver since CUDA 3.2 exports it, driver 580
//     included. CUDA 13's cuda.h maps cuCtxCreate to cuCtxCreate_v4, which
//     adds a CUctxCreateParams*; CtxCreate calls _v4 with an all-zero params
//     struct (no affinity, no CIG: the same context) only on a driver that
//     has dropped _v2.
//   - cuEventElapsedTime_v2 (CUDA 12.8+; what cuda.h 13.0 maps
//     cuEventElapsedTime to) falls back to cuEventElapsedTime, same
//     signature.
//
// cuDeviceGetP2PAtomicCapabilities (CUDA 12.8+) and the virtual memory
// management calls (CUDA 10.2+) are optional: their absence makes the method
// return CUDA_ERROR_NOT_SUPPORTED, which the caller treats as "this driver
// cannot", while every other symbol is needed for cudashare to work at all.
// cuda.h 13.0 maps none of the VMM names to a versioned symbol (no #define
// for them), so the plain names are the ones bound.
//
// cuMemcpyHtoDAsync and cuMemcpyDtoHAsync bind their _v2 forms (64-bit
// sizes) like the synchronous copies. cuMemHostAlloc, cuMemFreeHost and
// cuStreamGetCtx have no versioned symbol in cuda.h 13.0 (cuStreamGetCtx_v2
// is a different function, with a green-context out-parameter).
//
// cuMemsetD8Async, cuMemcpyPeer, cuStreamSynchronize, cuStreamWaitEvent,
// cuStreamGetCtx, the async copies and cuEventRecord have _ptsz/_ptds variants that cuda.h selects only under
// per-thread default stream; we bind the legacy ones. cuCtxGetDevice and
// cuCtxSynchronize are the current-context forms (CUDA 13 adds _v2 forms that
// take an explicit context: different functions, not replacements).
var bindings = [numFns]binding{
	fnInit:                           {method: "Init", symbols: []string{"cuInit"}},
	fnDriverGetVersion:               {method: "DriverGetVersion", symbols: []string{"cuDriverGetVersion"}},
	fnDeviceGetCount:                 {method: "DeviceGetCount", symbols: []string{"cuDeviceGetCount"}},
	fnDeviceGet:                      {method: "DeviceGet", symbols: []string{"cuDeviceGet"}},
	fnDeviceGetName:                  {method: "DeviceGetName", symbols: []string{"cuDeviceGetName"}},
	fnDeviceGetUuid:                  {method: "DeviceGetUuid", symbols: []string{"cuDeviceGetUuid_v2", "cuDeviceGetUuid"}},
	fnDeviceTotalMem:                 {method: "DeviceTotalMem", symbols: []string{"cuDeviceTotalMem_v2"}},
	fnDeviceGetAttribute:             {method: "DeviceGetAttribute", symbols: []string{"cuDeviceGetAttribute"}},
	fnDevicePrimaryCtxRetain:         {method: "DevicePrimaryCtxRetain", symbols: []string{"cuDevicePrimaryCtxRetain"}},
	fnDevicePrimaryCtxRelease:        {method: "DevicePrimaryCtxRelease", symbols: []string{"cuDevicePrimaryCtxRelease_v2"}},
	fnCtxCreate:                      {method: "CtxCreate", symbols: []string{"cuCtxCreate_v2", "cuCtxCreate_v4"}},
	fnCtxDestroy:                     {method: "CtxDestroy", symbols: []string{"cuCtxDestroy_v2"}},
	fnCtxSetCurrent:                  {method: "CtxSetCurrent", symbols: []string{"cuCtxSetCurrent"}},
	fnCtxGetCurrent:                  {method: "CtxGetCurrent", symbols: []string{"cuCtxGetCurrent"}},
	fnCtxGetDevice:                   {method: "CtxGetDevice", symbols: []string{"cuCtxGetDevice"}},
	fnCtxSynchronize:                 {method: "CtxSynchronize", symbols: []string{"cuCtxSynchronize"}},
	fnCtxEnablePeerAccess:            {method: "CtxEnablePeerAccess", symbols: []string{"cuCtxEnablePeerAccess"}},
	fnCtxDisablePeerAccess:           {method: "CtxDisablePeerAccess", symbols: []string{"cuCtxDisablePeerAccess"}},
	fnDeviceCanAccessPeer:            {method: "DeviceCanAccessPeer", symbols: []string{"cuDeviceCanAccessPeer"}},
	fnDeviceGetP2PAttribute:          {method: "DeviceGetP2PAttribute", symbols: []string{"cuDeviceGetP2PAttribute"}},
	fnDeviceGetP2PAtomicCapabilities: {method: "DeviceGetP2PAtomicCapabilities", symbols: []string{"cuDeviceGetP2PAtomicCapabilities"}, optional: true},
	fnMemAlloc:                       {method: "MemAlloc", symbols: []string{"cuMemAlloc_v2"}},
	fnMemFree:                        {method: "MemFree", symbols: []string{"cuMemFree_v2"}},
	fnMemGetInfo:                     {method: "MemGetInfo", symbols: []string{"cuMemGetInfo_v2"}},
	fnMemGetAddressRange:             {method: "MemGetAddressRange", symbols: []string{"cuMemGetAddressRange_v2"}},
	fnPointerGetAttribute:            {method: "PointerGetAttribute", symbols: []string{"cuPointerGetAttribute"}},
	fnMemsetD8:                       {method: "MemsetD8", symbols: []string{"cuMemsetD8_v2"}},
	fnMemsetD8Async:                  {method: "MemsetD8Async", symbols: []string{"cuMemsetD8Async"}},
	fnMemcpyHtoD:                     {method: "MemcpyHtoD", symbols: []string{"cuMemcpyHtoD_v2"}},
	fnMemcpyDtoH:                     {method: "MemcpyDtoH", symbols: []string{"cuMemcpyDtoH_v2"}},
	fnMemcpyDtoD:                     {method: "MemcpyDtoD", symbols: []string{"cuMemcpyDtoD_v2"}},
	fnMemcpyDtoDAsync:                {method: "MemcpyDtoDAsync", symbols: []string{"cuMemcpyDtoDAsync_v2"}},
	fnMemcpyPeer:                     {method: "MemcpyPeer", symbols: []string{"cuMemcpyPeer"}},
	fnMemcpyHtoDAsync:                {method: "MemcpyHtoDAsync", symbols: []string{"cuMemcpyHtoDAsync_v2"}},
	fnMemcpyDtoHAsync:                {method: "MemcpyDtoHAsync", symbols: []string{"cuMemcpyDtoHAsync_v2"}},
	fnMemHostAlloc:                   {method: "MemHostAlloc", symbols: []string{"cuMemHostAlloc"}},
	fnMemFreeHost:                    {method: "MemFreeHost", symbols: []string{"cuMemFreeHost"}},
	fnStreamCreate:                   {method: "StreamCreate", symbols: []string{"cuStreamCreate"}},
	fnStreamDestroy:                  {method: "StreamDestroy", symbols: []string{"cuStreamDestroy_v2"}},
	fnStreamSynchronize:              {method: "StreamSynchronize", symbols: []string{"cuStreamSynchronize"}},
	fnStreamWaitEvent:                {method: "StreamWaitEvent", symbols: []string{"cuStreamWaitEvent"}},
	fnStreamGetCtx:                   {method: "StreamGetCtx", symbols: []string{"cuStreamGetCtx"}},
	fnEventCreate:                    {method: "EventCreate", symbols: []string{"cuEventCreate"}},
	fnEventDestroy:                   {method: "EventDestroy", symbols: []string{"cuEventDestroy_v2"}},
	fnEventRecord:                    {method: "EventRecord", symbols: []string{"cuEventRecord"}},
	fnEventSynchronize:               {method: "EventSynchronize", symbols: []string{"cuEventSynchronize"}},
	fnEventQuery:                     {method: "EventQuery", symbols: []string{"cuEventQuery"}},
	fnEventElapsedTime:               {method: "EventElapsedTime", symbols: []string{"cuEventElapsedTime_v2", "cuEventElapsedTime"}},
	fnIpcGetEventHandle:              {method: "IpcGetEventHandle", symbols: []string{"cuIpcGetEventHandle"}},
	fnIpcOpenEventHandle:             {method: "IpcOpenEventHandle", symbols: []string{"cuIpcOpenEventHandle"}},
	fnIpcGetMemHandle:                {method: "IpcGetMemHandle", symbols: []string{"cuIpcGetMemHandle"}},
	fnIpcOpenMemHandle:               {method: "IpcOpenMemHandle", symbols: []string{"cuIpcOpenMemHandle_v2"}},
	fnIpcCloseMemHandle:              {method: "IpcCloseMemHandle", symbols: []string{"cuIpcCloseMemHandle"}},
	fnMemGetAllocationGranularity:    {method: "MemGetAllocationGranularity", symbols: []string{"cuMemGetAllocationGranularity"}, optional: true},
	fnMemCreate:                      {method: "MemCreate", symbols: []string{"cuMemCreate"}, optional: true},
	fnMemRelease:                     {method: "MemRelease", symbols: []string{"cuMemRelease"}, optional: true},
	fnMemExportToShareableHandle:     {method: "MemExportToShareableHandle", symbols: []string{"cuMemExportToShareableHandle"}, optional: true},
	fnMemImportFromShareableHandle:   {method: "MemImportFromShareableHandle", symbols: []string{"cuMemImportFromShareableHandle"}, optional: true},
	fnMemAddressReserve:              {method: "MemAddressReserve", symbols: []string{"cuMemAddressReserve"}, optional: true},
	fnMemAddressFree:                 {method: "MemAddressFree", symbols: []string{"cuMemAddressFree"}, optional: true},
	fnMemMap:                         {method: "MemMap", symbols: []string{"cuMemMap"}, optional: true},
	fnMemUnmap:                       {method: "MemUnmap", symbols: []string{"cuMemUnmap"}, optional: true},
	fnMemSetAccess:                   {method: "MemSetAccess", symbols: []string{"cuMemSetAccess"}, optional: true},
	fnMemGetAccess:                   {method: "MemGetAccess", symbols: []string{"cuMemGetAccess"}, optional: true},
	fnGetErrorName:                   {method: "ErrorName", symbols: []string{"cuGetErrorName"}},
}

// Driver is libcuda, loaded by [Load] (the zero Driver has no functions to
// call). It implements [api.API]; its methods are safe
// for concurrent use to the extent that the driver's functions are (they
// are: CUDA is thread-safe, with per-thread current contexts).
//
// There is no Close: the library stays loaded for the life of the process.
// Unloading libcuda while contexts, allocations or IPC mappings made through
// it are alive is undefined (the driver's own threads and atexit handlers
// run in it), and the driver offers no way to tear all of that down first.
// Load again is cheap: dlopen reference-counts the library.
type Driver struct {
	path  string
	fns   [numFns]uintptr // function pointers; 0 only for an absent optional symbol
	bound [numFns]string  // the symbol bound for each entry
	// ctxCreateV4 is set when CtxCreate is bound to cuCtxCreate_v4.
	ctxCreateV4 bool
}

var _ api.API = (*Driver)(nil)

// Load opens the driver library at path (DefaultLibrary if path is "") with
// RTLD_NOW|RTLD_GLOBAL and resolves every symbol the methods call. A library
// that cannot be opened is an error wrapping ErrLibraryNotFound; one that
// lacks a needed symbol is an error wrapping ErrSymbolNotFound that names the
// symbols, and is closed again.
//
// Load does not call cuInit.
func Load(path string) (*Driver, error) {
	if unsafe.Sizeof(uintptr(0)) != 8 {
		// Sizes and CUdeviceptr are passed as one machine word each.
		return nil, errors.New("cuda: the binding needs a 64-bit platform")
	}
	if path == "" {
		path = DefaultLibrary
	}
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return nil, fmt.Errorf("%w: dlopen %s: %v", ErrLibraryNotFound, path, err)
	}
	d := &Driver{path: path}
	var missing []string
	for i := range bindings {
		b := &bindings[i]
		for _, sym := range b.symbols {
			if p, err := purego.Dlsym(h, sym); err == nil && p != 0 {
				d.fns[i], d.bound[i] = p, sym
				break
			}
		}
		if d.fns[i] == 0 && !b.optional {
			missing = append(missing, strings.Join(b.symbols, " or "))
		}
	}
	if len(missing) > 0 {
		// Nothing has been called yet, so unloading is safe here.
		_ = purego.Dlclose(h)
		return nil, fmt.Errorf("%w: %s lacks %s", ErrSymbolNotFound, path, strings.Join(missing, ", "))
	}
	d.ctxCreateV4 = d.bound[fnCtxCreate] == "cuCtxCreate_v4"
	return d, nil
}

// Binding says which C symbol backs a method of a loaded Driver.
type Binding struct {
	Method string // Go method name, e.g. "MemAlloc"
	Symbol string // C symbol, e.g. "cuMemAlloc_v2"; "" when an optional symbol is absent
}

// Symbols reports the symbol bound for every method, in a fixed order.
func (d *Driver) Symbols() []Binding {
	out := make([]Binding, numFns)
	for i := range bindings {
		out[i] = Binding{Method: bindings[i].method, Symbol: d.bound[i]}
	}
	return out
}

// Path is the library path Load was given (or DefaultLibrary).
func (d *Driver) Path() string { return d.path }

// Backend is "cuda".
func (d *Driver) Backend() string { return "cuda" }
