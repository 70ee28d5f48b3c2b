package driver

import (
	"bytes"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// The conformance suite: the contract of the CUDA documentation pages in
// shared/seeds, checked on whichever backend CUDASHARE_DRIVER selects. On CI
// that is the simulator; scripts/gpu-test runs the same binary with
// CUDASHARE_DRIVER=cuda on real GPUs. Where the two disagree, the real
// driver is right and the simulator is changed.
//
// Every (function, return code) that the seed pages list has at least one
// case (TestConformanceCoversSeeds checks that). A case says whether real
// hardware can produce its code; one that cannot still runs on the
// simulator, and skips on real GPUs saying why.

var testDriver *Driver

func TestMain(m *testing.M) {
	if name := os.Getenv(envChild); name != "" {
		os.Exit(runChildMain(name))
	}
	code := func() int {
		if os.Getenv("CUDASHARE_SIM_DIR") == "" {
			dir, err := os.MkdirTemp("", "cudashare-sim-test-")
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			defer os.RemoveAll(dir)
			os.Setenv("CUDASHARE_SIM_DIR", dir)
		}
		d, err := Open(Config{})
		if err != nil {
			fmt.Fprintln(os.Stderr, "open driver:", err)
			return 1
		}
		testDriver = d
		fmt.Fprintf(os.Stderr, "driver tests on backend %s (%s)\n", d.Backend(), d.Reason())
		return m.Run()
	}()
	os.Exit(code)
}

type confEnv struct {
	d *Driver
	a api.API
	n int
}

func newConfEnv(t *testing.T) *confEnv {
	t.Helper()
	n, err := testDriver.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	return &confEnv{d: testDriver, a: testDriver.raw(), n: n}
}

func (e *confEnv) isSim() bool { return e.d.Backend() == BackendSim }

// lockThread pins the test goroutine: current contexts are per thread.
func lockThread(t *testing.T) {
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
}

func (e *confEnv) needDevices(t *testing.T, n int) {
	t.Helper()
	if e.n < n {
		t.Skipf("needs %d devices, this machine has %d", n, e.n)
	}
}

// primary retains device ord's primary context until the test ends.
func (e *confEnv) primary(t *testing.T, ord int) api.Context {
	t.Helper()
	var dev api.Device
	if r := e.a.DeviceGet(&dev, int32(ord)); r != api.Success {
		t.Fatalf("cuDeviceGet(%d): %s", ord, r.Name())
	}
	var c api.Context
	if r := e.a.DevicePrimaryCtxRetain(&c, dev); r != api.Success {
		t.Fatalf("cuDevicePrimaryCtxRetain(%d): %s", ord, r.Name())
	}
	t.Cleanup(func() { e.a.DevicePrimaryCtxRelease(dev) })
	return c
}

func (e *confEnv) setCurrent(t *testing.T, c api.Context) {
	t.Helper()
	if r := e.a.CtxSetCurrent(c); r != api.Success {
		t.Fatalf("cuCtxSetCurrent: %s", r.Name())
	}
}

// peerPair returns two devices that can access each other, or skips.
func (e *confEnv) peerPair(t *testing.T) (int, int) {
	t.Helper()
	e.needDevices(t, 2)
	for i := 0; i < e.n; i++ {
		for j := 0; j < e.n; j++ {
			if i == j {
				continue
			}
			var a, b int32
			e.a.DeviceCanAccessPeer(&a, api.Device(i), api.Device(j))
			e.a.DeviceCanAccessPeer(&b, api.Device(j), api.Device(i))
			if a == 1 && b == 1 {
				return i, j
			}
		}
	}
	t.Skip("no pair of devices here can access each other (cuDeviceCanAccessPeer is 0)")
	return 0, 0
}

// peerContexts finds two devices that can access each other, retains
// their primary contexts on a locked thread and makes the first current.
func (e *confEnv) peerContexts(t *testing.T) (cur, peer api.Context) {
	t.Helper()
	i, j := e.peerPair(t)
	lockThread(t)
	cur, peer = e.primary(t, i), e.primary(t, j)
	e.setCurrent(t, cur)
	return cur, peer
}

// alloc makes a device allocation in the current context, freed at the end.
func (e *confEnv) alloc(t *testing.T, c api.Context, size uint64) api.DevicePtr {
	t.Helper()
	var p api.DevicePtr
	if r := e.a.MemAlloc(&p, size); r != api.Success {
		t.Fatalf("cuMemAlloc_v2: %s", r.Name())
	}
	t.Cleanup(func() {
		e.a.CtxSetCurrent(c)
		if r := e.a.MemFree(p); r != api.Success {
			t.Errorf("cuMemFree_v2 at cleanup: %s", r.Name())
		}
	})
	return p
}

func (e *confEnv) handle(t *testing.T, p api.DevicePtr) api.IpcMemHandle {
	t.Helper()
	var h api.IpcMemHandle
	if r := e.a.IpcGetMemHandle(&h, p); r != api.Success {
		t.Fatalf("cuIpcGetMemHandle: %s", r.Name())
	}
	return h
}

type confCase struct {
	fn   string     // the C function
	code api.Result // the code the case must produce
	what string     // the situation
	// notReal is empty when real hardware can produce the code; otherwise
	// it says why not, and the case skips on the real driver.
	notReal string
	// tryReal runs the case on real hardware anyway: it finds hardware that
	// fits, or skips saying what is missing.
	tryReal bool
	run     func(t *testing.T, e *confEnv) api.Result
}

// Sim topologies for cases that need hardware we do not have. The format
// is the simulator's (driver/internal/sim).
const (
	topoNoPeers   = `{"devices":2,"peer":[[1,0],[0,1]]}`
	topoPeerLimit = `{"devices":3,"max_peers":1}`
)

var seedCodes = map[string][]api.Result{
	"cuCtxEnablePeerAccess":            {api.Success, api.ErrorDeinitialized, api.ErrorNotInitialized, api.ErrorPeerAccessAlreadyEnabled, api.ErrorTooManyPeers, api.ErrorInvalidContext, api.ErrorPeerAccessUnsupported, api.ErrorInvalidValue},
	"cuCtxDisablePeerAccess":           {api.Success, api.ErrorDeinitialized, api.ErrorNotInitialized, api.ErrorPeerAccessNotEnabled, api.ErrorInvalidContext},
	"cuDeviceCanAccessPeer":            {api.Success, api.ErrorDeinitialized, api.ErrorNotInitialized, api.ErrorInvalidDevice},
	"cuDeviceGetP2PAtomicCapabilities": {api.Success, api.ErrorInvalidDevice, api.ErrorInvalidValue},
	"cuDeviceGetP2PAttribute":          {api.Success, api.ErrorDeinitialized, api.ErrorNotInitialized, api.ErrorInvalidDevice, api.ErrorInvalidValue},
	"cuIpcOpenMemHandle_v2":            {api.Success, api.ErrorInvalidContext, api.ErrorMapFailed, api.ErrorInvalidHandle, api.ErrorTooManyPeers, api.ErrorInvalidValue},
}

const notRealDeinit = "the real driver returns it only while the process tears CUDA down"

func conformanceCases() []confCase {
	var cs []confCase
	add := func(c confCase) { cs = append(cs, c) }

	// Not initialized, and deinitialized: for each function whose page lists them.
	for _, fn := range []string{"cuCtxEnablePeerAccess", "cuCtxDisablePeerAccess", "cuDeviceCanAccessPeer", "cuDeviceGetP2PAttribute"} {
		fn := fn
		add(confCase{fn: fn, code: api.ErrorNotInitialized, what: "called before cuInit, in a fresh process",
			run: func(t *testing.T, e *confEnv) api.Result {
				r, note := startChild(t, e, "call", map[string]string{"FN": fn, "NOINIT": "1"}).finish()
				t.Log(note)
				return r
			}})
		add(confCase{fn: fn, code: api.ErrorDeinitialized, what: "called after the driver was torn down", notReal: notRealDeinit,
			run: func(t *testing.T, e *confEnv) api.Result {
				r, note := startChild(t, e, "call", map[string]string{"FN": fn, "DEINIT": "1"}).finish()
				t.Log(note)
				return r
			}})
	}

	// cuCtxEnablePeerAccess
	add(confCase{fn: "cuCtxEnablePeerAccess", code: api.Success, what: "two peer-capable devices",
		run: func(t *testing.T, e *confEnv) api.Result {
			ci, cj := e.peerContexts(t)
			r := e.a.CtxEnablePeerAccess(cj, 0)
			if r == api.Success {
				t.Cleanup(func() { e.a.CtxSetCurrent(ci); e.a.CtxDisablePeerAccess(cj) })
			}
			return r
		}})
	add(confCase{fn: "cuCtxEnablePeerAccess", code: api.ErrorPeerAccessAlreadyEnabled, what: "enabled twice",
		run: func(t *testing.T, e *confEnv) api.Result {
			ci, cj := e.peerContexts(t)
			if r := e.a.CtxEnablePeerAccess(cj, 0); r != api.Success {
				t.Fatalf("first enable: %s", r.Name())
			}
			t.Cleanup(func() { e.a.CtxSetCurrent(ci); e.a.CtxDisablePeerAccess(cj) })
			return e.a.CtxEnablePeerAccess(cj, 0)
		}})
	add(confCase{fn: "cuCtxEnablePeerAccess", code: api.ErrorInvalidValue, what: "Flags not 0",
		run: func(t *testing.T, e *confEnv) api.Result {
			ci, cj := e.peerContexts(t)
			r := e.a.CtxEnablePeerAccess(cj, 1)
			if r == api.Success {
				t.Cleanup(func() { e.a.CtxSetCurrent(ci); e.a.CtxDisablePeerAccess(cj) })
			}
			return r
		}})
	add(confCase{fn: "cuCtxEnablePeerAccess", code: api.ErrorInvalidContext, what: "no current context",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 1)
			lockThread(t)
			c := e.primary(t, e.n-1)
			e.setCurrent(t, 0)
			return e.a.CtxEnablePeerAccess(c, 0)
		}})
	// The page says INVALID_CONTEXT "if the current context is peerContext";
	// driver 580 returns PEER_ACCESS_UNSUPPORTED (a context cannot be its
	// own peer), measured on an H100. The real driver decides.
	add(confCase{fn: "cuCtxEnablePeerAccess", code: api.ErrorPeerAccessUnsupported, what: "peerContext is the current context",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 1)
			lockThread(t)
			c := e.primary(t, 0)
			e.setCurrent(t, c)
			return e.a.CtxEnablePeerAccess(c, 0)
		}})
	// Not a code the page lists: driver 580 says CONTEXT_IS_DESTROYED for a
	// destroyed peer (measured on an H100), and so does the simulator.
	add(confCase{fn: "cuCtxEnablePeerAccess", code: api.ErrorContextIsDestroyed, what: "peerContext was destroyed (in a child process, in case the driver does not survive it)",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 1)
			r, note := startChild(t, e, "enable-destroyed-peer", nil).finish()
			t.Log(note)
			return r
		}})
	add(confCase{fn: "cuCtxEnablePeerAccess", code: api.ErrorPeerAccessUnsupported, what: "devices that cannot access each other",
		notReal: "needs a device pair without peer access; every pair of a two-H200 NVLink machine has it", tryReal: true,
		run: func(t *testing.T, e *confEnv) api.Result {
			return runOnTopology(t, e, topoNoPeers, "enable-unsupported", e.noPeerPair)
		}})
	add(confCase{fn: "cuCtxEnablePeerAccess", code: api.ErrorTooManyPeers, what: "peer hardware resources exhausted",
		notReal: "needs more peer-capable devices than the hardware's peer limit (8 or more)",
		run: func(t *testing.T, e *confEnv) api.Result {
			return runOnTopology(t, e, topoPeerLimit, "enable-too-many", nil)
		}})

	// cuCtxDisablePeerAccess
	add(confCase{fn: "cuCtxDisablePeerAccess", code: api.Success, what: "after enabling",
		run: func(t *testing.T, e *confEnv) api.Result {
			_, cj := e.peerContexts(t)
			if r := e.a.CtxEnablePeerAccess(cj, 0); r != api.Success {
				t.Fatalf("enable: %s", r.Name())
			}
			return e.a.CtxDisablePeerAccess(cj)
		}})
	add(confCase{fn: "cuCtxDisablePeerAccess", code: api.ErrorPeerAccessNotEnabled, what: "never enabled",
		run: func(t *testing.T, e *confEnv) api.Result {
			_, cj := e.peerContexts(t)
			return e.a.CtxDisablePeerAccess(cj)
		}})
	add(confCase{fn: "cuCtxDisablePeerAccess", code: api.ErrorInvalidContext, what: "no current context",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 1)
			lockThread(t)
			c := e.primary(t, 0)
			e.setCurrent(t, 0)
			return e.a.CtxDisablePeerAccess(c)
		}})

	// cuDeviceCanAccessPeer
	add(confCase{fn: "cuDeviceCanAccessPeer", code: api.Success, what: "every ordered pair, and a device with itself (0)",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 1)
			for i := 0; i < e.n; i++ {
				for j := 0; j < e.n; j++ {
					v := int32(-1)
					if r := e.a.DeviceCanAccessPeer(&v, api.Device(i), api.Device(j)); r != api.Success {
						return r
					}
					if v != 0 && v != 1 {
						t.Errorf("canAccessPeer(%d,%d) = %d, want 0 or 1", i, j, v)
					}
					if i == j && v != 0 {
						t.Errorf("canAccessPeer(%d,%d) = %d, want 0 for a device with itself", i, j, v)
					}
					t.Logf("canAccessPeer(%d,%d) = %d", i, j, v)
				}
			}
			return api.Success
		}})
	add(confCase{fn: "cuDeviceCanAccessPeer", code: api.ErrorInvalidDevice, what: "peerDev out of range",
		run: func(t *testing.T, e *confEnv) api.Result {
			var v int32
			return e.a.DeviceCanAccessPeer(&v, 0, api.Device(e.n))
		}})
	add(confCase{fn: "cuDeviceCanAccessPeer", code: api.ErrorInvalidDevice, what: "dev out of range",
		run: func(t *testing.T, e *confEnv) api.Result {
			var v int32
			return e.a.DeviceCanAccessPeer(&v, api.Device(e.n), 0)
		}})

	// cuDeviceGetP2PAttribute
	add(confCase{fn: "cuDeviceGetP2PAttribute", code: api.Success, what: "all five attributes of every ordered pair",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 2)
			for i := 0; i < e.n; i++ {
				for j := 0; j < e.n; j++ {
					if i == j {
						continue
					}
					for attr := int32(1); attr <= 5; attr++ {
						v := int32(-1)
						if r := e.a.DeviceGetP2PAttribute(&v, attr, api.Device(i), api.Device(j)); r != api.Success {
							t.Logf("attribute %d of %d->%d: %s", attr, i, j, r.Name())
							return r
						}
						if v < 0 {
							t.Errorf("attribute %d of %d->%d = %d", attr, i, j, v)
						}
						t.Logf("p2p attribute %d of %d->%d = %d", attr, i, j, v)
					}
					var access, can int32
					e.a.DeviceGetP2PAttribute(&access, api.P2PAttrAccessSupported, api.Device(i), api.Device(j))
					e.a.DeviceCanAccessPeer(&can, api.Device(i), api.Device(j))
					if access != can {
						t.Errorf("ACCESS_SUPPORTED %d->%d = %d but cuDeviceCanAccessPeer = %d", i, j, access, can)
					}
				}
			}
			return api.Success
		}})
	add(confCase{fn: "cuDeviceGetP2PAttribute", code: api.ErrorInvalidDevice, what: "srcDevice == dstDevice",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 1)
			var v int32
			return e.a.DeviceGetP2PAttribute(&v, api.P2PAttrAccessSupported, 0, 0)
		}})
	add(confCase{fn: "cuDeviceGetP2PAttribute", code: api.ErrorInvalidDevice, what: "dstDevice out of range",
		run: func(t *testing.T, e *confEnv) api.Result {
			var v int32
			return e.a.DeviceGetP2PAttribute(&v, api.P2PAttrAccessSupported, 0, api.Device(e.n))
		}})
	add(confCase{fn: "cuDeviceGetP2PAttribute", code: api.ErrorInvalidValue, what: "attribute 0 (not a valid attribute)",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 2)
			var v int32
			return e.a.DeviceGetP2PAttribute(&v, 0, 0, 1)
		}})
	add(confCase{fn: "cuDeviceGetP2PAttribute", code: api.ErrorInvalidValue, what: "attribute 99 (not a valid attribute)",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 2)
			var v int32
			return e.a.DeviceGetP2PAttribute(&v, 99, 0, 1)
		}})
	add(confCase{fn: "cuDeviceGetP2PAttribute", code: api.ErrorInvalidValue, what: "value is NULL",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 2)
			return e.a.DeviceGetP2PAttribute(nil, api.P2PAttrAccessSupported, 0, 1)
		}})

	// cuDeviceGetP2PAtomicCapabilities
	allOps := make([]int32, api.AtomicOperationCount)
	for i := range allOps {
		allOps[i] = int32(i)
	}
	add(confCase{fn: "cuDeviceGetP2PAtomicCapabilities", code: api.Success, what: "all 13 operations over every ordered pair",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 2)
			for i := 0; i < e.n; i++ {
				for j := 0; j < e.n; j++ {
					if i == j {
						continue
					}
					caps := make([]uint32, len(allOps))
					if r := e.a.DeviceGetP2PAtomicCapabilities(&caps[0], &allOps[0], uint32(len(allOps)), api.Device(i), api.Device(j)); r != api.Success {
						return r
					}
					for k, c := range caps {
						if c&^0x7f != 0 {
							t.Errorf("op %d %d->%d: capability 0x%x has bits outside CUatomicOperationCapability", k, i, j, c)
						}
					}
					t.Logf("atomic caps %d->%d: %#x", i, j, caps)
				}
			}
			return api.Success
		}})
	add(confCase{fn: "cuDeviceGetP2PAtomicCapabilities", code: api.ErrorInvalidDevice, what: "srcDevice == dstDevice",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 1)
			var c uint32
			op := api.AtomicIntegerAdd
			return e.a.DeviceGetP2PAtomicCapabilities(&c, &op, 1, 0, 0)
		}})
	add(confCase{fn: "cuDeviceGetP2PAtomicCapabilities", code: api.ErrorInvalidDevice, what: "dstDevice out of range",
		run: func(t *testing.T, e *confEnv) api.Result {
			var c uint32
			op := api.AtomicIntegerAdd
			return e.a.DeviceGetP2PAtomicCapabilities(&c, &op, 1, 0, api.Device(e.n))
		}})
	for _, bad := range []struct {
		what string
		call func(e *confEnv) api.Result
	}{
		{"capabilities is NULL", func(e *confEnv) api.Result {
			op := api.AtomicIntegerAdd
			return e.a.DeviceGetP2PAtomicCapabilities(nil, &op, 1, 0, 1)
		}},
		{"operations is NULL", func(e *confEnv) api.Result { var c uint32; return e.a.DeviceGetP2PAtomicCapabilities(&c, nil, 1, 0, 1) }},
		{"count is 0", func(e *confEnv) api.Result {
			var c uint32
			op := api.AtomicIntegerAdd
			return e.a.DeviceGetP2PAtomicCapabilities(&c, &op, 0, 0, 1)
		}},
		{"an operation that is not a CUatomicOperation (13)", func(e *confEnv) api.Result {
			var c uint32
			op := int32(api.AtomicOperationCount)
			return e.a.DeviceGetP2PAtomicCapabilities(&c, &op, 1, 0, 1)
		}},
	} {
		bad := bad
		add(confCase{fn: "cuDeviceGetP2PAtomicCapabilities", code: api.ErrorInvalidValue, what: bad.what,
			run: func(t *testing.T, e *confEnv) api.Result { e.needDevices(t, 2); return bad.call(e) }})
	}

	// cuIpcOpenMemHandle_v2
	add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.Success, what: "another process opens, same device, and reads what the exporter wrote",
		run: func(t *testing.T, e *confEnv) api.Result { return ipcOpenFromChild(t, e, 0, nil) }})
	add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.Success, what: "another process opens from the other GPU (lazy peer access)",
		run: func(t *testing.T, e *confEnv) api.Result {
			i, j := e.peerPair(t)
			if i != 0 {
				t.Skip("device 0 has no peer")
			}
			return ipcOpenFromChild(t, e, j, nil)
		}})
	add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.Success, what: "another process whose CUDA_VISIBLE_DEVICES hides the memory's device",
		run: func(t *testing.T, e *confEnv) api.Result {
			i, j := e.peerPair(t)
			if i != 0 {
				t.Skip("device 0 has no peer")
			}
			return ipcOpenFromChild(t, e, 0, []string{"CUDA_VISIBLE_DEVICES=" + strconv.Itoa(j)})
		}})
	add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.Success, what: "re-open in the same context: same pointer, one more reference; a close too many fails",
		run: func(t *testing.T, e *confEnv) api.Result { return ipcChildRoutine(t, e, "open-refcount") }})
	add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.ErrorInvalidContext, what: "the exporting process opens its own handle",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 1)
			lockThread(t)
			c := e.primary(t, 0)
			e.setCurrent(t, c)
			h := e.handle(t, e.alloc(t, c, 1<<20))
			var p api.DevicePtr
			r := e.a.IpcOpenMemHandle(&p, h, api.IpcMemLazyEnablePeerAccess)
			if r == api.Success {
				e.a.IpcCloseMemHandle(p)
			}
			return r
		}})
	add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.ErrorInvalidContext, what: "no current context in the opening process",
		run: func(t *testing.T, e *confEnv) api.Result { return ipcChildRoutine(t, e, "open-no-context") }})
	// Driver 580 answers INVALID_HANDLE here (measured on an H100); once the
	// first context has closed it, a second context may open it.
	add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.ErrorInvalidHandle, what: "a second context on the same device opens a handle the first already opened (one context per device per other process)",
		run: func(t *testing.T, e *confEnv) api.Result { return ipcChildRoutine(t, e, "open-second-context") }})
	for _, v := range []struct{ routine, what string }{
		{"open-zero-handle", "an all-zero handle"},
		{"open-flags-0", "Flags 0"},
		{"open-flags-2", "Flags 2"},
		{"open-null-pdptr", "pdptr is NULL"},
		{"open-freed", "the handle of an allocation the exporter has freed"},
		// Driver 580 reads a mem handle made from event handle bytes as
		// invalid, not as a wrong kind of handle (measured on an H100).
		{"open-event-handle", "an interprocess event handle passed as a memory handle"},
	} {
		v := v
		add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.ErrorInvalidValue, what: v.what,
			run: func(t *testing.T, e *confEnv) api.Result { return ipcChildRoutine(t, e, v.routine) }})
	}
	add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.ErrorInvalidHandle, what: "the exporting process exited before the open (measured on an H100)",
		run: func(t *testing.T, e *confEnv) api.Result {
			e.needDevices(t, 1)
			exp := startChild(t, e, "export-and-exit", nil)
			code, note := exp.finish()
			if code != api.Success {
				t.Fatalf("exporter: %s %s", code.Name(), note)
			}
			r, note := startChild(t, e, "open-handle", map[string]string{"HANDLE": note, "DEV": "0"}).finish()
			t.Log(note)
			return r
		}})
	add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.ErrorMapFailed, what: "the memory behind a valid handle cannot be mapped",
		notReal: "no known way to make the real driver fail the mapping itself; the simulator fails it when the allocation's shared-memory file is gone",
		run:     func(t *testing.T, e *confEnv) api.Result { return ipcChildRoutine(t, e, "open-unmappable") }})
	add(confCase{fn: "cuIpcOpenMemHandle_v2", code: api.ErrorTooManyPeers, what: "lazy peer enable past the peer limit",
		notReal: "needs more peer-capable devices than the hardware's peer limit (8 or more)",
		run: func(t *testing.T, e *confEnv) api.Result {
			return runOnTopology(t, e, topoPeerLimit, "open-too-many-peers", nil)
		}})
	cs = append(cs, pidnsCases()...)
	cs = append(cs, asyncCases()...)
	return append(cs, vmmCases()...)
}

