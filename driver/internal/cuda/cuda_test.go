package cuda

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// The tests in this file need no GPU: they load testdata/fakecuda.c, built
// with gcc into a fake libcuda whose functions record their own name and
// the arguments as C received them. They skip, saying so, where gcc is
// missing. gpu_test.go has the tests against the real driver.

var tmpDir string

func TestMain(m *testing.M) {
	if os.Getenv(ipcChildEnv) != "" {
		os.Exit(ipcChild())
	}
	var err error
	tmpDir, err = os.MkdirTemp("", "cudashare-cuda-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	code := m.Run()
	os.RemoveAll(tmpDir)
	os.Exit(code)
}

var fakeLibs struct {
	sync.Mutex
	paths map[string]string // hidden symbols -> built library
}

// fakeLibrary builds testdata/fakecuda.c into a shared library that hides
// the given symbols, once per set, and returns its path.
func fakeLibrary(t testing.TB, hide ...string) string {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("gcc not in PATH: cannot build testdata/fakecuda.c, the fake libcuda this test loads")
	}
	key := strings.Join(hide, ",")
	fakeLibs.Lock()
	defer fakeLibs.Unlock()
	if p, ok := fakeLibs.paths[key]; ok {
		return p
	}
	if fakeLibs.paths == nil {
		fakeLibs.paths = map[string]string{}
	}
	n := len(fakeLibs.paths)
	out := filepath.Join(tmpDir, fmt.Sprintf("fakecuda%d.so", n))
	// -Bsymbolic: each fake binds to its own globals even though Load opens
	// them all RTLD_GLOBAL into one process.
	args := []string{"-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-Bsymbolic", "-o", out, "testdata/fakecuda.c"}
	if len(hide) > 0 {
		// An exact name in local: wins over the wildcard in global:.
		script := filepath.Join(tmpDir, fmt.Sprintf("fakecuda%d.map", n))
		text := "{ global: *; local: " + strings.Join(hide, "; ") + "; };\n"
		if err := os.WriteFile(script, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		args = append(args, "-Wl,--version-script="+script)
	}
	if b, err := exec.Command(gcc, args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc %s: %v\n%s", strings.Join(args, " "), err, b)
	}
	fakeLibs.paths[key] = out
	return out
}

// fake is the test side of a fake library: its controls, and the Driver
// loaded from it.
type fake struct {
	*Driver
	setResult, last, nop uintptr
}

func loadFake(t testing.TB, hide ...string) *fake {
	t.Helper()
	path := fakeLibrary(t, hide...)
	d, err := Load(path)
	if err != nil {
		t.Fatalf("Load(%s): %v", path, err)
	}
	// A second dlopen of the same file returns the same handle.
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		t.Fatal(err)
	}
	f := &fake{Driver: d}
	for _, s := range []struct {
		p    *uintptr
		name string
	}{{&f.setResult, "fake_set_result"}, {&f.last, "fake_last"}, {&f.nop, "fake_nop"}} {
		if *s.p, err = purego.Dlsym(h, s.name); err != nil {
			t.Fatal(err)
		}
	}
	f.setResultCode(api.Success)
	return f
}

func (f *fake) setResultCode(r api.Result) {
	purego.SyscallN(f.setResult, uintptr(uint32(r)))
}

// call is what the fake last recorded.
type call struct {
	Name   string
	Args   []uint64
	Handle [64]byte
}

func (f *fake) lastCall() call {
	var name [64]byte
	var args [8]uint64
	var c call
	n, _, _ := purego.SyscallN(f.last, uintptr(unsafe.Pointer(&name[0])), uintptr(unsafe.Pointer(&args[0])), uintptr(unsafe.Pointer(&c.Handle[0])))
	c.Name = string(name[:strings.IndexByte(string(name[:]), 0)])
	c.Args = args[:n:n]
	return c
}

// skipUnlessAMD64 skips what only the amd64 call path provides: the
// by-value IPC handles and allocation-free calls.
func skipUnlessAMD64(t testing.TB) {
	if runtime.GOARCH != "amd64" {
		t.Skipf("by-value IPC handles and allocation-free calls are implemented on amd64 only, not %s", runtime.GOARCH)
	}
}

func ptr[T any](p *T) uint64 { return uint64(uintptr(unsafe.Pointer(p))) }

// word is an int32 as the fake records it: sign-extended, as C widens int.
func word(v int32) uint64 { return uint64(int64(v)) }

func TestBackend(t *testing.T) {
	if got := (&Driver{}).Backend(); got != "cuda" {
		t.Fatalf("Backend() = %q, want cuda", got)
	}
}

