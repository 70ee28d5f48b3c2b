package cuda

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// The tests in this file run against the real driver. Where there is none
// they skip, unless CUDASHARE_DRIVER=cuda (set by .gpu/run.sh on the GPU
// machine), which makes a missing driver or GPU a failure: a skip there
// would hide a broken binding.

// ipcChildEnv, when set, makes the test binary the child process of
// TestGPUIpcAcrossProcesses (see TestMain); it carries
// "memhandle:eventhandle:size:ordinal", the handles in hex.
const ipcChildEnv = "CUDASHARE_CUDA_IPC_CHILD"

func realDriver(t testing.TB) *Driver {
	t.Helper()
	required := os.Getenv("CUDASHARE_DRIVER") == "cuda"
	d, err := Load("")
	if err != nil {
		if errors.Is(err, ErrLibraryNotFound) && !required {
			t.Skipf("no NVIDIA driver on this machine (%v); with CUDASHARE_DRIVER=cuda this fails", err)
		}
		t.Fatal(err)
	}
	if r := d.Init(0); r != api.Success {
		if r == api.ErrorNoDevice && !required {
			t.Skipf("cuInit: %s; with CUDASHARE_DRIVER=cuda this fails", d.ErrorName(r))
		}
		t.Fatalf("cuInit: %s", d.ErrorName(r))
	}
	return d
}

func must(t testing.TB, d *Driver, what string, r api.Result) {
	t.Helper()
	if r != api.Success {
		t.Fatalf("%s: %s", what, d.ErrorName(r))
	}
}

// usePrimary makes device ordinal's primary context current on this
// (locked) thread until the test ends.
func usePrimary(t testing.TB, d *Driver, ordinal int32) (api.Device, api.Context) {
	t.Helper()
	var dev api.Device
	must(t, d, "cuDeviceGet", d.DeviceGet(&dev, ordinal))
	var ctx api.Context
	must(t, d, "cuDevicePrimaryCtxRetain", d.DevicePrimaryCtxRetain(&ctx, dev))
	t.Cleanup(func() { d.DevicePrimaryCtxRelease(dev) })
	must(t, d, "cuCtxSetCurrent", d.CtxSetCurrent(ctx))
	return dev, ctx
}

func lockThread(t testing.TB) {
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
	return b
}

