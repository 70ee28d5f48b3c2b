package sim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// TestMain runs helper processes (multiproc_test.go) and fails the run when
// the tests leave a file descriptor or a mapping of a sim file behind.
func TestMain(m *testing.M) {
	if name := os.Getenv(envHelper); name != "" {
		os.Exit(helperMain(name))
	}
	before := openFDs()
	code := m.Run()
	if code == 0 {
		if leaked := diff(openFDs(), before); len(leaked) > 0 {
			fmt.Fprintf(os.Stderr, "leaked file descriptors: %v\n", leaked)
			code = 1
		}
		if maps := simMappings(); len(maps) > 0 {
			fmt.Fprintf(os.Stderr, "sim files still mapped: %v\n", maps)
			code = 1
		}
	}
	os.Exit(code)
}

// openFDs lists this process's descriptors by target, leaving out the ones
// the Go runtime keeps for itself once it has used them.
func openFDs() []string {
	ents, _ := os.ReadDir("/proc/self/fd")
	var out []string
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err != nil || strings.HasPrefix(target, "anon_inode:") {
			continue
		}
		out = append(out, target)
	}
	return out
}

func diff(after, before []string) []string {
	var out []string
	for _, s := range after {
		if i := slices.Index(before, s); i >= 0 {
			before = slices.Delete(slices.Clone(before), i, i+1)
			continue
		}
		out = append(out, s)
	}
	return out
}

func simMappings() []string {
	b, _ := os.ReadFile("/proc/self/maps")
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "/"+bufferPrefix) || strings.HasSuffix(l, "/"+registryFile) || strings.Contains(l, "memfd:"+vmmMemfdName) {
			out = append(out, l)
		}
	}
	return out
}

// newDriver makes an initialised Driver on a fresh machine in t.TempDir(),
// or on the machine of cfg.Dir, and ends it with the test.
func newDriver(t *testing.T, cfg Config) *Driver {
	t.Helper()
	if cfg.Dir == "" {
		cfg.Dir = t.TempDir()
	}
	d, err := NewWithConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Deinit)
	if r := d.Init(0); r != api.Success {
		t.Fatalf("Init: %s", r.Name())
	}
	return d
}

// lockThread pins the test goroutine to its thread: the current context
// belongs to the thread.
func lockThread(t *testing.T) {
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
}

func check(t *testing.T, what string, got, want api.Result) {
	t.Helper()
	if got != want {
		t.Fatalf("%s: got %s, want %s", what, got.Name(), want.Name())
	}
}

func ok(t *testing.T, what string, got api.Result) {
	t.Helper()
	check(t, what, got, api.Success)
}

// primary retains device dev's primary context and makes it current.
func primary(t *testing.T, d *Driver, dev api.Device) api.Context {
	t.Helper()
	var c api.Context
	ok(t, "DevicePrimaryCtxRetain", d.DevicePrimaryCtxRetain(&c, dev))
	ok(t, "CtxSetCurrent", d.CtxSetCurrent(c))
	return c
}

func alloc(t *testing.T, d *Driver, n uint64) api.DevicePtr {
	t.Helper()
	var p api.DevicePtr
	ok(t, "MemAlloc", d.MemAlloc(&p, n))
	return p
}

func write(t *testing.T, d *Driver, p api.DevicePtr, b []byte) {
	t.Helper()
	ok(t, "MemcpyHtoD", d.MemcpyHtoD(p, unsafe.Pointer(&b[0]), uint64(len(b))))
}

func read(t *testing.T, d *Driver, p api.DevicePtr, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	ok(t, "MemcpyDtoH", d.MemcpyDtoH(unsafe.Pointer(&b[0]), p, uint64(n)))
	return b
}