// TestBindingTable checks the table itself: one row per api.API method, and
// none of the unversioned symbols that take 32-bit sizes or have pre-4.0
// semantics.
func TestBindingTable(t *testing.T) {
	rows := map[string]int{}
	for i, b := range bindings {
		if b.method == "" || len(b.symbols) == 0 {
			t.Errorf("bindings[%d] is empty", i)
		}
		rows[b.method]++
	}
	ty := reflect.TypeFor[api.API]()
	for i := range ty.NumMethod() {
		m := ty.Method(i).Name
		if m == "Backend" {
			continue
		}
		if rows[m] != 1 {
			t.Errorf("api.API method %s has %d rows in bindings, want 1", m, rows[m])
		}
	}
	compat := []string{
		"cuDeviceTotalMem", "cuCtxCreate", "cuCtxDestroy", "cuMemAlloc", "cuMemFree", "cuMemGetInfo",
		"cuMemGetAddressRange", "cuMemsetD8", "cuMemcpyHtoD", "cuMemcpyDtoH", "cuMemcpyDtoD",
		"cuMemcpyDtoDAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemAllocHost", "cuStreamDestroy", "cuEventDestroy", "cuIpcOpenMemHandle",
		"cuDevicePrimaryCtxRelease",
	}
	for _, b := range bindings {
		for _, s := range b.symbols {
			if slices.Contains(compat, s) {
				t.Errorf("%s binds the compatibility symbol %s", b.method, s)
			}
			if strings.HasSuffix(s, "_ptsz") || strings.HasSuffix(s, "_ptds") {
				t.Errorf("%s binds the per-thread-stream variant %s", b.method, s)
			}
		}
	}
}

func TestLoadMissingLibrary(t *testing.T) {
	path := filepath.Join(t.TempDir(), "libcuda.so.1")
	d, err := Load(path)
	if !errors.Is(err, ErrLibraryNotFound) || d != nil {
		t.Fatalf("Load(missing) = %v, %v; want ErrLibraryNotFound", d, err)
	}
	// The message carries dlopen's reason and the path.
	if msg := err.Error(); !strings.Contains(msg, path) || !strings.Contains(msg, "No such file") {
		t.Errorf("error %q lacks the path or dlopen's message", msg)
	}

	notELF := filepath.Join(t.TempDir(), "libcuda.so.1")
	if err := os.WriteFile(notELF, []byte("not a shared library\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(notELF); !errors.Is(err, ErrLibraryNotFound) {
		t.Fatalf("Load(not ELF) = %v; want ErrLibraryNotFound", err)
	} else {
		t.Logf("not ELF: %v", err)
	}
}

func TestLoadDefaultLibraryMissing(t *testing.T) {
	d, err := Load("")
	if err == nil {
		t.Skipf("%s is installed on this machine (gpu_test.go tests it)", DefaultLibrary)
	}
	if !errors.Is(err, ErrLibraryNotFound) || !strings.Contains(err.Error(), DefaultLibrary) {
		t.Fatalf(`Load("") = %v, %v; want ErrLibraryNotFound naming %s`, d, err, DefaultLibrary)
	}
}

func TestLoadMissingSymbol(t *testing.T) {
	path := fakeLibrary(t, "cuMemFree_v2", "cuIpcOpenMemHandle_v2")
	d, err := Load(path)
	if !errors.Is(err, ErrSymbolNotFound) || d != nil {
		t.Fatalf("Load = %v, %v; want ErrSymbolNotFound", d, err)
	}
	// Both are named, and the exported unversioned cuMemFree did not stand in.
	msg := err.Error()
	for _, want := range []string{"cuMemFree_v2", "cuIpcOpenMemHandle_v2", path} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not name %s", msg, want)
		}
	}
	t.Log(msg)
}

func TestLoadOptionalSymbol(t *testing.T) {
	f := loadFake(t, "cuDeviceGetP2PAtomicCapabilities")
	if got := symbolOf(f.Driver, "DeviceGetP2PAtomicCapabilities"); got != "" {
		t.Fatalf("DeviceGetP2PAtomicCapabilities bound to %q in a library without it", got)
	}
	f.Init(7) // so that the last call is known
	var caps [api.AtomicOperationCount]uint32
	ops := [api.AtomicOperationCount]int32{}
	if r := f.DeviceGetP2PAtomicCapabilities(&caps[0], &ops[0], api.AtomicOperationCount, 0, 1); r != api.ErrorNotSupported {
		t.Fatalf("DeviceGetP2PAtomicCapabilities = %s, want CUDA_ERROR_NOT_SUPPORTED", r.Name())
	}
	if c := f.lastCall(); c.Name != "cuInit" {
		t.Fatalf("absent symbol still made a call: last call %s", c.Name)
	}
}

func symbolOf(d *Driver, method string) string {
	for _, b := range d.Symbols() {
		if b.Method == method {
			return b.Symbol
		}
	}
	return "?"
}