// TestGPUBasics walks every single-process call of api.API on the real
// driver and checks what each returns.
func TestGPUBasics(t *testing.T) {
	d := realDriver(t)
	lockThread(t)
	for _, b := range d.Symbols() {
		t.Logf("%-32s %s", b.Method, b.Symbol)
	}

	var version, count int32
	must(t, d, "cuDriverGetVersion", d.DriverGetVersion(&version))
	must(t, d, "cuDeviceGetCount", d.DeviceGetCount(&count))
	t.Logf("driver API %d, %d device(s)", version, count)
	if version < 12000 || count < 1 {
		t.Fatalf("driver API %d, %d devices", version, count)
	}

	var dev api.Device
	must(t, d, "cuDeviceGet", d.DeviceGet(&dev, 0))
	name := make([]byte, 256)
	must(t, d, "cuDeviceGetName", d.DeviceGetName(name, dev))
	n := bytes.IndexByte(name, 0)
	if n <= 0 {
		t.Fatalf("cuDeviceGetName: %q", name)
	}
	if r := d.DeviceGetName(nil, dev); r != api.ErrorInvalidValue {
		t.Errorf("cuDeviceGetName(NULL, 0) = %s, want CUDA_ERROR_INVALID_VALUE", d.ErrorName(r))
	}
	var uuid api.UUID
	must(t, d, "cuDeviceGetUuid", d.DeviceGetUuid(&uuid, dev))
	var total uint64
	must(t, d, "cuDeviceTotalMem", d.DeviceTotalMem(&total, dev))
	var major, minor, unified, ipcEvents int32
	must(t, d, "cuDeviceGetAttribute", d.DeviceGetAttribute(&major, api.AttrComputeCapabilityMajor, dev))
	must(t, d, "cuDeviceGetAttribute", d.DeviceGetAttribute(&minor, api.AttrComputeCapabilityMinor, dev))
	must(t, d, "cuDeviceGetAttribute", d.DeviceGetAttribute(&unified, api.AttrUnifiedAddressing, dev))
	must(t, d, "cuDeviceGetAttribute", d.DeviceGetAttribute(&ipcEvents, api.AttrIpcEventSupported, dev))
	t.Logf("device 0: %s, sm_%d%d, %d MiB, uuid %x, unified addressing %d, IPC events %d",
		name[:n], major, minor, total>>20, uuid, unified, ipcEvents)
	if uuid == (api.UUID{}) || total == 0 || major < 3 || unified != 1 {
		t.Fatalf("implausible device: uuid %x, total %d, major %d, unified %d", uuid, total, major, unified)
	}

	_, ctx := usePrimary(t, d, 0)
	var cur api.Context
	must(t, d, "cuCtxGetCurrent", d.CtxGetCurrent(&cur))
	var ctxDev api.Device = -1
	must(t, d, "cuCtxGetDevice", d.CtxGetDevice(&ctxDev))
	if cur != ctx || ctxDev != dev {
		t.Fatalf("current context %#x on device %d, want %#x on %d", cur, ctxDev, ctx, dev)
	}

	var free, tot uint64
	must(t, d, "cuMemGetInfo", d.MemGetInfo(&free, &tot))
	if tot == 0 || free > tot {
		t.Fatalf("cuMemGetInfo: free %d of %d", free, tot)
	}

	const size = 1 << 20
	var a, b api.DevicePtr
	must(t, d, "cuMemAlloc", d.MemAlloc(&a, size))
	defer d.MemFree(a)
	must(t, d, "cuMemAlloc", d.MemAlloc(&b, size))
	defer d.MemFree(b)

	var base api.DevicePtr
	var rangeSize uint64
	must(t, d, "cuMemGetAddressRange", d.MemGetAddressRange(&base, &rangeSize, a+100))
	if base != a || rangeSize < size {
		t.Errorf("cuMemGetAddressRange(a+100) = %#x+%d, want %#x+%d", base, rangeSize, a, size)
	}
	var memType uint32
	var ordinal int32 = -1
	var start api.DevicePtr
	var owner api.Context
	must(t, d, "cuPointerGetAttribute", d.PointerGetAttribute(unsafe.Pointer(&memType), api.PointerAttrMemoryType, a+1))
	must(t, d, "cuPointerGetAttribute", d.PointerGetAttribute(unsafe.Pointer(&ordinal), api.PointerAttrDeviceOrdinal, a+1))
	must(t, d, "cuPointerGetAttribute", d.PointerGetAttribute(unsafe.Pointer(&start), api.PointerAttrRangeStart, a+1))
	must(t, d, "cuPointerGetAttribute", d.PointerGetAttribute(unsafe.Pointer(&owner), api.PointerAttrContext, a+1))
	if int32(memType) != api.MemoryTypeDevice || ordinal != 0 || start != a || owner != ctx {
		t.Errorf("pointer attributes: type %d, ordinal %d, start %#x, context %#x", memType, ordinal, start, owner)
	}

	// Synchronous copies and memset.
	want := pattern(size, 0x3c)
	must(t, d, "cuMemcpyHtoD", d.MemcpyHtoD(a, unsafe.Pointer(&want[0]), size))
	must(t, d, "cuMemsetD8", d.MemsetD8(a+10, 0xee, 5))
	copy(want[10:15], []byte{0xee, 0xee, 0xee, 0xee, 0xee})
	must(t, d, "cuMemcpyDtoD", d.MemcpyDtoD(b, a, size))
	got := make([]byte, size)
	must(t, d, "cuMemcpyDtoH", d.MemcpyDtoH(unsafe.Pointer(&got[0]), b, size))
	if !bytes.Equal(got, want) {
		t.Fatal("HtoD, memset, DtoD, DtoH: the data did not come back")
	}

	// The same on a stream, timed by events.
	var s api.Stream
	must(t, d, "cuStreamCreate", d.StreamCreate(&s, api.StreamNonBlocking))
	defer d.StreamDestroy(s)
	var e0, e1 api.Event
	must(t, d, "cuEventCreate", d.EventCreate(&e0, api.EventDefault))
	defer d.EventDestroy(e0)
	must(t, d, "cuEventCreate", d.EventCreate(&e1, api.EventDefault))
	defer d.EventDestroy(e1)
	must(t, d, "cuEventRecord", d.EventRecord(e0, s))
	must(t, d, "cuMemsetD8Async", d.MemsetD8Async(b, 0x11, size, s))
	must(t, d, "cuMemcpyDtoDAsync", d.MemcpyDtoDAsync(a, b, size, s))
	must(t, d, "cuEventRecord", d.EventRecord(e1, s))
	must(t, d, "cuStreamWaitEvent", d.StreamWaitEvent(0, e1, 0))
	must(t, d, "cuEventSynchronize", d.EventSynchronize(e1))
	must(t, d, "cuEventQuery", d.EventQuery(e1))
	var ms float32 = -1
	must(t, d, "cuEventElapsedTime", d.EventElapsedTime(&ms, e0, e1))
	if ms < 0 {
		t.Errorf("cuEventElapsedTime = %v ms", ms)
	}
	must(t, d, "cuStreamSynchronize", d.StreamSynchronize(s))
	must(t, d, "cuCtxSynchronize", d.CtxSynchronize())
	must(t, d, "cuMemcpyDtoH", d.MemcpyDtoH(unsafe.Pointer(&got[0]), a, size))
	if !bytes.Equal(got, bytes.Repeat([]byte{0x11}, size)) {
		t.Fatal("MemsetD8Async, MemcpyDtoDAsync: the data did not come back")
	}

	// Handles: nonzero, from the same allocation and event.
	var mh api.IpcMemHandle
	must(t, d, "cuIpcGetMemHandle", d.IpcGetMemHandle(&mh, a))
	var ipcEv api.Event
	must(t, d, "cuEventCreate", d.EventCreate(&ipcEv, api.EventInterprocess|api.EventDisableTiming))
	defer d.EventDestroy(ipcEv)
	var eh api.IpcEventHandle
	must(t, d, "cuIpcGetEventHandle", d.IpcGetEventHandle(&eh, ipcEv))
	if mh == (api.IpcMemHandle{}) || eh == (api.IpcEventHandle{}) {
		t.Error("an IPC handle is all zero")
	}

	if got := d.ErrorName(api.ErrorInvalidValue); got != "CUDA_ERROR_INVALID_VALUE" {
		t.Errorf("ErrorName(1) = %q", got)
	}
	if got := d.ErrorName(222); !strings.HasPrefix(got, "CUDA_ERROR_") {
		t.Errorf("ErrorName(222) = %q, want the driver's name", got)
	}
}