// noPeerPair finds a real pair of devices without peer access, for running
// a sim-topology case on real hardware that has one.
func (e *confEnv) noPeerPair() (int, int, bool) {
	for i := 0; i < e.n; i++ {
		for j := 0; j < e.n; j++ {
			var v int32
			if i != j && e.a.DeviceCanAccessPeer(&v, api.Device(i), api.Device(j)) == api.Success && v == 0 {
				return i, j, true
			}
		}
	}
	return 0, 0, false
}

// runOnTopology runs routine in a child: on the simulator with the given
// topology in a fresh state directory; on real hardware only when realPair
// finds devices that fit, else the case skips.
func runOnTopology(t *testing.T, e *confEnv, topo, routine string, realPair func() (int, int, bool)) api.Result {
	t.Helper()
	params := map[string]string{"A": "0", "B": "1"}
	var env []string
	if e.isSim() {
		env = []string{"CUDASHARE_SIM_TOPOLOGY=" + topo, "CUDASHARE_SIM_DIR=" + t.TempDir()}
	} else {
		if realPair == nil {
			t.Skip("real hardware cannot produce this here (see the case's notReal)")
		}
		a, b, ok := realPair()
		if !ok {
			t.Skip("every device pair here supports peer access")
		}
		params["A"], params["B"] = strconv.Itoa(a), strconv.Itoa(b)
	}
	r, note := startChild(t, e, routine, params, env...).finish()
	t.Log(note)
	return r
}

