package cuda

import (
	"encoding/binary"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Calls into C go through runtime.cgocall, the entry point that cgo and
// purego use, with a trampoline of our own (call_amd64.s) instead of
// purego.SyscallN. SyscallN is //go:uintptrescapes and variadic, so its
// argument slice escapes and every call allocates (16 bytes for a
// two-argument call, measured), and it copies a 50-word block through a
// sync.Pool. Here the argument block lives on the caller's stack: cgocall
// runs the C function on the g0 stack while the goroutine is in a system
// call, and a goroutine's stack is neither grown nor shrunk in that state,
// so the pointer to the block stays valid. runtime.cgocall works without cgo
// because purego, which this package imports for dlopen, installs its
// fakecgo runtime hooks.
//
// The callN helpers are //go:uintptrescapes: a uintptr(unsafe.Pointer(p))
// written in a call to one of them keeps *p alive, on the heap, until the
// helper returns, exactly as for syscall.Syscall.

// callArgs is the block the trampoline reads: fn, the six integer register
// arguments, eight stack words, and the returned RAX.
type callArgs struct {
	fn uintptr
	a  [14]uintptr
	r  uintptr
}

//go:linkname runtime_cgocall runtime.cgocall
//go:noescape
func runtime_cgocall(fn uintptr, arg unsafe.Pointer) int32

// trampolineABI0 is the address of trampoline<> in call_amd64.s.
var trampolineABI0 uintptr

func (a *callArgs) do() uintptr {
	runtime_cgocall(trampolineABI0, unsafe.Pointer(a))
	return a.r
}

//go:uintptrescapes
func call0(fn uintptr) uintptr {
	a := callArgs{fn: fn}
	return a.do()
}

//go:uintptrescapes
func call1(fn, a1 uintptr) uintptr {
	a := callArgs{fn: fn}
	a.a[0] = a1
	return a.do()
}

//go:uintptrescapes
func call2(fn, a1, a2 uintptr) uintptr {
	a := callArgs{fn: fn}
	a.a[0], a.a[1] = a1, a2
	return a.do()
}

//go:uintptrescapes
func call3(fn, a1, a2, a3 uintptr) uintptr {
	a := callArgs{fn: fn}
	a.a[0], a.a[1], a.a[2] = a1, a2, a3
	return a.do()
}

//go:uintptrescapes
func call4(fn, a1, a2, a3, a4 uintptr) uintptr {
	a := callArgs{fn: fn}
	a.a[0], a.a[1], a.a[2], a.a[3] = a1, a2, a3, a4
	return a.do()
}

//go:uintptrescapes
func call5(fn, a1, a2, a3, a4, a5 uintptr) uintptr {
	a := callArgs{fn: fn}
	a.a[0], a.a[1], a.a[2], a.a[3], a.a[4] = a1, a2, a3, a4, a5
	return a.do()
}

// callHandle calls fn(a1, [a2,] handle) where handle is a 64-byte struct
// passed by value. The System V amd64 ABI classifies an aggregate larger
// than two eightbytes as MEMORY: the caller copies it, 8-byte aligned, into
// the outgoing argument area on the stack and it takes no register, so a
// scalar argument after it (Flags of cuIpcOpenMemHandle_v2) still goes in
// the next integer register. The callee sees
//
//	RDI = a1, RSI = a2, 8(%rsp) .. 64(%rsp) = handle bytes 0..63
//
// (0(%rsp) is the return address). The trampoline stores a[6:14] at 0(SP) of
// its call, which is 8(%rsp) in the callee. The bytes are read as
// little-endian words: the same bytes, in memory order.
//
//go:uintptrescapes
func callHandle(fn, a1, a2 uintptr, h *[api.IpcHandleSize]byte) uintptr {
	a := callArgs{fn: fn}
	a.a[0], a.a[1] = a1, a2
	for i := range 8 {
		a.a[6+i] = uintptr(binary.LittleEndian.Uint64(h[i*8 : i*8+8]))
	}
	return a.do()
}