// TestGPUCtxCreate makes a non-primary context, which cuCtxCreate makes
// current, and destroys it.
func TestGPUCtxCreate(t *testing.T) {
	d := realDriver(t)
	lockThread(t)
	dev, primary := usePrimary(t, d, 0)
	t.Logf("CtxCreate is %s", symbolOf(d, "CtxCreate"))
	var c api.Context
	must(t, d, "cuCtxCreate", d.CtxCreate(&c, 0, dev))
	var cur api.Context
	must(t, d, "cuCtxGetCurrent", d.CtxGetCurrent(&cur))
	if c == 0 || cur != c || c == primary {
		t.Fatalf("cuCtxCreate gave %#x, current %#x, primary %#x", c, cur, primary)
	}
	must(t, d, "cuCtxDestroy", d.CtxDestroy(c))
	must(t, d, "cuCtxGetCurrent", d.CtxGetCurrent(&cur))
	if cur == c {
		t.Fatalf("destroyed context %#x still current", c)
	}
	must(t, d, "cuCtxSetCurrent", d.CtxSetCurrent(primary))
}

// TestGPUIpcAcrossProcesses is the real test of the by-value IPC handles:
// a child process opens this process's memory and event handles, waits on
// the event, checks the data, overwrites half of it, and this process sees
// the write. A mislaid handle or flags word makes the open fail
// (CUDA_ERROR_INVALID_VALUE), as the child also checks with a zero handle.
// With two GPUs a second child opens the handles in a context on device 1,
// which needs CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS to arrive as the flags.
func TestGPUIpcAcrossProcesses(t *testing.T) {
	d := realDriver(t)
	var count int32
	must(t, d, "cuDeviceGetCount", d.DeviceGetCount(&count))
	t.Run("device0", func(t *testing.T) { ipcParent(t, d, 0) })
	t.Run("device1", func(t *testing.T) {
		if count < 2 {
			t.Skipf("needs two GPUs, found %d", count)
		}
		ipcParent(t, d, 1)
	})
}