func TestLoadFallbacks(t *testing.T) {
	f := loadFake(t, "cuCtxCreate_v2", "cuDeviceGetUuid_v2", "cuEventElapsedTime_v2")
	for method, want := range map[string]string{
		"CtxCreate":        "cuCtxCreate_v4",
		"DeviceGetUuid":    "cuDeviceGetUuid",
		"EventElapsedTime": "cuEventElapsedTime",
	} {
		if got := symbolOf(f.Driver, method); got != want {
			t.Errorf("%s bound to %s, want %s", method, got, want)
		}
	}

	var ctx api.Context
	f.CtxCreate(&ctx, 0x12, -3)
	c := f.lastCall()
	// cuCtxCreate_v4(pctx, params, flags, dev), params non-NULL and all zero.
	if c.Name != "cuCtxCreate_v4" || len(c.Args) != 5 || c.Args[0] != ptr(&ctx) || c.Args[1] == 0 ||
		c.Args[2] != 0x12 || c.Args[3] != word(-3) || c.Args[4] != 1 {
		t.Errorf("CtxCreate called %s%#x", c.Name, c.Args)
	}

	var uuid api.UUID
	f.DeviceGetUuid(&uuid, 2)
	if c := f.lastCall(); c.Name != "cuDeviceGetUuid" || !slices.Equal(c.Args, []uint64{ptr(&uuid), 2}) {
		t.Errorf("DeviceGetUuid called %s%#x", c.Name, c.Args)
	}

	var ms float32
	f.EventElapsedTime(&ms, 5, 6)
	if c := f.lastCall(); c.Name != "cuEventElapsedTime" || ms != 1.5 {
		t.Errorf("EventElapsedTime called %s, ms = %v", c.Name, ms)
	}
}