func violations(t *testing.T, d *Driver) []api.Violation {
	t.Helper()
	v, err := d.Violations()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func kinds(vs []api.Violation) []string {
	var out []string
	for _, v := range vs {
		out = append(out, v.Kind)
	}
	return out
}

func TestInitAndTeardown(t *testing.T) {
	lockThread(t)
	d, err := NewWithConfig(Config{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Deinit()
	var v int32
	var n int32
	var c api.Context
	check(t, "DeviceGetCount before Init", d.DeviceGetCount(&n), api.ErrorNotInitialized)
	check(t, "DevicePrimaryCtxRetain before Init", d.DevicePrimaryCtxRetain(&c, 0), api.ErrorNotInitialized)
	check(t, "CtxEnablePeerAccess before Init", d.CtxEnablePeerAccess(0, 0), api.ErrorNotInitialized)
	ok(t, "DriverGetVersion before Init", d.DriverGetVersion(&v))
	if v != 13000 {
		t.Errorf("version %d, want 13000", v)
	}
	check(t, "DriverGetVersion(nil)", d.DriverGetVersion(nil), api.ErrorInvalidValue)
	check(t, "Init(1)", d.Init(1), api.ErrorInvalidValue)
	ok(t, "Init(0)", d.Init(0))
	ok(t, "Init(0) again", d.Init(0))
	ok(t, "DeviceGetCount", d.DeviceGetCount(&n))
	if n != 2 {
		t.Errorf("%d devices, want 2", n)
	}
	primary(t, d, 0)
	p := alloc(t, d, 1<<20)

	d.Deinit()
	d.Deinit()
	check(t, "Init after Deinit", d.Init(0), api.ErrorDeinitialized)
	check(t, "DriverGetVersion after Deinit", d.DriverGetVersion(&v), api.ErrorDeinitialized)
	check(t, "DeviceGetCount after Deinit", d.DeviceGetCount(&n), api.ErrorDeinitialized)
	check(t, "MemFree after Deinit", d.MemFree(p), api.ErrorDeinitialized)
	check(t, "CtxGetCurrent after Deinit", d.CtxGetCurrent(&c), api.ErrorDeinitialized)
	check(t, "EventQuery after Deinit", d.EventQuery(0), api.ErrorDeinitialized)
	if _, err := d.Violations(); err != nil {
		t.Errorf("Violations after Deinit: %v", err)
	}
}

func TestNoVisibleDevice(t *testing.T) {
	d, err := NewWithConfig(Config{Dir: t.TempDir(), VisibleDevices: []string{""}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Deinit()
	check(t, "Init", d.Init(0), api.ErrorNoDevice)
	var n int32
	check(t, "DeviceGetCount", d.DeviceGetCount(&n), api.ErrorNotInitialized)
}

func TestDevices(t *testing.T) {
	dir := t.TempDir()
	d := newDriver(t, Config{Dir: dir})
	var n int32
	ok(t, "DeviceGetCount", d.DeviceGetCount(&n))
	check(t, "DeviceGetCount(nil)", d.DeviceGetCount(nil), api.ErrorInvalidValue)
	var dev api.Device
	ok(t, "DeviceGet", d.DeviceGet(&dev, 1))
	if dev != 1 {
		t.Errorf("DeviceGet(1) = %d", dev)
	}
	check(t, "DeviceGet(2)", d.DeviceGet(&dev, 2), api.ErrorInvalidDevice)
	check(t, "DeviceGet(-1)", d.DeviceGet(&dev, -1), api.ErrorInvalidDevice)

	name := make([]byte, 64)
	ok(t, "DeviceGetName", d.DeviceGetName(name, 0))
	if got := string(name[:bytes.IndexByte(name, 0)]); got != DefaultDeviceName {
		t.Errorf("name %q", got)
	}
	short := make([]byte, 5)
	ok(t, "DeviceGetName short", d.DeviceGetName(short, 0))
	if string(short) != "cuda\x00" {
		t.Errorf("short name %q", short)
	}
	check(t, "DeviceGetName empty", d.DeviceGetName(nil, 0), api.ErrorInvalidValue)
	check(t, "DeviceGetName bad device", d.DeviceGetName(name, 9), api.ErrorInvalidDevice)

	var total uint64
	ok(t, "DeviceTotalMem", d.DeviceTotalMem(&total, 0))
	if total != DefaultTotalMem {
		t.Errorf("total %d", total)
	}

	var u0, u1 api.UUID
	ok(t, "DeviceGetUuid", d.DeviceGetUuid(&u0, 0))
	ok(t, "DeviceGetUuid", d.DeviceGetUuid(&u1, 1))
	if u0 == u1 {
		t.Error("devices 0 and 1 share a UUID")
	}
	// Another process of the same machine agrees.
	d2 := newDriver(t, Config{Dir: dir})
	var v0 api.UUID
	ok(t, "DeviceGetUuid", d2.DeviceGetUuid(&v0, 0))
	if v0 != u0 {
		t.Error("UUID differs between two drivers of one machine")
	}

	for _, c := range []struct {
		attr int32
		want int32
	}{
		{api.AttrUnifiedAddressing, 1}, {api.AttrComputeCapabilityMajor, 9}, {api.AttrComputeCapabilityMinor, 0},
		{api.AttrVirtualMemoryManagementSupported, 1}, {api.AttrHandleTypePosixFileDescriptorSupported, 1},
		{api.AttrIpcEventSupported, 1},
	} {
		var v int32
		ok(t, "DeviceGetAttribute", d.DeviceGetAttribute(&v, c.attr, 0))
		if v != c.want {
			t.Errorf("attribute %d = %d, want %d", c.attr, v, c.want)
		}
	}
	var v int32
	check(t, "unknown attribute", d.DeviceGetAttribute(&v, 9999, 0), api.ErrorInvalidValue)
	check(t, "nil value", d.DeviceGetAttribute(nil, api.AttrUnifiedAddressing, 0), api.ErrorInvalidValue)
	check(t, "bad device", d.DeviceGetAttribute(&v, api.AttrUnifiedAddressing, 2), api.ErrorInvalidDevice)
}

func TestTopology(t *testing.T) {
	for _, s := range []string{
		`3`,
		`{"devices":2,"peer":[[1,0],[0,1]]}`,
		`{"devices":3,"max_peers":1}`,
		`{"devices":[{"name":"A","total_mem":1048576,"cc":"8.0"},{}],"perf_rank":[[0,3],[3,0]],"atomic_caps":[[[],[1,2]],[[],[]]]}`,
	} {
		top, err := ParseTopology(s)
		if err != nil {
			t.Errorf("%s: %v", s, err)
			continue
		}
		if _, err := resolveTopology(top); err != nil {
			t.Errorf("%s: %v", s, err)
		}
		js, err := json.Marshal(top)
		if err != nil {
			t.Fatal(err)
		}
		again, err := ParseTopology(string(js))
		if err != nil || !equalJSON(t, again, top) {
			t.Errorf("%s: round trip through %s: %v", s, js, err)
		}
	}
	for _, s := range []string{
		`{"devices":2,"peers":[[0,1],[1,0]]}`, // typo
		`{"devices":2,"peer":[[0,1]]}`,        // rows
		`{"devices":2,"peer":[[0,1],[1]]}`,    // columns
		`{"devices":[{"cc":"nine"}]}`,
		`{"devices":[{"total_mem":2199023255552}]}`,
		`{"devices":65}`,
		`{"devices":2,"max_peers":-1}`,
		`{"peer":[]}`,
		`{"devices":2,"atomic_caps":[[[],[1,2,3,4,5,6,7,8,9,10,11,12,13,14]],[[],[]]]}`,
	} {
		top, err := ParseTopology(s)
		if err == nil {
			_, err = resolveTopology(top)
		}
		if err == nil {
			t.Errorf("%s: accepted", s)
		}
	}

	// Processes that share a directory must share a topology.
	dir := t.TempDir()
	newDriver(t, Config{Dir: dir})
	three, _ := ParseTopology("3")
	if d, err := NewWithConfig(Config{Dir: dir, Topology: &three}); err == nil {
		d.Deinit()
		t.Error("a second topology was accepted in the same state directory")
	}
}

func equalJSON(t *testing.T, a, b Topology) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return bytes.Equal(ja, jb)
}

func TestVisibleDevices(t *testing.T) {
	top, _ := ParseTopology("3")
	m, err := resolveTopology(top)
	if err != nil {
		t.Fatal(err)
	}
	u1 := m.devices[1].uuidString
	for _, c := range []struct {
		env      []string
		want     []int
		repeated bool
	}{
		{nil, []int{0, 1, 2}, false},
		{[]string{""}, nil, false},
		{[]string{"2", "0"}, []int{2, 0}, false},
		{[]string{"1", "7", "0"}, []int{1}, false}, // stops at the first bad entry
		{[]string{"7", "0"}, nil, false},
		{[]string{"0", "abc"}, []int{0}, false},
		{[]string{"0", "0"}, []int{0, 0}, true},
		{[]string{"-1"}, nil, false},
		{[]string{"0", "-1"}, []int{0}, false},
		{[]string{u1[:12]}, []int{1}, false},
		{[]string{strings.ToUpper(u1)}, []int{1}, false},
		{[]string{" 2 ", u1}, []int{2, 1}, false},
		{[]string{"GPU-"}, nil, false},
		{[]string{"GPU-zzzz"}, nil, false},
	} {
		got, repeated := visibleDevices(m, c.env)
		if !slices.Equal(got, c.want) || repeated != c.repeated {
			t.Errorf("CUDA_VISIBLE_DEVICES=%q: %v (repeated %v), want %v (%v)", strings.Join(c.env, ","), got, repeated, c.want, c.repeated)
		}
	}
	dup, err := NewWithConfig(Config{Dir: t.TempDir(), VisibleDevices: []string{"1", "1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer dup.Deinit()
	check(t, "Init with a device listed twice", dup.Init(0), api.ErrorInvalidDevice)

	// Renumbering: local device 0 is host device 1.
	d := newDriver(t, Config{VisibleDevices: []string{"1"}})
	var u api.UUID
	ok(t, "DeviceGetUuid", d.DeviceGetUuid(&u, 0))
	if u != m.devices[1].uuid {
		t.Error("local device 0 is not host device 1")
	}
	var n int32
	ok(t, "DeviceGetCount", d.DeviceGetCount(&n))
	if n != 1 {
		t.Errorf("%d devices, want 1", n)
	}
}

func TestContexts(t *testing.T) {
	lockThread(t)
	d := newDriver(t, Config{})
	var c, got api.Context
	var dev api.Device
	ok(t, "CtxGetCurrent", d.CtxGetCurrent(&got))
	if got != 0 {
		t.Errorf("fresh thread has context %#x", got)
	}
	check(t, "CtxGetDevice without context", d.CtxGetDevice(&dev), api.ErrorInvalidContext)
	check(t, "CtxSynchronize without context", d.CtxSynchronize(), api.ErrorInvalidContext)
	check(t, "MemAlloc without context", d.MemAlloc(new(api.DevicePtr), 1), api.ErrorInvalidContext)
	check(t, "DevicePrimaryCtxRetain(nil)", d.DevicePrimaryCtxRetain(nil, 0), api.ErrorInvalidValue)
	check(t, "DevicePrimaryCtxRetain bad device", d.DevicePrimaryCtxRetain(&c, 5), api.ErrorInvalidDevice)
	check(t, "DevicePrimaryCtxRelease unretained", d.DevicePrimaryCtxRelease(1), api.ErrorInvalidContext)

	c = primary(t, d, 1)
	var c2 api.Context
	ok(t, "retain again", d.DevicePrimaryCtxRetain(&c2, 1))
	if c2 != c {
		t.Error("second retain gave another context")
	}
	ok(t, "CtxGetDevice", d.CtxGetDevice(&dev))
	if dev != 1 {
		t.Errorf("device %d", dev)
	}
	ok(t, "CtxGetCurrent", d.CtxGetCurrent(&got))
	if got != c {
		t.Error("current is not the primary context")
	}
	check(t, "CtxDestroy(primary)", d.CtxDestroy(c), api.ErrorInvalidContext)

	// Another thread has its own current context.
	var other api.Context
	done := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		d.CtxGetCurrent(&other)
		close(done)
	}()
	<-done
	if other != 0 {
		t.Error("a second thread sees this thread's context")
	}

	ok(t, "release", d.DevicePrimaryCtxRelease(1))
	ok(t, "CtxSynchronize while retained", d.CtxSynchronize())
	ok(t, "last release", d.DevicePrimaryCtxRelease(1))
	check(t, "CtxSynchronize on a released primary", d.CtxSynchronize(), api.ErrorContextIsDestroyed)
	check(t, "MemAlloc on a released primary", d.MemAlloc(new(api.DevicePtr), 1), api.ErrorContextIsDestroyed)
	ok(t, "CtxGetCurrent", d.CtxGetCurrent(&got))
	if got != c {
		t.Error("a released primary context is no longer current")
	}
	ok(t, "CtxSetCurrent(released primary)", d.CtxSetCurrent(c))
	ok(t, "retain again", d.DevicePrimaryCtxRetain(&c2, 1))
	if c2 != c {
		t.Error("the primary context came back under another handle")
	}
	ok(t, "CtxSynchronize on the primary retained again", d.CtxSynchronize())
	ok(t, "release", d.DevicePrimaryCtxRelease(1))
	check(t, "CtxSetCurrent(garbage)", d.CtxSetCurrent(12345), api.ErrorInvalidContext)
	ok(t, "CtxSetCurrent(0)", d.CtxSetCurrent(0))

	var nc api.Context
	check(t, "CtxCreate(nil)", d.CtxCreate(nil, 0, 0), api.ErrorInvalidValue)
	check(t, "CtxCreate bad flags", d.CtxCreate(&nc, 0x100, 0), api.ErrorInvalidValue)
	check(t, "CtxCreate bad sched", d.CtxCreate(&nc, 3, 0), api.ErrorInvalidValue)
	check(t, "CtxCreate bad device", d.CtxCreate(&nc, 0, 7), api.ErrorInvalidDevice)
	ok(t, "CtxCreate", d.CtxCreate(&nc, 0, 0))
	ok(t, "CtxGetCurrent", d.CtxGetCurrent(&got))
	if got != nc {
		t.Error("CtxCreate did not make the context current")
	}
	ok(t, "CtxDestroy", d.CtxDestroy(nc))
	ok(t, "CtxGetCurrent", d.CtxGetCurrent(&got))
	if got != 0 {
		t.Error("CtxDestroy left the context current on its thread")
	}
	check(t, "CtxDestroy twice", d.CtxDestroy(nc), api.ErrorInvalidContext)

	// The context stack: cuCtxCreate pushes, cuCtxDestroy of the current
	// context and cuCtxSetCurrent(NULL) pop, cuCtxSetCurrent replaces the top.
	current := func() api.Context {
		t.Helper()
		var c api.Context
		ok(t, "CtxGetCurrent", d.CtxGetCurrent(&c))
		return c
	}
	p := primary(t, d, 0)
	var a, b api.Context
	ok(t, "CtxCreate", d.CtxCreate(&a, 0, 1))
	ok(t, "CtxSetCurrent(0)", d.CtxSetCurrent(0))
	if current() != p {
		t.Error("popping the created context did not restore the primary")
	}
	ok(t, "CtxSetCurrent(0)", d.CtxSetCurrent(0))
	if current() != 0 {
		t.Error("popping the last context left one current")
	}
	ok(t, "CtxSetCurrent(a)", d.CtxSetCurrent(a))
	ok(t, "CtxCreate", d.CtxCreate(&b, 0, 1))
	ok(t, "CtxDestroy(b)", d.CtxDestroy(b))
	if current() != a {
		t.Error("destroying the current context did not restore the one below")
	}
	ok(t, "CtxDestroy(a)", d.CtxDestroy(a))
	if current() != 0 {
		t.Error("destroying the only context left one current")
	}
}

func TestPeerAccess(t *testing.T) {
	lockThread(t)
	d := newDriver(t, Config{})
	c1 := primary(t, d, 1)
	c0 := primary(t, d, 0)
	check(t, "flags 1", d.CtxEnablePeerAccess(c1, 1), api.ErrorInvalidValue)
	check(t, "peer is current", d.CtxEnablePeerAccess(c0, 0), api.ErrorPeerAccessUnsupported)
	check(t, "garbage peer", d.CtxEnablePeerAccess(77, 0), api.ErrorInvalidContext)
	check(t, "disable before enable", d.CtxDisablePeerAccess(c1), api.ErrorPeerAccessNotEnabled)
	ok(t, "enable", d.CtxEnablePeerAccess(c1, 0))
	check(t, "enable twice", d.CtxEnablePeerAccess(c1, 0), api.ErrorPeerAccessAlreadyEnabled)
	ok(t, "disable", d.CtxDisablePeerAccess(c1))
	check(t, "disable twice", d.CtxDisablePeerAccess(c1), api.ErrorPeerAccessNotEnabled)
	check(t, "disable garbage", d.CtxDisablePeerAccess(77), api.ErrorInvalidContext)

	var same api.Context
	ok(t, "CtxCreate", d.CtxCreate(&same, 0, 0))
	ok(t, "CtxSetCurrent", d.CtxSetCurrent(c0))
	check(t, "two contexts of one device", d.CtxEnablePeerAccess(same, 0), api.ErrorPeerAccessUnsupported)
	ok(t, "CtxDestroy", d.CtxDestroy(same))
	check(t, "destroyed peer", d.CtxEnablePeerAccess(same, 0), api.ErrorContextIsDestroyed)
	check(t, "disable destroyed peer", d.CtxDisablePeerAccess(same), api.ErrorContextIsDestroyed)

	// CtxCreate pushed c0; pop both.
	ok(t, "CtxSetCurrent(0)", d.CtxSetCurrent(0))
	ok(t, "CtxSetCurrent(0)", d.CtxSetCurrent(0))
	check(t, "no current context", d.CtxEnablePeerAccess(c1, 0), api.ErrorInvalidContext)
	check(t, "no current context", d.CtxDisablePeerAccess(c1), api.ErrorInvalidContext)

	t.Run("unsupported", func(t *testing.T) {
		lockThread(t)
		top, _ := ParseTopology(`{"devices":2,"peer":[[1,0],[0,1]]}`)
		d := newDriver(t, Config{Topology: &top})
		c1 := primary(t, d, 1)
		primary(t, d, 0)
		check(t, "enable", d.CtxEnablePeerAccess(c1, 0), api.ErrorPeerAccessUnsupported)
	})
	t.Run("too many", func(t *testing.T) {
		lockThread(t)
		top, _ := ParseTopology(`{"devices":3,"max_peers":1}`)
		d := newDriver(t, Config{Topology: &top})
		c1, c2 := primary(t, d, 1), primary(t, d, 2)
		primary(t, d, 0)
		ok(t, "enable 1", d.CtxEnablePeerAccess(c1, 0))
		check(t, "enable 2", d.CtxEnablePeerAccess(c2, 0), api.ErrorTooManyPeers)
		ok(t, "disable 1", d.CtxDisablePeerAccess(c1))
		ok(t, "enable 2 after disabling 1", d.CtxEnablePeerAccess(c2, 0))
	})
}

func TestP2PQueries(t *testing.T) {
	top, err := ParseTopology(`{"devices":3,"peer":[[0,1,0],[1,0,0],[0,0,0]],"perf_rank":[[0,2,0],[0,0,0],[0,0,0]],
		"native_atomic":[[0,0,0],[1,0,0],[0,0,0]],"atomic_caps":[[[],[],[]],[[27,0,0,0,0,0,0,0,0,59,0,31],[],[]],[[],[],[]]]}`)
	if err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, Config{Topology: &top})
	var v int32
	for _, c := range []struct {
		dev, peer api.Device
		want      int32
	}{{0, 1, 1}, {1, 0, 1}, {0, 2, 0}, {0, 0, 0}} {
		ok(t, "DeviceCanAccessPeer", d.DeviceCanAccessPeer(&v, c.dev, c.peer))
		if v != c.want {
			t.Errorf("DeviceCanAccessPeer(%d, %d) = %d, want %d", c.dev, c.peer, v, c.want)
		}
	}
	check(t, "DeviceCanAccessPeer(nil)", d.DeviceCanAccessPeer(nil, 0, 1), api.ErrorInvalidValue)
	check(t, "DeviceCanAccessPeer bad dev", d.DeviceCanAccessPeer(&v, 3, 1), api.ErrorInvalidDevice)
	check(t, "DeviceCanAccessPeer bad peer", d.DeviceCanAccessPeer(&v, 0, -1), api.ErrorInvalidDevice)

	attr := func(a int32, s, dst api.Device) int32 {
		t.Helper()
		v := int32(-1)
		ok(t, "DeviceGetP2PAttribute", d.DeviceGetP2PAttribute(&v, a, s, dst))
		return v
	}
	if got := [5]int32{attr(1, 0, 1), attr(2, 0, 1), attr(3, 0, 1), attr(4, 0, 1), attr(5, 0, 1)}; got != [5]int32{2, 1, 0, 1, 0} {
		t.Errorf("attributes 0->1: %v", got)
	}
	if got := [5]int32{attr(1, 1, 0), attr(2, 1, 0), attr(3, 1, 0), attr(4, 1, 0), attr(5, 1, 0)}; got != [5]int32{0, 1, 1, 1, 0} {
		t.Errorf("attributes 1->0: %v", got)
	}
	if got := [5]int32{attr(1, 0, 2), attr(2, 0, 2), attr(3, 0, 2), attr(4, 0, 2), attr(5, 0, 2)}; got != [5]int32{} {
		t.Errorf("attributes 0->2 (no access): %v", got)
	}
	check(t, "same device", d.DeviceGetP2PAttribute(&v, 2, 1, 1), api.ErrorInvalidDevice)
	check(t, "bad device", d.DeviceGetP2PAttribute(&v, 2, 0, 3), api.ErrorInvalidDevice)
	check(t, "attribute 0", d.DeviceGetP2PAttribute(&v, 0, 0, 1), api.ErrorInvalidValue)
	check(t, "attribute 0, same device", d.DeviceGetP2PAttribute(&v, 0, 0, 0), api.ErrorInvalidDevice)
	check(t, "nil value, bad device", d.DeviceGetP2PAttribute(nil, 2, 0, 9), api.ErrorInvalidValue)
	check(t, "attribute 6", d.DeviceGetP2PAttribute(&v, 6, 0, 1), api.ErrorInvalidValue)
	check(t, "nil value", d.DeviceGetP2PAttribute(nil, 2, 0, 1), api.ErrorInvalidValue)

	ops := []int32{api.AtomicIntegerAdd, api.AtomicCAS, api.AtomicFloatAdd}
	caps := make([]uint32, len(ops))
	ok(t, "DeviceGetP2PAtomicCapabilities", d.DeviceGetP2PAtomicCapabilities(&caps[0], &ops[0], 3, 1, 0))
	if !slices.Equal(caps, []uint32{27, 59, 0}) {
		t.Errorf("caps 1->0: %v", caps)
	}
	ok(t, "DeviceGetP2PAtomicCapabilities", d.DeviceGetP2PAtomicCapabilities(&caps[0], &ops[0], 3, 0, 1))
	if caps[0]|caps[1]|caps[2] != 0 {
		t.Errorf("caps 0->1 (none configured): %v", caps)
	}
	check(t, "nil caps", d.DeviceGetP2PAtomicCapabilities(nil, &ops[0], 3, 1, 0), api.ErrorInvalidValue)
	check(t, "nil ops", d.DeviceGetP2PAtomicCapabilities(&caps[0], nil, 3, 1, 0), api.ErrorInvalidValue)
	check(t, "count 0", d.DeviceGetP2PAtomicCapabilities(&caps[0], &ops[0], 0, 1, 0), api.ErrorInvalidValue)
	bad := []int32{api.AtomicOr, 13}
	check(t, "bad op", d.DeviceGetP2PAtomicCapabilities(&caps[0], &bad[0], 2, 1, 0), api.ErrorInvalidValue)
	check(t, "same device", d.DeviceGetP2PAtomicCapabilities(&caps[0], &ops[0], 3, 0, 0), api.ErrorInvalidDevice)
	check(t, "bad device", d.DeviceGetP2PAtomicCapabilities(&caps[0], &ops[0], 3, 0, 9), api.ErrorInvalidDevice)
}

func TestMemory(t *testing.T) {
	lockThread(t)
	d := newDriver(t, Config{})
	ctx := primary(t, d, 0)
	check(t, "MemAlloc(nil)", d.MemAlloc(nil, 1), api.ErrorInvalidValue)
	check(t, "MemAlloc 0 bytes", d.MemAlloc(new(api.DevicePtr), 0), api.ErrorInvalidValue)
	check(t, "MemAlloc too big", d.MemAlloc(new(api.DevicePtr), DefaultTotalMem+1), api.ErrorOutOfMemory)

	const n = 3 << 20
	p := alloc(t, d, n)
	q := alloc(t, d, 1000)
	if p%allocGranularity != 0 || q%allocGranularity != 0 || q != p+4<<20 {
		t.Errorf("addresses %#x %#x: want 2 MiB aligned, first fit", p, q)
	}
	ok(t, "MemsetD8", d.MemsetD8(p, 0xab, n))
	msg := []byte("hello, device")
	write(t, d, p+100, msg)
	ok(t, "MemcpyDtoD", d.MemcpyDtoD(q, p+100, uint64(len(msg))))
	if got := read(t, d, q, len(msg)); !bytes.Equal(got, msg) {
		t.Errorf("DtoD copy read back %q", got)
	}
	if got := read(t, d, p+n-2, 2); !bytes.Equal(got, []byte{0xab, 0xab}) {
		t.Errorf("memset read back %x", got)
	}
	check(t, "copy past the end", d.MemcpyDtoD(q, p+n-1, 2), api.ErrorInvalidValue)
	check(t, "copy into the rounding", d.MemsetD8(q+1000, 0, 1), api.ErrorInvalidValue)
	check(t, "copy from nowhere", d.MemcpyDtoH(unsafe.Pointer(&msg[0]), 0x1000, 1), api.ErrorInvalidValue)
	check(t, "nil host pointer", d.MemcpyHtoD(p, nil, 1), api.ErrorInvalidValue)
	ok(t, "zero-byte copy", d.MemcpyHtoD(p, nil, 0))

	var base api.DevicePtr
	var size uint64
	ok(t, "MemGetAddressRange", d.MemGetAddressRange(&base, &size, p+n-1))
	if base != p || size != n {
		t.Errorf("range %#x+%d, want %#x+%d", base, size, p, n)
	}
	ok(t, "MemGetAddressRange(nil, nil)", d.MemGetAddressRange(nil, nil, p))
	check(t, "MemGetAddressRange outside", d.MemGetAddressRange(&base, &size, p+n), api.ErrorInvalidValue)

	var gotCtx api.Context
	var memType, ordinal int32
	var id1, id2, start, rsize uint64
	ok(t, "CONTEXT", d.PointerGetAttribute(unsafe.Pointer(&gotCtx), api.PointerAttrContext, p+5))
	ok(t, "MEMORY_TYPE", d.PointerGetAttribute(unsafe.Pointer(&memType), api.PointerAttrMemoryType, p))
	ok(t, "BUFFER_ID", d.PointerGetAttribute(unsafe.Pointer(&id1), api.PointerAttrBufferID, p))
	ok(t, "DEVICE_ORDINAL", d.PointerGetAttribute(unsafe.Pointer(&ordinal), api.PointerAttrDeviceOrdinal, p))
	ok(t, "RANGE_START", d.PointerGetAttribute(unsafe.Pointer(&start), api.PointerAttrRangeStart, p+7))
	ok(t, "RANGE_SIZE", d.PointerGetAttribute(unsafe.Pointer(&rsize), api.PointerAttrRangeSize, p+7))
	if gotCtx != ctx || memType != api.MemoryTypeDevice || ordinal != 0 || start != uint64(p) || rsize != n {
		t.Errorf("attributes: ctx %#x type %d ordinal %d range %#x+%d", gotCtx, memType, ordinal, start, rsize)
	}
	check(t, "unknown attribute", d.PointerGetAttribute(unsafe.Pointer(&id1), 99, p), api.ErrorInvalidValue)
	check(t, "unknown pointer", d.PointerGetAttribute(unsafe.Pointer(&id1), api.PointerAttrBufferID, 0x42), api.ErrorInvalidValue)
	check(t, "nil data", d.PointerGetAttribute(nil, api.PointerAttrBufferID, p), api.ErrorInvalidValue)

	var free, total uint64
	ok(t, "MemGetInfo", d.MemGetInfo(&free, &total))
	if total != DefaultTotalMem || free != total-6<<20 {
		t.Errorf("MemGetInfo free %d total %d", free, total)
	}
	total = 0
	ok(t, "MemGetInfo(nil, &total)", d.MemGetInfo(nil, &total))
	ok(t, "MemGetInfo(&free, nil)", d.MemGetInfo(&free, nil))
	if total != DefaultTotalMem {
		t.Errorf("MemGetInfo(nil, &total): total %d", total)
	}

	// Freed ranges are reused, with a new buffer id; the old pointer is gone.
	check(t, "MemFree interior", d.MemFree(p+1), api.ErrorInvalidValue)
	ok(t, "MemFree", d.MemFree(p))
	check(t, "MemFree twice", d.MemFree(p), api.ErrorInvalidValue)
	check(t, "copy after free", d.MemsetD8(p, 0, 1), api.ErrorInvalidValue)
	p2 := alloc(t, d, 1<<20)
	if p2 != p {
		t.Errorf("freed range not reused: %#x, want %#x", p2, p)
	}
	ok(t, "BUFFER_ID", d.PointerGetAttribute(unsafe.Pointer(&id2), api.PointerAttrBufferID, p2))
	if id2 == id1 {
		t.Error("reused address kept its buffer id")
	}
	if got := read(t, d, p2, 4); !bytes.Equal(got, make([]byte, 4)) {
		t.Errorf("new allocation holds old bytes %x", got)
	}
	check(t, "copy after free past the new allocation", d.MemsetD8(p+2<<20, 0, 1), api.ErrorInvalidValue)
	if got := kinds(violations(t, d)); !slices.Equal(got, []string{kindAccessAfterFree, kindAccessAfterFree}) {
		t.Errorf("violations %v", got)
	}

	// Memory is charged across the machine.
	big := alloc(t, d, 3<<30)
	check(t, "MemAlloc over the device", d.MemAlloc(new(api.DevicePtr), 1<<30), api.ErrorOutOfMemory)
	ok(t, "MemFree", d.MemFree(big))
	ok(t, "MemAlloc after free", d.MemAlloc(new(api.DevicePtr), 1<<30))

	// A context's memory dies with it.
	ok(t, "DevicePrimaryCtxRelease", d.DevicePrimaryCtxRelease(0))
	primary(t, d, 0)
	check(t, "MemGetAddressRange after context destroy", d.MemGetAddressRange(nil, nil, q), api.ErrorInvalidValue)
	ok(t, "MemGetInfo", d.MemGetInfo(&free, &total))
	if free != total {
		t.Errorf("context destroy left %d bytes charged", total-free)
	}
	if got := kinds(violations(t, d)); len(got) != 2 {
		t.Errorf("violations %v", got)
	}
}

func TestStreamsAndEvents(t *testing.T) {
	lockThread(t)
	d := newDriver(t, Config{})
	var s api.Stream
	var e, e2 api.Event
	check(t, "StreamCreate without context", d.StreamCreate(&s, 0), api.ErrorInvalidContext)
	check(t, "StreamSynchronize(0) without context", d.StreamSynchronize(0), api.ErrorInvalidContext)
	c0 := primary(t, d, 0)
	check(t, "StreamCreate(nil)", d.StreamCreate(nil, 0), api.ErrorInvalidValue)
	check(t, "StreamCreate flags", d.StreamCreate(&s, 2), api.ErrorInvalidValue)
	ok(t, "StreamCreate", d.StreamCreate(&s, api.StreamNonBlocking))
	ok(t, "StreamSynchronize", d.StreamSynchronize(s))
	ok(t, "StreamSynchronize(0)", d.StreamSynchronize(0))
	ok(t, "StreamSynchronize(per-thread)", d.StreamSynchronize(2))

	check(t, "EventCreate(nil)", d.EventCreate(nil, 0), api.ErrorInvalidValue)
	check(t, "EventCreate bad flags", d.EventCreate(&e, 8), api.ErrorInvalidValue)
	check(t, "EventCreate interprocess with timing", d.EventCreate(&e, api.EventInterprocess), api.ErrorInvalidValue)
	ok(t, "EventCreate", d.EventCreate(&e, 0))
	ok(t, "EventCreate", d.EventCreate(&e2, api.EventBlockingSync))
	var ms float32
	check(t, "EventElapsedTime unrecorded", d.EventElapsedTime(&ms, e, e2), api.ErrorInvalidHandle)
	ok(t, "EventQuery unrecorded", d.EventQuery(e))
	ok(t, "EventRecord", d.EventRecord(e, s))
	ok(t, "EventRecord(0)", d.EventRecord(e2, 0))
	ok(t, "EventElapsedTime", d.EventElapsedTime(&ms, e, e2))
	if ms < 0 {
		t.Errorf("elapsed %v ms", ms)
	}
	check(t, "EventElapsedTime(nil)", d.EventElapsedTime(nil, e, e2), api.ErrorInvalidValue)
	ok(t, "EventQuery", d.EventQuery(e))
	ok(t, "EventSynchronize", d.EventSynchronize(e))
	ok(t, "StreamWaitEvent", d.StreamWaitEvent(s, e, 0))
	check(t, "StreamWaitEvent flags", d.StreamWaitEvent(s, e, 2), api.ErrorInvalidValue)
	check(t, "StreamWaitEvent external outside capture", d.StreamWaitEvent(s, e, 1), api.ErrorIllegalState)
	check(t, "StreamWaitEvent garbage event", d.StreamWaitEvent(s, 99, 0), api.ErrorInvalidHandle)
	check(t, "StreamWaitEvent garbage stream", d.StreamWaitEvent(99, e, 0), api.ErrorInvalidHandle)
	check(t, "EventRecord on a stream", d.EventRecord(api.Event(s), s), api.ErrorInvalidHandle)

	var nt api.Event
	ok(t, "EventCreate", d.EventCreate(&nt, api.EventDisableTiming|api.EventInterprocess))
	ok(t, "EventRecord", d.EventRecord(nt, s))
	check(t, "EventElapsedTime disable-timing", d.EventElapsedTime(&ms, e, nt), api.ErrorInvalidHandle)
	var h api.IpcEventHandle
	check(t, "IpcGetEventHandle not interprocess", d.IpcGetEventHandle(&h, e), api.ErrorInvalidHandle)
	check(t, "IpcGetEventHandle(nil)", d.IpcGetEventHandle(nil, nt), api.ErrorInvalidValue)
	ok(t, "IpcGetEventHandle", d.IpcGetEventHandle(&h, nt))
	var opened api.Event
	check(t, "IpcOpenEventHandle own", d.IpcOpenEventHandle(&opened, h), api.ErrorInvalidContext)
	check(t, "IpcOpenEventHandle zero", d.IpcOpenEventHandle(&opened, api.IpcEventHandle{}), api.ErrorMapFailed)

	// The event and the stream must share a context.
	c1 := primary(t, d, 1)
	var s1 api.Stream
	ok(t, "StreamCreate", d.StreamCreate(&s1, 0))
	check(t, "EventRecord across contexts", d.EventRecord(e, s1), api.ErrorInvalidHandle)
	check(t, "EventRecord(0) across contexts", d.EventRecord(e, 0), api.ErrorInvalidHandle)
	ok(t, "StreamWaitEvent across contexts", d.StreamWaitEvent(s1, e, 0))
	ok(t, "CtxSetCurrent", d.CtxSetCurrent(c0))

	ok(t, "EventDestroy", d.EventDestroy(e))
	check(t, "EventDestroy twice", d.EventDestroy(e), api.ErrorInvalidHandle)
	check(t, "EventQuery destroyed", d.EventQuery(e), api.ErrorInvalidHandle)
	check(t, "EventRecord destroyed", d.EventRecord(e, s), api.ErrorInvalidHandle)
	ok(t, "StreamDestroy", d.StreamDestroy(s))
	check(t, "StreamDestroy twice", d.StreamDestroy(s), api.ErrorInvalidHandle)
	check(t, "StreamDestroy(0)", d.StreamDestroy(0), api.ErrorInvalidHandle)
	check(t, "StreamSynchronize destroyed", d.StreamSynchronize(s), api.ErrorInvalidHandle)
	check(t, "MemsetD8Async destroyed stream", d.MemsetD8Async(0, 0, 0, s), api.ErrorInvalidHandle)

	// A context takes its streams and events with it.
	_ = c1
	ok(t, "DevicePrimaryCtxRelease", d.DevicePrimaryCtxRelease(1))
	check(t, "stream of a destroyed context", d.StreamSynchronize(s1), api.ErrorInvalidHandle)
}

// TestHotPathAllocs proves the per-handoff calls allocate nothing.
func TestHotPathAllocs(t *testing.T) {
	lockThread(t)
	d := newDriver(t, Config{})
	primary(t, d, 0)
	var s api.Stream
	var e api.Event
	ok(t, "StreamCreate", d.StreamCreate(&s, 0))
	ok(t, "EventCreate", d.EventCreate(&e, api.EventDisableTiming))
	var c api.Context
	for name, f := range map[string]func(){
		"EventRecord":     func() { d.EventRecord(e, s) },
		"EventRecord(0)":  func() { d.EventRecord(e, 0) },
		"StreamWaitEvent": func() { d.StreamWaitEvent(s, e, 0) },
		"EventQuery":      func() { d.EventQuery(e) },
		"CtxGetCurrent":   func() { d.CtxGetCurrent(&c) },
	} {
		if n := testing.AllocsPerRun(100, f); n != 0 {
			t.Errorf("%s: %v allocations per call", name, n)
		}
	}
}

func BenchmarkHandoff(b *testing.B) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	d, err := NewWithConfig(Config{Dir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Deinit()
	d.Init(0)
	var c api.Context
	d.DevicePrimaryCtxRetain(&c, 0)
	d.CtxSetCurrent(c)
	var s api.Stream
	var e api.Event
	d.StreamCreate(&s, 0)
	d.EventCreate(&e, api.EventDisableTiming)
	b.ReportAllocs()
	for b.Loop() {
		d.EventRecord(e, s)
		d.StreamWaitEvent(s, e, 0)
		d.EventQuery(e)
	}
}

// TestConcurrentUse runs allocation, copies, IPC and events from many
// threads at once; the race detector is the judge.
func TestConcurrentUse(t *testing.T) {
	dir := t.TempDir()
	exp := newDriver(t, Config{Dir: dir})
	imp := newDriver(t, Config{Dir: dir})
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			if err := churn(exp, imp, api.Device(g%2)); err != nil {
				errs <- fmt.Errorf("goroutine %d: %w", g, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func churn(exp, imp *Driver, dev api.Device) error {
	var ce, ci api.Context
	if r := exp.DevicePrimaryCtxRetain(&ce, dev); r != api.Success {
		return fmt.Errorf("retain: %s", r.Name())
	}
	defer exp.DevicePrimaryCtxRelease(dev)
	if r := imp.DevicePrimaryCtxRetain(&ci, dev); r != api.Success {
		return fmt.Errorf("retain: %s", r.Name())
	}
	defer imp.DevicePrimaryCtxRelease(dev)
	exp.CtxSetCurrent(ce)
	imp.CtxSetCurrent(ci)
	var ev api.Event
	if r := exp.EventCreate(&ev, api.EventDisableTiming); r != api.Success {
		return fmt.Errorf("EventCreate: %s", r.Name())
	}
	defer exp.EventDestroy(ev)
	buf := make([]byte, 4096)
	for i := range 20 {
		var p, q api.DevicePtr
		if r := exp.MemAlloc(&p, 1<<20); r != api.Success {
			return fmt.Errorf("MemAlloc: %s", r.Name())
		}
		buf[0], buf[4095] = byte(i), byte(dev)
		exp.MemcpyHtoD(p, unsafe.Pointer(&buf[0]), 4096)
		exp.EventRecord(ev, 0)
		var h api.IpcMemHandle
		if r := exp.IpcGetMemHandle(&h, p); r != api.Success {
			return fmt.Errorf("IpcGetMemHandle: %s", r.Name())
		}
		if r := imp.IpcOpenMemHandle(&q, h, api.IpcMemLazyEnablePeerAccess); r != api.Success {
			return fmt.Errorf("IpcOpenMemHandle: %s", r.Name())
		}
		got := make([]byte, 4096)
		imp.MemcpyDtoH(unsafe.Pointer(&got[0]), q, 4096)
		if !bytes.Equal(got, buf) {
			return fmt.Errorf("iteration %d: importer read other bytes", i)
		}
		if r := imp.IpcCloseMemHandle(q); r != api.Success {
			return fmt.Errorf("IpcCloseMemHandle: %s", r.Name())
		}
		if r := exp.MemFree(p); r != api.Success {
			return fmt.Errorf("MemFree: %s", r.Name())
		}
	}
	return nil
}

func TestResetState(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	keep := filepath.Join(dir, "unrelated")
	if err := os.WriteFile(keep, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, Config{Dir: dir})
	primary(t, d, 0)
	alloc(t, d, 1)
	d.IpcCloseMemHandle(0x10) // a violation, so the log exists
	d.Deinit()
	if err := ResetState(dir); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(dir)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	if !slices.Equal(names, []string{"unrelated"}) {
		t.Errorf("after ResetState: %v", names)
	}
}

func TestCopiesAcrossContexts(t *testing.T) {
	lockThread(t)
	d := newDriver(t, Config{})
	c1 := primary(t, d, 1)
	q := alloc(t, d, 64)
	c0 := primary(t, d, 0)
	p := alloc(t, d, 64)
	var s api.Stream
	ok(t, "StreamCreate", d.StreamCreate(&s, 0))
	ok(t, "MemsetD8Async", d.MemsetD8Async(p, 7, 64, s))
	ok(t, "MemcpyPeer", d.MemcpyPeer(q, c1, p, c0, 64))
	if got := read(t, d, q+63, 1); got[0] != 7 {
		t.Errorf("peer copy read back %d", got[0])
	}
	write(t, d, q, []byte{9})
	ok(t, "MemcpyDtoDAsync", d.MemcpyDtoDAsync(p, q, 1, s))
	if got := read(t, d, p, 1); got[0] != 9 {
		t.Errorf("async copy read back %d", got[0])
	}
	check(t, "MemcpyPeer garbage context", d.MemcpyPeer(q, 5, p, c0, 1), api.ErrorInvalidContext)
	check(t, "MemcpyPeer past the end", d.MemcpyPeer(q, c1, p+1, c0, 64), api.ErrorInvalidValue)
	check(t, "MemcpyDtoDAsync garbage stream", d.MemcpyDtoDAsync(p, q, 1, 77), api.ErrorInvalidHandle)
	ok(t, "CtxSetCurrent(0)", d.CtxSetCurrent(0))
	check(t, "MemcpyDtoD without context", d.MemcpyDtoD(p, q, 1), api.ErrorInvalidContext)
	check(t, "MemcpyPeer without context", d.MemcpyPeer(q, c1, p, c0, 1), api.ErrorInvalidContext)
	ok(t, "MemsetD8Async on a stream without context", d.MemsetD8Async(p, 1, 1, s))
	check(t, "MemsetD8Async(0) without context", d.MemsetD8Async(p, 1, 1, 0), api.ErrorInvalidContext)
	check(t, "MemGetAddressRange without context", d.MemGetAddressRange(nil, nil, p), api.ErrorInvalidContext)
	var id uint64
	ok(t, "PointerGetAttribute without context", d.PointerGetAttribute(unsafe.Pointer(&id), api.PointerAttrBufferID, p))
	check(t, "IpcGetMemHandle without context", d.IpcGetMemHandle(new(api.IpcMemHandle), p), api.ErrorInvalidContext)
	ok(t, "MemFree without context", d.MemFree(p))
}

func TestLiveness(t *testing.T) {
	self, err := newProcID()
	if err != nil {
		t.Fatal(err)
	}
	l := newLiveness(self)
	ppid := int32(os.Getppid())
	pstart, alive := procStart(ppid)
	if !alive {
		t.Fatal("parent process reads as gone")
	}
	for _, c := range []struct {
		p    procID
		want bool
	}{
		{self, true},
		{procID{pid: self.pid, inst: self.inst + 1000, start: self.start}, true}, // another Driver of this process
		{procID{pid: self.pid, start: self.start + 1}, false},                    // this pid, reused
		{procID{pid: ppid, start: pstart}, true},
		{procID{pid: ppid, start: pstart + 1}, false},
		{procID{pid: 1 << 30}, false},
		{procID{}, false},
	} {
		if got := l.alive(c.p); got != c.want {
			t.Errorf("alive(%+v) = %v, want %v", c.p, got, c.want)
		}
	}
}