// ipcParent shares memory and an event of device 0 with a child process
// that opens them in a context on device childOrdinal.
func ipcParent(t *testing.T, d *Driver, childOrdinal int) {
	lockThread(t) // a subtest runs on a goroutine of its own
	usePrimary(t, d, 0)
	const size = 1 << 20
	var p api.DevicePtr
	must(t, d, "cuMemAlloc", d.MemAlloc(&p, size))
	defer d.MemFree(p)
	data := pattern(size, 0x96)
	must(t, d, "cuMemcpyHtoD", d.MemcpyHtoD(p, unsafe.Pointer(&data[0]), size))
	var ev api.Event
	must(t, d, "cuEventCreate", d.EventCreate(&ev, api.EventInterprocess|api.EventDisableTiming))
	defer d.EventDestroy(ev)
	must(t, d, "cuEventRecord", d.EventRecord(ev, 0))
	var mh api.IpcMemHandle
	must(t, d, "cuIpcGetMemHandle", d.IpcGetMemHandle(&mh, p))
	var eh api.IpcEventHandle
	must(t, d, "cuIpcGetEventHandle", d.IpcGetEventHandle(&eh, ev))

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s:%s:%d:%d", ipcChildEnv,
		hex.EncodeToString(mh.Reserved[:]), hex.EncodeToString(eh.Reserved[:]), size, childOrdinal))
	out, err := cmd.CombinedOutput()
	t.Logf("child:\n%s", out)
	if err != nil {
		t.Fatalf("child: %v", err)
	}

	got := make([]byte, size)
	must(t, d, "cuMemcpyDtoH", d.MemcpyDtoH(unsafe.Pointer(&got[0]), p, size))
	want := append(bytes.Repeat([]byte{0x5a}, size/2), data[size/2:]...)
	if !bytes.Equal(got, want) {
		t.Fatal("the child's write through the opened handle is not in our memory")
	}
}

// ipcChild is the child side of TestGPUIpcAcrossProcesses. It returns the
// exit code.
func ipcChild() int {
	fail := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "ipc child: "+format+"\n", args...)
		return 1
	}
	runtime.LockOSThread()
	parts := strings.Split(os.Getenv(ipcChildEnv), ":")
	if len(parts) != 4 {
		return fail("bad %s", ipcChildEnv)
	}
	var mh api.IpcMemHandle
	var eh api.IpcEventHandle
	size, err := strconv.Atoi(parts[2])
	ordinal, err2 := strconv.Atoi(parts[3])
	if n, err1 := hex.Decode(mh.Reserved[:], []byte(parts[0])); err1 != nil || n != api.IpcHandleSize || err != nil || err2 != nil {
		return fail("bad %s", ipcChildEnv)
	}
	if n, err := hex.Decode(eh.Reserved[:], []byte(parts[1])); err != nil || n != api.IpcHandleSize {
		return fail("bad %s", ipcChildEnv)
	}
	d, err := Load("")
	if err != nil {
		return fail("%v", err)
	}
	check := func(what string, r api.Result) error {
		if r != api.Success {
			return fmt.Errorf("%s: %s", what, d.ErrorName(r))
		}
		return nil
	}
	var dev api.Device
	var ctx api.Context
	if err := errors.Join(
		check("cuInit", d.Init(0)),
		check("cuDeviceGet", d.DeviceGet(&dev, int32(ordinal))),
		check("cuDevicePrimaryCtxRetain", d.DevicePrimaryCtxRetain(&ctx, dev)),
		check("cuCtxSetCurrent", d.CtxSetCurrent(ctx)),
	); err != nil {
		return fail("%v", err)
	}
	defer d.DevicePrimaryCtxRelease(dev)

	var bad api.DevicePtr
	if r := d.IpcOpenMemHandle(&bad, api.IpcMemHandle{}, api.IpcMemLazyEnablePeerAccess); r != api.ErrorInvalidValue {
		if r == api.Success {
			d.IpcCloseMemHandle(bad)
		}
		return fail("cuIpcOpenMemHandle(zero handle) = %s, want CUDA_ERROR_INVALID_VALUE", d.ErrorName(r))
	}

	var ev api.Event
	if err := check("cuIpcOpenEventHandle", d.IpcOpenEventHandle(&ev, eh)); err != nil {
		return fail("%v", err)
	}
	defer d.EventDestroy(ev)
	var p api.DevicePtr
	if err := check("cuIpcOpenMemHandle", d.IpcOpenMemHandle(&p, mh, api.IpcMemLazyEnablePeerAccess)); err != nil {
		return fail("%v", err)
	}
	got := make([]byte, size)
	if err := errors.Join(
		check("cuStreamWaitEvent", d.StreamWaitEvent(0, ev, 0)),
		check("cuMemcpyDtoH", d.MemcpyDtoH(unsafe.Pointer(&got[0]), p, uint64(size))),
	); err != nil {
		return fail("%v", err)
	}
	if !bytes.Equal(got, pattern(size, 0x96)) {
		return fail("the data read through the opened handle is not the parent's")
	}
	if err := errors.Join(
		check("cuMemsetD8", d.MemsetD8(p, 0x5a, uint64(size/2))),
		check("cuCtxSynchronize", d.CtxSynchronize()),
		check("cuIpcCloseMemHandle", d.IpcCloseMemHandle(p)),
	); err != nil {
		return fail("%v", err)
	}
	fmt.Printf("ipc child on device %d: opened %#x (%d bytes), read the parent's data, wrote half\n", ordinal, p, size)
	return 0
}