// TestDispatch calls every method of api.API on the fake and checks the C
// function that ran, each argument as C saw it, and that the result code
// comes back unchanged.
func TestDispatch(t *testing.T) {
	f := loadFake(t)
	var (
		i32, i32b  int32
		u32        uint32
		u64, u64b  uint64
		dev        api.Device
		ctx        api.Context
		dptr       api.DevicePtr
		stream     api.Stream
		event      api.Event
		ms         float32
		uuid       api.UUID
		memHandle  api.IpcMemHandle
		evHandle   api.IpcEventHandle
		name       = make([]byte, 32)
		host       = make([]byte, 16)
		ops        = make([]int32, api.AtomicOperationCount)
		attrTarget uint64
		attr       = unsafe.Pointer(&attrTarget)
		vmm        api.MemHandle
		hostPtr    unsafe.Pointer
		prop       = api.MemAllocationProp{Type: api.MemAllocationTypePinned, RequestedHandleTypes: api.MemHandleTypePosixFileDescriptor,
			Location: api.MemLocation{Type: api.MemLocationTypeDevice, ID: 5}, AllocFlags: api.MemAllocFlags{GPUDirectRDMACapable: 1}}
		access = [2]api.MemAccessDesc{{}, {Location: api.MemLocation{Type: api.MemLocationTypeDevice, ID: -2}, Flags: api.MemAccessProtReadWrite}}
		loc    api.MemLocation
		fd     int32
	)
	const (
		ctxA   = api.Context(0x7f00_0000_1000)
		ctxB   = api.Context(0x7f00_0000_2000)
		dpA    = api.DevicePtr(0x7f12_3456_7000)
		dpB    = api.DevicePtr(0xffff_8000_0000_0040) // high bit set: no sign games
		strm   = api.Stream(0x5000)
		evA    = api.Event(0x6000)
		evB    = api.Event(0x6100)
		bigLen = uint64(1) << 40 // above 32 bits: the _v2 size_t
	)
	cases := []struct {
		method string
		do     func() api.Result
		sym    string
		args   []uint64
		check  func(t *testing.T)
	}{
		{"Init", func() api.Result { return f.Init(0x8000_0001) }, "cuInit", []uint64{0x8000_0001}, nil},
		{"DriverGetVersion", func() api.Result { return f.DriverGetVersion(&i32) }, "cuDriverGetVersion", []uint64{ptr(&i32)},
			func(t *testing.T) {
				if i32 != 13000 {
					t.Errorf("version = %d", i32)
				}
			}},
		{"DeviceGetCount", func() api.Result { return f.DeviceGetCount(&i32b) }, "cuDeviceGetCount", []uint64{ptr(&i32b)},
			func(t *testing.T) {
				if i32b != 3 {
					t.Errorf("count = %d", i32b)
				}
			}},
		{"DeviceGet", func() api.Result { return f.DeviceGet(&dev, -7) }, "cuDeviceGet", []uint64{ptr(&dev), word(-7)}, nil},
		{"DeviceGetName", func() api.Result { return f.DeviceGetName(name, -2) }, "cuDeviceGetName", []uint64{ptr(&name[0]), 32, word(-2)},
			func(t *testing.T) {
				if got := string(name[:strings.IndexByte(string(name), 0)]); got != "Fake GPU -2" {
					t.Errorf("name = %q", got)
				}
			}},
		{"DeviceGetUuid", func() api.Result { return f.DeviceGetUuid(&uuid, 1) }, "cuDeviceGetUuid_v2", []uint64{ptr(&uuid), 1}, nil},
		{"DeviceTotalMem", func() api.Result { return f.DeviceTotalMem(&u64, 4) }, "cuDeviceTotalMem_v2", []uint64{ptr(&u64), 4}, nil},
		{"DeviceGetAttribute", func() api.Result { return f.DeviceGetAttribute(&i32, api.AttrIpcEventSupported, 5) },
			"cuDeviceGetAttribute", []uint64{ptr(&i32), 125, 5}, nil},
		{"DevicePrimaryCtxRetain", func() api.Result { return f.DevicePrimaryCtxRetain(&ctx, 6) }, "cuDevicePrimaryCtxRetain", []uint64{ptr(&ctx), 6}, nil},
		{"DevicePrimaryCtxRelease", func() api.Result { return f.DevicePrimaryCtxRelease(-1) }, "cuDevicePrimaryCtxRelease_v2", []uint64{word(-1)}, nil},
		{"CtxCreate", func() api.Result { return f.CtxCreate(&ctx, 0x4, 2) }, "cuCtxCreate_v2", []uint64{ptr(&ctx), 4, 2}, nil},
		{"CtxDestroy", func() api.Result { return f.CtxDestroy(ctxA) }, "cuCtxDestroy_v2", []uint64{uint64(ctxA)}, nil},
		{"CtxSetCurrent", func() api.Result { return f.CtxSetCurrent(ctxB) }, "cuCtxSetCurrent", []uint64{uint64(ctxB)}, nil},
		{"CtxGetCurrent", func() api.Result { return f.CtxGetCurrent(&ctx) }, "cuCtxGetCurrent", []uint64{ptr(&ctx)}, nil},
		{"CtxGetDevice", func() api.Result { return f.CtxGetDevice(&dev) }, "cuCtxGetDevice", []uint64{ptr(&dev)}, nil},
		{"CtxSynchronize", func() api.Result { return f.CtxSynchronize() }, "cuCtxSynchronize", []uint64{}, nil},
		{"CtxEnablePeerAccess", func() api.Result { return f.CtxEnablePeerAccess(ctxA, 0xffff_ffff) }, "cuCtxEnablePeerAccess", []uint64{uint64(ctxA), 0xffff_ffff}, nil},
		{"CtxDisablePeerAccess", func() api.Result { return f.CtxDisablePeerAccess(ctxB) }, "cuCtxDisablePeerAccess", []uint64{uint64(ctxB)}, nil},
		{"DeviceCanAccessPeer", func() api.Result { return f.DeviceCanAccessPeer(&i32, 0, 1) }, "cuDeviceCanAccessPeer", []uint64{ptr(&i32), 0, 1}, nil},
		{"DeviceGetP2PAttribute", func() api.Result { return f.DeviceGetP2PAttribute(&i32, api.P2PAttrNativeAtomicSupported, 1, 0) },
			"cuDeviceGetP2PAttribute", []uint64{ptr(&i32), 3, 1, 0}, nil},
		{"DeviceGetP2PAtomicCapabilities", func() api.Result {
			return f.DeviceGetP2PAtomicCapabilities(&u32, &ops[0], api.AtomicOperationCount, 2, 3)
		}, "cuDeviceGetP2PAtomicCapabilities", []uint64{ptr(&u32), ptr(&ops[0]), api.AtomicOperationCount, 2, 3}, nil},
		{"MemAlloc", func() api.Result { return f.MemAlloc(&dptr, bigLen) }, "cuMemAlloc_v2", []uint64{ptr(&dptr), bigLen}, nil},
		{"MemFree", func() api.Result { return f.MemFree(dpB) }, "cuMemFree_v2", []uint64{uint64(dpB)}, nil},
		{"MemGetInfo", func() api.Result { return f.MemGetInfo(&u64, &u64b) }, "cuMemGetInfo_v2", []uint64{ptr(&u64), ptr(&u64b)}, nil},
		{"MemGetAddressRange", func() api.Result { return f.MemGetAddressRange(&dptr, &u64, dpA) },
			"cuMemGetAddressRange_v2", []uint64{ptr(&dptr), ptr(&u64), uint64(dpA)}, nil},
		{"PointerGetAttribute", func() api.Result { return f.PointerGetAttribute(attr, api.PointerAttrRangeSize, dpB) },
			"cuPointerGetAttribute", []uint64{ptr(&attrTarget), 12, uint64(dpB)}, nil},
		{"MemsetD8", func() api.Result { return f.MemsetD8(dpA, 0xab, bigLen+1) }, "cuMemsetD8_v2", []uint64{uint64(dpA), 0xab, bigLen + 1}, nil},
		{"MemsetD8Async", func() api.Result { return f.MemsetD8Async(dpB, 0xfe, bigLen+2, strm) },
			"cuMemsetD8Async", []uint64{uint64(dpB), 0xfe, bigLen + 2, uint64(strm)}, nil},
		{"MemcpyHtoD", func() api.Result { return f.MemcpyHtoD(dpA, unsafe.Pointer(&host[0]), bigLen+3) },
			"cuMemcpyHtoD_v2", []uint64{uint64(dpA), ptr(&host[0]), bigLen + 3}, nil},
		{"MemcpyDtoH", func() api.Result { return f.MemcpyDtoH(unsafe.Pointer(&host[1]), dpB, bigLen+4) },
			"cuMemcpyDtoH_v2", []uint64{ptr(&host[1]), uint64(dpB), bigLen + 4}, nil},
		{"MemcpyDtoD", func() api.Result { return f.MemcpyDtoD(dpA, dpB, bigLen+5) }, "cuMemcpyDtoD_v2", []uint64{uint64(dpA), uint64(dpB), bigLen + 5}, nil},
		{"MemcpyDtoDAsync", func() api.Result { return f.MemcpyDtoDAsync(dpB, dpA, bigLen+6, strm) },
			"cuMemcpyDtoDAsync_v2", []uint64{uint64(dpB), uint64(dpA), bigLen + 6, uint64(strm)}, nil},
		{"MemcpyPeer", func() api.Result { return f.MemcpyPeer(dpA, ctxA, dpB, ctxB, bigLen+7) },
			"cuMemcpyPeer", []uint64{uint64(dpA), uint64(ctxA), uint64(dpB), uint64(ctxB), bigLen + 7}, nil},
		{"MemcpyHtoDAsync", func() api.Result { return f.MemcpyHtoDAsync(dpA, unsafe.Pointer(&host[2]), bigLen+12, strm) },
			"cuMemcpyHtoDAsync_v2", []uint64{uint64(dpA), ptr(&host[2]), bigLen + 12, uint64(strm)}, nil},
		{"MemcpyDtoHAsync", func() api.Result { return f.MemcpyDtoHAsync(unsafe.Pointer(&host[3]), dpB, bigLen+13, strm) },
			"cuMemcpyDtoHAsync_v2", []uint64{ptr(&host[3]), uint64(dpB), bigLen + 13, uint64(strm)}, nil},
		{"MemHostAlloc", func() api.Result { return f.MemHostAlloc(&hostPtr, bigLen+14, api.MemHostAllocPortable) },
			"cuMemHostAlloc", []uint64{ptr(&hostPtr), bigLen + 14, 1},
			func(t *testing.T) {
				if uintptr(hostPtr) != 0x7e00beef0000 {
					t.Errorf("host pointer = %p", hostPtr)
				}
			}},
		{"MemFreeHost", func() api.Result { return f.MemFreeHost(unsafe.Pointer(&host[4])) }, "cuMemFreeHost", []uint64{ptr(&host[4])}, nil},
		{"StreamCreate", func() api.Result { return f.StreamCreate(&stream, api.StreamNonBlocking) }, "cuStreamCreate", []uint64{ptr(&stream), 1}, nil},
		{"StreamDestroy", func() api.Result { return f.StreamDestroy(strm) }, "cuStreamDestroy_v2", []uint64{uint64(strm)}, nil},
		{"StreamSynchronize", func() api.Result { return f.StreamSynchronize(0) }, "cuStreamSynchronize", []uint64{0}, nil},
		{"StreamWaitEvent", func() api.Result { return f.StreamWaitEvent(strm, evA, 0x8000_0000) }, "cuStreamWaitEvent", []uint64{uint64(strm), uint64(evA), 0x8000_0000}, nil},
		{"StreamGetCtx", func() api.Result { return f.StreamGetCtx(strm, &ctx) }, "cuStreamGetCtx", []uint64{uint64(strm), ptr(&ctx)},
			func(t *testing.T) {
				if ctx != 0x7f00c0ffee00 {
					t.Errorf("ctx = %#x", ctx)
				}
			}},
		{"EventCreate", func() api.Result { return f.EventCreate(&event, api.EventInterprocess|api.EventDisableTiming) }, "cuEventCreate", []uint64{ptr(&event), 6}, nil},
		{"EventDestroy", func() api.Result { return f.EventDestroy(evB) }, "cuEventDestroy_v2", []uint64{uint64(evB)}, nil},
		{"EventRecord", func() api.Result { return f.EventRecord(evA, strm) }, "cuEventRecord", []uint64{uint64(evA), uint64(strm)}, nil},
		{"EventSynchronize", func() api.Result { return f.EventSynchronize(evA) }, "cuEventSynchronize", []uint64{uint64(evA)}, nil},
		{"EventQuery", func() api.Result { return f.EventQuery(evB) }, "cuEventQuery", []uint64{uint64(evB)}, nil},
		{"EventElapsedTime", func() api.Result { return f.EventElapsedTime(&ms, evA, evB) }, "cuEventElapsedTime_v2", []uint64{ptr(&ms), uint64(evA), uint64(evB)},
			func(t *testing.T) {
				if ms != 2.5 {
					t.Errorf("ms = %v", ms)
				}
			}},
		{"IpcGetEventHandle", func() api.Result { return f.IpcGetEventHandle(&evHandle, evA) }, "cuIpcGetEventHandle", []uint64{ptr(&evHandle), uint64(evA)}, nil},
		{"IpcOpenEventHandle", func() api.Result { return f.IpcOpenEventHandle(&event, evHandle) }, "cuIpcOpenEventHandle", []uint64{ptr(&event)}, nil},
		{"IpcGetMemHandle", func() api.Result { return f.IpcGetMemHandle(&memHandle, dpA) }, "cuIpcGetMemHandle", []uint64{ptr(&memHandle), uint64(dpA)}, nil},
		{"IpcOpenMemHandle", func() api.Result { return f.IpcOpenMemHandle(&dptr, memHandle, api.IpcMemLazyEnablePeerAccess) },
			"cuIpcOpenMemHandle_v2", []uint64{ptr(&dptr), 1}, nil},
		{"IpcCloseMemHandle", func() api.Result { return f.IpcCloseMemHandle(dpB) }, "cuIpcCloseMemHandle", []uint64{uint64(dpB)}, nil},
		// The fake also records the CUmemAllocationProp and CUmemAccessDesc
		// fields that gcc's layout puts where our structs put them.
		{"MemGetAllocationGranularity", func() api.Result {
			return f.MemGetAllocationGranularity(&u64, &prop, api.MemAllocGranularityRecommended)
		},
			"cuMemGetAllocationGranularity", []uint64{ptr(&u64), ptr(&prop), 1, 1, 1, 1, 5},
			func(t *testing.T) {
				if u64 != 2<<20 {
					t.Errorf("granularity = %d", u64)
				}
			}},
		{"MemCreate", func() api.Result { return f.MemCreate(&vmm, bigLen, &prop, 1<<63) },
			"cuMemCreate", []uint64{ptr(&vmm), bigLen, ptr(&prop), 1 << 63, 1, 5, 1},
			func(t *testing.T) {
				if vmm != 0xabcdef0123 {
					t.Errorf("handle = %#x", vmm)
				}
			}},
		{"MemRelease", func() api.Result { return f.MemRelease(0xffff_0000_0000_0001) }, "cuMemRelease", []uint64{0xffff_0000_0000_0001}, nil},
		{"MemExportToShareableHandle", func() api.Result {
			return f.MemExportToShareableHandle(unsafe.Pointer(&fd), 0x8000_0000_0000_0002, api.MemHandleTypePosixFileDescriptor, 0)
		}, "cuMemExportToShareableHandle", []uint64{ptr(&fd), 0x8000_0000_0000_0002, 1, 0},
			func(t *testing.T) {
				if fd != 42 {
					t.Errorf("fd = %d", fd)
				}
			}},
		{"MemImportFromShareableHandle", func() api.Result {
			return f.MemImportFromShareableHandle(&vmm, 17, api.MemHandleTypePosixFileDescriptor)
		},
			"cuMemImportFromShareableHandle", []uint64{ptr(&vmm), 17, 1}, nil},
		{"MemAddressReserve", func() api.Result { return f.MemAddressReserve(&dptr, bigLen, 1<<21, dpB, 3) },
			"cuMemAddressReserve", []uint64{ptr(&dptr), bigLen, 1 << 21, uint64(dpB), 3}, nil},
		{"MemAddressFree", func() api.Result { return f.MemAddressFree(dpA, bigLen+8) }, "cuMemAddressFree", []uint64{uint64(dpA), bigLen + 8}, nil},
		{"MemMap", func() api.Result { return f.MemMap(dpB, bigLen+9, 1<<33, 0xfedc_ba98_7654_3210, 7) },
			"cuMemMap", []uint64{uint64(dpB), bigLen + 9, 1 << 33, 0xfedc_ba98_7654_3210, 7}, nil},
		{"MemUnmap", func() api.Result { return f.MemUnmap(dpA, bigLen+10) }, "cuMemUnmap", []uint64{uint64(dpA), bigLen + 10}, nil},
		{"MemSetAccess", func() api.Result { return f.MemSetAccess(dpA, bigLen+11, &access[0], 2) },
			"cuMemSetAccess", []uint64{uint64(dpA), bigLen + 11, ptr(&access[0]), 2, 1, word(-2), 3}, nil},
		{"MemGetAccess", func() api.Result { return f.MemGetAccess(&u64b, &loc, dpB) }, "cuMemGetAccess", []uint64{ptr(&u64b), ptr(&loc), uint64(dpB)},
			func(t *testing.T) {
				if u64b != 3 {
					t.Errorf("flags = %d", u64b)
				}
			}},
	}

	covered := map[string]bool{}
	for i, c := range cases {
		covered[c.method] = true
		t.Run(c.method, func(t *testing.T) {
			if strings.HasPrefix(c.method, "IpcOpen") {
				skipUnlessAMD64(t)
			}
			code := api.Result(1000 + i)
			f.setResultCode(code)
			if r := c.do(); r != code {
				t.Errorf("result %s, want %s", r.Name(), code.Name())
			}
			got := f.lastCall()
			if got.Name != c.sym || !slices.Equal(got.Args, c.args) {
				t.Errorf("called %s%#x\n      want %s%#x", got.Name, got.Args, c.sym, c.args)
			}
			if want := symbolOf(f.Driver, c.method); want != c.sym {
				t.Errorf("Symbols() says %s for %s, the call went to %s", want, c.method, c.sym)
			}
			if c.check != nil {
				c.check(t)
			}
		})
	}
	ty := reflect.TypeFor[api.API]()
	for i := range ty.NumMethod() {
		if m := ty.Method(i).Name; m != "Backend" && !covered[m] {
			t.Errorf("no dispatch case for api.API method %s", m)
		}
	}
}

