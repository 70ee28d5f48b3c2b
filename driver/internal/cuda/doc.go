// Package cuda is the real backend of the raw contract [api.API]: a binding
// of the NVIDIA driver library, libcuda.so.1, loaded at run time with purego
// (no cgo; the package builds with CGO_ENABLED=0).
//
// [Load] opens the library and resolves every symbol up front, so a driver
// that lacks one is an error at load time, never a crash at the first call.
// Each method is the C function it is named after, with C semantics and no
// policy: the return value is the driver's CUresult, unchanged.
//
// # Symbols
//
// The methods call the explicitly versioned entry points that cuda.h (CUDA
// 13.0) maps its names to, never the unversioned compatibility symbols that
// the library still exports for binaries built before CUDA 3.2 and 4.0 (those
// take 32-bit sizes, or have older semantics). The table of which C symbol
// backs which method is the variable bindings in cuda.go; [Driver.Symbols]
// reports what a loaded library actually bound.
//
// cuda.h maps some calls to _ptds/_ptsz variants when a program is compiled
// with per-thread default stream; this package binds the legacy ones, so
// stream 0 is the legacy NULL stream, as [api.Stream] says.
//
// # Calls
//
// On amd64 every call goes through runtime.cgocall (the entry point of cgo
// and purego) with a small trampoline of this package and an argument block
// on the caller's stack, with the function pointer resolved at load: no
// reflection and no allocation per call. purego.SyscallN allocates its
// variadic argument slice on every call, and purego.RegisterFunc runs
// reflect.MakeFunc machinery and allocates on every call (see
// BenchmarkCallOverhead); both are used only off amd64 (SyscallN) or in
// tests (RegisterFunc).
//
// CUipcMemHandle and CUipcEventHandle are 64-byte structs that C passes by
// value. The System V amd64 ABI passes such a struct in memory: its eight
// words go on the stack and it takes no register. IpcOpenMemHandle and
// IpcOpenEventHandle lay the words out so (callHandle in call_amd64.go); the
// tests prove the layout against a C library compiled by gcc. On other
// architectures those two methods return CUDA_ERROR_NOT_SUPPORTED.
//
// # Memory
//
// Host pointers passed to a method must stay valid for the call only. The
// driver does not keep them, and the call helpers (//go:uintptrescapes, as
// syscall.Syscall) keep the Go objects they point to alive and in place for
// the duration of the call. The cost of that guarantee is that such an
// object escapes to the heap; through the api.API interface it escapes
// anyway.
//
// # Threads
//
// As in CUDA, the current context belongs to the calling OS thread; callers
// hold runtime.LockOSThread while they rely on it.
package cuda
