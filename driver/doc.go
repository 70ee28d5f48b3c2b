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
package driver