// handlePattern is a 64-byte pattern in which every byte differs from its
// neighbours and from its position, so that a shifted, truncated or
// reordered copy cannot match.
func handlePattern(seed byte) (h [api.IpcHandleSize]byte) {
	for i := range h {
		h[i] = byte(i)*37 + seed
	}
	return h
}

// TestIpcHandleByValue proves the by-value layout of the 64-byte IPC
// handles: a C function compiled by gcc with the real signature gets back
// every byte of the struct, and the scalar argument after it (Flags, which
// must come in RSI because the struct takes no register) arrives intact.
// purego.RegisterFunc, which lays out struct arguments by its own code, is
// checked to agree.
func TestIpcHandleByValue(t *testing.T) {
	skipUnlessAMD64(t)
	f := loadFake(t)
	var ones [api.IpcHandleSize]byte
	for i := range ones {
		ones[i] = 0xff
	}
	patterns := [][api.IpcHandleSize]byte{handlePattern(11), handlePattern(200), {}, ones}

	var openMem func(*api.DevicePtr, api.IpcMemHandle, uint32) api.Result
	var openEvent func(*api.Event, api.IpcEventHandle) api.Result
	purego.RegisterFunc(&openMem, f.fns[fnIpcOpenMemHandle])
	purego.RegisterFunc(&openEvent, f.fns[fnIpcOpenEventHandle])

	for i, p := range patterns {
		var dptr api.DevicePtr
		var ev api.Event
		flags := uint32(0xa5a5_0000) | uint32(i)
		for _, via := range []struct {
			name  string
			mem   func(*api.DevicePtr, api.IpcMemHandle, uint32) api.Result
			event func(*api.Event, api.IpcEventHandle) api.Result
		}{
			{"Driver", f.IpcOpenMemHandle, f.IpcOpenEventHandle},
			{"purego.RegisterFunc", openMem, openEvent},
		} {
			via.mem(&dptr, api.IpcMemHandle{Reserved: p}, flags)
			c := f.lastCall()
			if c.Name != "cuIpcOpenMemHandle_v2" || !slices.Equal(c.Args, []uint64{ptr(&dptr), uint64(flags)}) || c.Handle != p {
				t.Errorf("%s: pattern %d: cuIpcOpenMemHandle_v2 got %s%#x handle\n% x\nwant\n% x", via.name, i, c.Name, c.Args, c.Handle, p)
			}
			via.event(&ev, api.IpcEventHandle{Reserved: p})
			c = f.lastCall()
			if c.Name != "cuIpcOpenEventHandle" || !slices.Equal(c.Args, []uint64{ptr(&ev)}) || c.Handle != p {
				t.Errorf("%s: pattern %d: cuIpcOpenEventHandle got %s%#x handle\n% x\nwant\n% x", via.name, i, c.Name, c.Args, c.Handle, p)
			}
		}
	}
}