// ipcOpenFromChild allocates on device 0 here, writes a pattern, and has a
// child open the handle from device dev (of the child's numbering) and
// check the pattern.
func ipcOpenFromChild(t *testing.T, e *confEnv, dev int, env []string) api.Result {
	t.Helper()
	return ipcOpenFromChildIn(t, e, nil, dev, env)
}

// ipcOpenFromChildWrapped is ipcOpenFromChild on device 0 with the child
// run under a command prefix (unshare).
func ipcOpenFromChildWrapped(t *testing.T, e *confEnv, wrap []string) api.Result {
	t.Helper()
	return ipcOpenFromChildIn(t, e, wrap, 0, nil)
}

func ipcOpenFromChildIn(t *testing.T, e *confEnv, wrap []string, dev int, env []string) api.Result {
	t.Helper()
	e.needDevices(t, 1)
	lockThread(t)
	c := e.primary(t, 0)
	e.setCurrent(t, c)
	const size = 1 << 20
	p := e.alloc(t, c, size)
	pattern := bytes.Repeat([]byte{0xC5, 0x3A, 0x11, 0x7E}, size/4)
	if r := e.a.MemcpyHtoD(p, unsafe.Pointer(&pattern[0]), size); r != api.Success {
		t.Fatalf("cuMemcpyHtoD_v2: %s", r.Name())
	}
	e.a.CtxSynchronize()
	h := e.handle(t, p)
	r, note := startChildWrapped(t, e, wrap, "open-handle", map[string]string{"HANDLE": hexHandle(h), "DEV": strconv.Itoa(dev), "CHECK": "1"}, nil, env...).finish()
	t.Log(note)
	return r
}