// TestGPUPeer covers the calls between two devices.
func TestGPUPeer(t *testing.T) {
	d := realDriver(t)
	lockThread(t)
	var count int32
	must(t, d, "cuDeviceGetCount", d.DeviceGetCount(&count))
	if count < 2 {
		t.Skipf("needs two GPUs, found %d", count)
	}
	dev1, ctx1 := usePrimary(t, d, 1)
	dev0, ctx0 := usePrimary(t, d, 0)

	var can, access, atomics int32
	must(t, d, "cuDeviceCanAccessPeer", d.DeviceCanAccessPeer(&can, dev0, dev1))
	must(t, d, "cuDeviceGetP2PAttribute", d.DeviceGetP2PAttribute(&access, api.P2PAttrAccessSupported, dev0, dev1))
	must(t, d, "cuDeviceGetP2PAttribute", d.DeviceGetP2PAttribute(&atomics, api.P2PAttrNativeAtomicSupported, dev0, dev1))
	ops := make([]int32, api.AtomicOperationCount)
	for i := range ops {
		ops[i] = int32(i)
	}
	caps := make([]uint32, api.AtomicOperationCount)
	if r := d.DeviceGetP2PAtomicCapabilities(&caps[0], &ops[0], api.AtomicOperationCount, dev0, dev1); r != api.ErrorNotSupported {
		must(t, d, "cuDeviceGetP2PAtomicCapabilities", r)
	}
	// Driver 580 on two H200s over NV18 answers native atomics 1 and all-zero
	// capabilities (ctypes gets the same), so the capabilities are logged,
	// not checked.
	t.Logf("0->1: can access %d, access supported %d, native atomics %d, atomic capabilities %#x", can, access, atomics, caps)
	if can == 0 {
		t.Skip("device 0 cannot access device 1")
	}

	if r := d.CtxEnablePeerAccess(ctx1, 0); r != api.Success && r != api.ErrorPeerAccessAlreadyEnabled {
		must(t, d, "cuCtxEnablePeerAccess", r)
	}
	const size = 1 << 20
	var src, dst api.DevicePtr
	must(t, d, "cuMemAlloc", d.MemAlloc(&src, size))
	defer d.MemFree(src)
	data := pattern(size, 0x21)
	must(t, d, "cuMemcpyHtoD", d.MemcpyHtoD(src, unsafe.Pointer(&data[0]), size))
	must(t, d, "cuCtxSetCurrent", d.CtxSetCurrent(ctx1))
	must(t, d, "cuMemAlloc", d.MemAlloc(&dst, size))
	defer func() { d.CtxSetCurrent(ctx1); d.MemFree(dst); d.CtxSetCurrent(ctx0) }()
	must(t, d, "cuMemcpyPeer", d.MemcpyPeer(dst, ctx1, src, ctx0, size))
	got := make([]byte, size)
	must(t, d, "cuMemcpyDtoH", d.MemcpyDtoH(unsafe.Pointer(&got[0]), dst, size))
	if !bytes.Equal(got, data) {
		t.Fatal("cuMemcpyPeer: the data did not arrive")
	}
	must(t, d, "cuCtxSetCurrent", d.CtxSetCurrent(ctx0))
	must(t, d, "cuCtxDisablePeerAccess", d.CtxDisablePeerAccess(ctx1))
}

// BenchmarkGPUCall measures cheap driver calls through api.API: the cost of
// the binding plus the driver's own.
func BenchmarkGPUCall(b *testing.B) {
	d := realDriver(b)
	lockThread(b)
	_, ctx := usePrimary(b, d, 0)
	var a api.API = d
	cur := new(api.Context)
	var ev api.Event
	must(b, d, "cuEventCreate", d.EventCreate(&ev, api.EventDisableTiming))
	defer d.EventDestroy(ev)
	must(b, d, "cuEventRecord", d.EventRecord(ev, 0))
	must(b, d, "cuEventSynchronize", d.EventSynchronize(ev))
	for _, c := range []struct {
		name string
		fn   func() api.Result
	}{
		{"CtxGetCurrent", func() api.Result { return a.CtxGetCurrent(cur) }},
		{"CtxSetCurrent", func() api.Result { return a.CtxSetCurrent(ctx) }},
		{"EventQuery", func() api.Result { return a.EventQuery(ev) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if r := c.fn(); r != api.Success {
					b.Fatal(d.ErrorName(r))
				}
			}
		})
	}
}