func TestErrorName(t *testing.T) {
	f := loadFake(t)
	if got := f.ErrorName(12345); got != "FAKE_ERROR_12345" {
		t.Errorf("ErrorName(12345) = %q, want the driver's FAKE_ERROR_12345", got)
	}
	// The driver does not know the code: our own name for it.
	f.setResultCode(api.ErrorInvalidValue)
	if got := f.ErrorName(api.ErrorOutOfMemory); got != "CUDA_ERROR_OUT_OF_MEMORY" {
		t.Errorf("ErrorName(2) with cuGetErrorName failing = %q", got)
	}
	if got := f.ErrorName(12345); got != "CUresult(12345)" {
		t.Errorf("ErrorName(12345) with cuGetErrorName failing = %q", got)
	}
}

// TestNoAllocs checks that calls through api.API allocate nothing, the
// struct-by-value ones included.
func TestNoAllocs(t *testing.T) {
	skipUnlessAMD64(t)
	f := loadFake(t)
	var a api.API = f.Driver
	var (
		ctx    = new(api.Context)
		dptr   = new(api.DevicePtr)
		ev     = new(api.Event)
		host   = make([]byte, 64)
		name   = make([]byte, 64)
		handle api.IpcMemHandle
		evh    api.IpcEventHandle
	)
	for _, c := range []struct {
		name string
		fn   func()
	}{
		{"CtxGetCurrent", func() { a.CtxGetCurrent(ctx) }},
		{"CtxSetCurrent", func() { a.CtxSetCurrent(*ctx) }},
		{"CtxSynchronize", func() { a.CtxSynchronize() }},
		{"MemcpyHtoD", func() { a.MemcpyHtoD(1, unsafe.Pointer(&host[0]), 64) }},
		{"MemcpyPeer", func() { a.MemcpyPeer(1, 2, 3, 4, 5) }},
		{"DeviceGetName", func() { a.DeviceGetName(name, 0) }},
		{"IpcOpenMemHandle", func() { a.IpcOpenMemHandle(dptr, handle, 1) }},
		{"IpcOpenEventHandle", func() { a.IpcOpenEventHandle(ev, evh) }},
		{"EventQuery", func() { a.EventQuery(*ev) }},
	} {
		if n := testing.AllocsPerRun(100, c.fn); n != 0 {
			t.Errorf("%s: %v allocations per call", c.name, n)
		}
	}
}