// ipcChildRoutine gives a child a fresh 1 MiB allocation's handle from
// device 0 and returns what the routine reports.
func ipcChildRoutine(t *testing.T, e *confEnv, routine string) api.Result {
	t.Helper()
	e.needDevices(t, 1)
	lockThread(t)
	c := e.primary(t, 0)
	e.setCurrent(t, c)
	var p api.DevicePtr
	if r := e.a.MemAlloc(&p, 1<<20); r != api.Success {
		t.Fatalf("cuMemAlloc_v2: %s", r.Name())
	}
	h := e.handle(t, p)
	freed := false
	free := func() {
		if !freed {
			freed = true
			e.a.CtxSetCurrent(c)
			if r := e.a.MemFree(p); r != api.Success {
				t.Errorf("cuMemFree_v2: %s", r.Name())
			}
		}
	}
	t.Cleanup(free)
	params := map[string]string{"HANDLE": hexHandle(h), "DEV": "0"}
	if routine == "open-freed" {
		free()
	}
	if routine == "open-unmappable" {
		d, ok := e.a.(interface{ DropBacking(api.DevicePtr) error })
		if !ok {
			t.Skipf("the %s backend cannot drop an allocation's backing store", e.d.Backend())
		}
		if err := d.DropBacking(p); err != nil {
			t.Fatal(err)
		}
	}
	if routine == "open-event-handle" {
		var ev api.Event
		if r := e.a.EventCreate(&ev, api.EventInterprocess|api.EventDisableTiming); r != api.Success {
			t.Fatalf("cuEventCreate: %s", r.Name())
		}
		t.Cleanup(func() { e.a.CtxSetCurrent(c); e.a.EventDestroy(ev) })
		var eh api.IpcEventHandle
		if r := e.a.IpcGetEventHandle(&eh, ev); r != api.Success {
			t.Fatalf("cuIpcGetEventHandle: %s", r.Name())
		}
		params["HANDLE"] = hexHandle(api.IpcMemHandle(eh))
	}
	r, note := startChild(t, e, routine, params).finish()
	t.Log(note)
	return r
}

