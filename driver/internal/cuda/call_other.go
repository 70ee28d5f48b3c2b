//go:build !amd64

package cuda

import "github.com/ebitengine/purego"

// Off amd64 the calls go through purego.SyscallN, which allocates its
// argument slice on every call; call_amd64.go has the allocation-free path.
// The helpers are //go:uintptrescapes so that a uintptr(unsafe.Pointer(p))
// written in a call to one of them keeps *p alive until it returns.

//go:uintptrescapes
func call0(fn uintptr) uintptr {
	r, _, _ := purego.SyscallN(fn)
	return r
}

//go:uintptrescapes
func call1(fn, a1 uintptr) uintptr {
	r, _, _ := purego.SyscallN(fn, a1)
	return r
}

//go:uintptrescapes
func call2(fn, a1, a2 uintptr) uintptr {
	r, _, _ := purego.SyscallN(fn, a1, a2)
	return r
}

//go:uintptrescapes
func call3(fn, a1, a2, a3 uintptr) uintptr {
	r, _, _ := purego.SyscallN(fn, a1, a2, a3)
	return r
}

//go:uintptrescapes
func call4(fn, a1, a2, a3, a4 uintptr) uintptr {
	r, _, _ := purego.SyscallN(fn, a1, a2, a3, a4)
	return r
}

//go:uintptrescapes
func call5(fn, a1, a2, a3, a4, a5 uintptr) uintptr {
	r, _, _ := purego.SyscallN(fn, a1, a2, a3, a4, a5)
	return r
}
