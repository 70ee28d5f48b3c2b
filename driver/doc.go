// Package driver is a safe Go API over the CUDA driver API, with two
// backends behind it: the real driver (libcuda.so.1 through purego, no cgo)
// and a simulator that implements the same contract across real processes,
// with strict checks where the real driver's behaviour is undefined.
//
// Names follow the C API without the "cu" prefix. Every resource is a type
// with an idempotent Close. Errors are *Error values that match the exported
// sentinels with errors.Is.
//
// # Contexts and threads
//
// CUDA's current context belongs to the OS thread, and goroutines move
// between threads. So no method here relies on whatever context happens to be
// current: every context-bound call is a method of *Context, which locks the
// goroutine to its thread and makes its context current for the duration of
// the call, then unlocks. A caller can therefore never run a driver call
// against the wrong context. The cost is one extra cuCtxSetCurrent per call;
// BenchmarkContextCall measures it.
//
// # CUDA work made elsewhere
//
// A program's own CUDA code (cgo, another binding) shares streams and
// contexts with this package through raw handles: Stream.Handle and
// Context.Handle give them out, and Context.WrapStream takes in a CUstream
// made elsewhere without taking it over (its Close destroys nothing).
// Context.CopyHtoDAsync and CopyDtoHAsync queue copies on a stream; they
// are truly asynchronous from and to pinned memory (Context.AllocHost, a
// HostBuffer), while with Go memory the driver is done with it when the
// call returns.
//
// # Virtual memory management
//
// Besides legacy IPC handles (IpcGetMemHandle), memory can be shared as
// POSIX file descriptors: Context.MemCreate with Exportable makes an
// Allocation, Allocation.ExportFD gives an fd per consumer to send with
// SCM_RIGHTS, Context.ImportFD in the consumer turns the fd back into an
// Allocation, and Context.Map makes it addressable (with access for the
// context's device and any peers). The memory lives while any Allocation,
// fd or Mapping of it exists in any process, so a producer may exit, or be
// killed, under its consumers. Unlike legacy handles this works between
// processes in sibling PID namespaces (containers). Device.VMMSupport and
// Device.AllocationGranularity say what a device offers; fabric handles are
// reported but not implemented (ErrFabricUnsupported). The real-driver side
// of this has not run on a GPU yet: docs/gpu-driver-conformance.md.
package driver