func TestConformance(t *testing.T) {
	e := newConfEnv(t)
	for _, c := range conformanceCases() {
		c := c
		name := fmt.Sprintf("%s/%s/%s", c.fn, strings.TrimPrefix(c.code.Name(), "CUDA_"), c.what)
		t.Run(name, func(t *testing.T) {
			if c.notReal != "" && !e.isSim() && !c.tryReal {
				t.Skip("real hardware cannot produce this: " + c.notReal)
			}
			got := c.run(t, e)
			if got != c.code {
				t.Errorf("%s (%s): got %s, want %s", c.fn, c.what, got.Name(), c.code.Name())
			}
		})
	}
}

// TestConformanceCoversSeeds: every code that the seed pages list for a
// function has at least one case.
func TestConformanceCoversSeeds(t *testing.T) {
	have := map[string]map[api.Result]bool{}
	for _, c := range conformanceCases() {
		if have[c.fn] == nil {
			have[c.fn] = map[api.Result]bool{}
		}
		have[c.fn][c.code] = true
	}
	var missing []string
	for fn, codes := range seedCodes {
		for _, code := range codes {
			if !have[fn][code] {
				missing = append(missing, fn+" "+code.Name())
			}
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("no conformance case for:\n%s", strings.Join(missing, "\n"))
	}
	// When the seed pages are beside the repository, check our list of
	// their codes against the pages themselves.
	for fn, codes := range seedCodesFromPages(t) {
		want := map[api.Result]bool{}
		for _, c := range seedCodes[fn] {
			want[c] = true
		}
		for _, c := range codes {
			if !want[c] {
				t.Errorf("seed page lists %s for %s, but seedCodes does not", c.Name(), fn)
			}
		}
	}
}