// BenchmarkCallOverhead measures one call into a C function that does
// nothing, by this package's path and by purego's two.
func BenchmarkCallOverhead(b *testing.B) {
	f := loadFake(b)
	p := new(int64)
	b.Run("trampoline", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			call2(f.nop, uintptr(unsafe.Pointer(p)), 8)
		}
	})
	b.Run("purego.SyscallN", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			purego.SyscallN(f.nop, uintptr(unsafe.Pointer(p)), 8)
		}
	})
	b.Run("purego.RegisterFunc", func(b *testing.B) {
		var nop func(*int64, uint64) int32
		purego.RegisterFunc(&nop, f.nop)
		b.ReportAllocs()
		for b.Loop() {
			nop(p, 8)
		}
	})
	b.Run("api.API.IpcOpenMemHandle", func(b *testing.B) {
		var a api.API = f.Driver
		var h api.IpcMemHandle
		dptr := new(api.DevicePtr)
		b.ReportAllocs()
		for b.Loop() {
			a.IpcOpenMemHandle(dptr, h, 1)
		}
	})
}

// TestLoadWithoutVMM: a driver without the VMM calls (older than CUDA 10.2)
// still loads, and those methods say CUDA_ERROR_NOT_SUPPORTED without a call.
func TestLoadWithoutVMM(t *testing.T) {
	f := loadFake(t, "cuMemCreate", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle")
	for _, m := range []string{"MemCreate", "MemExportToShareableHandle", "MemImportFromShareableHandle"} {
		if got := symbolOf(f.Driver, m); got != "" {
			t.Errorf("%s bound to %q in a library without it", m, got)
		}
	}
	f.Init(7)
	var h api.MemHandle
	prop := api.MemAllocationProp{}
	var fd int32
	for name, r := range map[string]api.Result{
		"MemCreate":                    f.MemCreate(&h, 2<<20, &prop, 0),
		"MemExportToShareableHandle":   f.MemExportToShareableHandle(unsafe.Pointer(&fd), 1, api.MemHandleTypePosixFileDescriptor, 0),
		"MemImportFromShareableHandle": f.MemImportFromShareableHandle(&h, 3, api.MemHandleTypePosixFileDescriptor),
	} {
		if r != api.ErrorNotSupported {
			t.Errorf("%s = %s, want CUDA_ERROR_NOT_SUPPORTED", name, r.Name())
		}
	}
	if c := f.lastCall(); c.Name != "cuInit" {
		t.Fatalf("absent symbols still made a call: last call %s", c.Name)
	}
}
