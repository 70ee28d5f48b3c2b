package sim

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Two Drivers in one OS process are two simulated processes: these tests
// cover the IPC rules without the cost of a child process. The tests in
// multiproc_test.go do the same across real processes.

func exportHandle(t *testing.T, d *Driver, p api.DevicePtr) api.IpcMemHandle {
	t.Helper()
	var h api.IpcMemHandle
	ok(t, "IpcGetMemHandle", d.IpcGetMemHandle(&h, p))
	return h
}

func open(t *testing.T, d *Driver, h api.IpcMemHandle) api.DevicePtr {
	t.Helper()
	var p api.DevicePtr
	ok(t, "IpcOpenMemHandle", d.IpcOpenMemHandle(&p, h, api.IpcMemLazyEnablePeerAccess))
	return p
}

func buffers(t *testing.T, dir string) int {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, bufferPrefix+"*"))
	if err != nil {
		t.Fatal(err)
	}
	return len(m)
}

func TestIPCHandleErrors(t *testing.T) {
	lockThread(t)
	d := newDriver(t, Config{})
	var q api.DevicePtr
	var h api.IpcMemHandle
	check(t, "IpcOpenMemHandle without context", d.IpcOpenMemHandle(&q, h, 1), api.ErrorInvalidContext)
	primary(t, d, 0)
	p := alloc(t, d, 1<<20)
	check(t, "IpcGetMemHandle(nil)", d.IpcGetMemHandle(nil, p), api.ErrorInvalidValue)
	check(t, "IpcGetMemHandle unknown", d.IpcGetMemHandle(&h, 0x99), api.ErrorInvalidValue)
	h = exportHandle(t, d, p)
	if interior := exportHandle(t, d, p+4096); interior != h {
		t.Error("an interior pointer named another allocation")
	}
	check(t, "flags 0", d.IpcOpenMemHandle(&q, h, 0), api.ErrorInvalidValue)
	check(t, "flags 2", d.IpcOpenMemHandle(&q, h, 2), api.ErrorInvalidValue)
	check(t, "nil pointer", d.IpcOpenMemHandle(nil, h, 1), api.ErrorInvalidValue)
	check(t, "zero handle", d.IpcOpenMemHandle(&q, api.IpcMemHandle{}, 1), api.ErrorInvalidValue)
	bad := h
	bad.Reserved[20] ^= 1
	check(t, "garbage handle", d.IpcOpenMemHandle(&q, bad, 1), api.ErrorInvalidValue)
	check(t, "own handle", d.IpcOpenMemHandle(&q, h, 1), api.ErrorInvalidContext)

	// A handle minted on another machine (state directory) does not open.
	other := newDriver(t, Config{})
	primary(t, other, 0)
	check(t, "foreign handle", other.IpcOpenMemHandle(&q, h, 1), api.ErrorInvalidValue)

	check(t, "close own allocation", d.IpcCloseMemHandle(p), api.ErrorInvalidValue)
	check(t, "close nothing", d.IpcCloseMemHandle(0x1234), api.ErrorInvalidValue)
	if got := kinds(violations(t, d)); !slices.Equal(got, []string{kindCloseUnopened, kindCloseUnopened}) {
		t.Errorf("violations %v", got)
	}
}

func TestIPCOpenClose(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	exp := newDriver(t, Config{Dir: dir})
	imp := newDriver(t, Config{Dir: dir})
	primary(t, exp, 0)
	ci := primary(t, imp, 0)

	p := alloc(t, exp, 5000)
	write(t, exp, p, []byte("from the exporter"))
	h := exportHandle(t, exp, p)
	q := open(t, imp, h)
	if got := read(t, imp, q, 17); string(got) != "from the exporter" {
		t.Fatalf("importer read %q", got)
	}
	write(t, imp, q+100, []byte("reply"))
	if got := read(t, exp, p+100, 5); string(got) != "reply" {
		t.Fatalf("exporter read %q", got)
	}
	var base api.DevicePtr
	var size uint64
	ok(t, "MemGetAddressRange", imp.MemGetAddressRange(&base, &size, q+4999))
	if base != q || size != 5000 {
		t.Errorf("mapping range %#x+%d", base, size)
	}
	var gotCtx api.Context
	ok(t, "CONTEXT", imp.PointerGetAttribute(unsafe.Pointer(&gotCtx), api.PointerAttrContext, q))
	if gotCtx != ci {
		t.Error("mapping does not belong to the opening context")
	}
	check(t, "MemFree of a mapping", imp.MemFree(q), api.ErrorInvalidValue)
	check(t, "IpcGetMemHandle of a mapping", imp.IpcGetMemHandle(new(api.IpcMemHandle), q), api.ErrorInvalidValue)

	// Re-open: same pointer, counted.
	if again := open(t, imp, h); again != q {
		t.Errorf("re-open gave %#x, want %#x", again, q)
	}
	var id1, id2 uint64
	ok(t, "BUFFER_ID", imp.PointerGetAttribute(unsafe.Pointer(&id1), api.PointerAttrBufferID, q))

	// Free while mapped: refused, recorded, memory intact.
	check(t, "MemFree while mapped", exp.MemFree(p), api.ErrorIllegalState)
	vs := violations(t, exp)
	if len(vs) != 1 || vs[0].Kind != kindFreeWhileMapped || vs[0].PID != os.Getpid() {
		t.Fatalf("violations %+v", vs)
	}
	if got := read(t, imp, q, 4); string(got) != "from" {
		t.Errorf("importer read %q after the refused free", got)
	}

	ok(t, "IpcCloseMemHandle", imp.IpcCloseMemHandle(q))
	check(t, "MemFree while mapped once more", exp.MemFree(p), api.ErrorIllegalState)
	ok(t, "IpcCloseMemHandle", imp.IpcCloseMemHandle(q))
	check(t, "access after close", imp.MemsetD8(q, 0, 1), api.ErrorInvalidValue)
	check(t, "close once more", imp.IpcCloseMemHandle(q), api.ErrorInvalidValue)
	ok(t, "MemFree after the last close", exp.MemFree(p))
	if n := buffers(t, dir); n != 0 {
		t.Errorf("%d buffer files left after the free", n)
	}
	check(t, "open a freed allocation", imp.IpcOpenMemHandle(&q, h, 1), api.ErrorInvalidValue)
	if got := kinds(violations(t, exp)); !slices.Equal(got, []string{kindFreeWhileMapped, kindFreeWhileMapped, kindAccessAfterClose, kindCloseUnopened}) {
		t.Errorf("violations %v", got)
	}

	// A new open of a new allocation reuses the mapping's range with a new id.
	p = alloc(t, exp, 5000)
	q2 := open(t, imp, exportHandle(t, exp, p))
	ok(t, "BUFFER_ID", imp.PointerGetAttribute(unsafe.Pointer(&id2), api.PointerAttrBufferID, q2))
	if q2 != q || id2 == id1 {
		t.Errorf("second mapping at %#x id %d, first at %#x id %d", q2, id2, q, id1)
	}
}

func TestIPCContextsAndPeers(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	exp := newDriver(t, Config{Dir: dir})
	imp := newDriver(t, Config{Dir: dir})
	primary(t, exp, 0)
	p := alloc(t, exp, 1<<20)
	write(t, exp, p, []byte{1, 2, 3})
	h := exportHandle(t, exp, p)

	// From the other device: peer access is enabled lazily, and a second
	// context on that device may not open the same exporter's handles.
	c1 := primary(t, imp, 1)
	q1 := open(t, imp, h)
	if got := read(t, imp, q1, 3); !bytes.Equal(got, []byte{1, 2, 3}) {
		t.Errorf("read %v", got)
	}
	var ordinal int32
	ok(t, "DEVICE_ORDINAL", imp.PointerGetAttribute(unsafe.Pointer(&ordinal), api.PointerAttrDeviceOrdinal, q1))
	if ordinal != 1 {
		t.Errorf("mapping of device 0 memory opened on device 1 has ordinal %d, want 1", ordinal)
	}
	var extra api.Context
	ok(t, "CtxCreate", imp.CtxCreate(&extra, 0, 1))
	var q api.DevicePtr
	check(t, "second context on the device", imp.IpcOpenMemHandle(&q, h, 1), api.ErrorInvalidHandle)
	other := exportHandle(t, exp, alloc(t, exp, 4096))
	check(t, "second context, another handle of the exporter", imp.IpcOpenMemHandle(&q, other, 1), api.ErrorInvalidHandle)
	// A context on device 0 may: one context per device.
	c0 := primary(t, imp, 0)
	q0 := open(t, imp, h)
	if q0 == q1 {
		t.Error("two contexts share a mapping")
	}
	ok(t, "CtxSetCurrent", imp.CtxSetCurrent(c1))
	ok(t, "IpcCloseMemHandle", imp.IpcCloseMemHandle(q1))
	ok(t, "CtxSetCurrent", imp.CtxSetCurrent(extra))
	q = open(t, imp, h) // the binding ended with the last mapping
	ok(t, "IpcCloseMemHandle", imp.IpcCloseMemHandle(q))
	ok(t, "CtxSetCurrent", imp.CtxSetCurrent(c0))
	ok(t, "IpcCloseMemHandle", imp.IpcCloseMemHandle(q0))

	t.Run("no peer access", func(t *testing.T) {
		lockThread(t)
		top, _ := ParseTopology(`{"devices":2,"peer":[[0,0],[0,0]]}`)
		dir := t.TempDir()
		exp := newDriver(t, Config{Dir: dir, Topology: &top})
		imp := newDriver(t, Config{Dir: dir, Topology: &top})
		primary(t, exp, 0)
		h := exportHandle(t, exp, alloc(t, exp, 1))
		primary(t, imp, 1)
		var q api.DevicePtr
		check(t, "open across devices", imp.IpcOpenMemHandle(&q, h, 1), api.ErrorPeerAccessUnsupported)
	})
	t.Run("too many peers", func(t *testing.T) {
		lockThread(t)
		top, _ := ParseTopology(`{"devices":3,"max_peers":1}`)
		dir := t.TempDir()
		exp := newDriver(t, Config{Dir: dir, Topology: &top})
		imp := newDriver(t, Config{Dir: dir, Topology: &top})
		primary(t, exp, 0)
		h0 := exportHandle(t, exp, alloc(t, exp, 1))
		primary(t, exp, 1)
		h1 := exportHandle(t, exp, alloc(t, exp, 1))
		c2 := primary(t, imp, 2)
		open(t, imp, h0)
		var q api.DevicePtr
		check(t, "second peer device", imp.IpcOpenMemHandle(&q, h1, 1), api.ErrorTooManyPeers)
		c1 := primary(t, imp, 1)
		ok(t, "CtxSetCurrent", imp.CtxSetCurrent(c2))
		check(t, "enable after a lazy peer", imp.CtxEnablePeerAccess(c1, 0), api.ErrorTooManyPeers)
	})
}

// TestOrphans covers an exporter that goes away while its memory is mapped:
// by exiting (no violation, as a dying process) or by destroying its context
// (a violation). Either way the importer keeps the bytes until it closes.
func TestOrphans(t *testing.T) {
	for _, exit := range []bool{true, false} {
		name := map[bool]string{true: "exit", false: "context destroy"}[exit]
		t.Run(name, func(t *testing.T) {
			lockThread(t)
			dir := t.TempDir()
			exp := newDriver(t, Config{Dir: dir})
			imp := newDriver(t, Config{Dir: dir})
			primary(t, exp, 0)
			primary(t, imp, 0)
			p := alloc(t, exp, 1<<20)
			write(t, exp, p, []byte("still here"))
			h := exportHandle(t, exp, p)
			q := open(t, imp, h)
			if exit {
				exp.Deinit()
			} else {
				ok(t, "DevicePrimaryCtxRelease", exp.DevicePrimaryCtxRelease(0))
			}
			if got := read(t, imp, q, 10); string(got) != "still here" {
				t.Errorf("importer read %q", got)
			}
			var free, total uint64
			ok(t, "MemGetInfo", imp.MemGetInfo(&free, &total))
			if total-free != allocGranularity {
				t.Errorf("orphan charged %d bytes, want %d", total-free, allocGranularity)
			}
			if again := open(t, imp, h); again != q {
				t.Error("re-open of an orphan in the same context gave another pointer")
			}
			c0 := primary(t, imp, 0)
			primary(t, imp, 1)
			var q2 api.DevicePtr
			wantOpen := api.ErrorInvalidValue // the exporter lives, its context does not
			if exit {
				wantOpen = api.ErrorInvalidHandle
			}
			check(t, "open an orphan", imp.IpcOpenMemHandle(&q2, h, 1), wantOpen)
			ok(t, "CtxSetCurrent", imp.CtxSetCurrent(c0))
			ok(t, "IpcCloseMemHandle", imp.IpcCloseMemHandle(q))
			ok(t, "IpcCloseMemHandle", imp.IpcCloseMemHandle(q))
			if n := buffers(t, dir); n != 0 {
				t.Errorf("%d buffer files left after the last close", n)
			}
			ok(t, "MemGetInfo", imp.MemGetInfo(&free, &total))
			if free != total {
				t.Errorf("%d bytes still charged", total-free)
			}
			vs := violations(t, imp)
			want := []string(nil)
			if !exit {
				want = []string{kindFreeWhileMapped}
			}
			if got := kinds(vs); !slices.Equal(got, want) {
				t.Errorf("violations %v, want %v", got, want)
			}
			if !exit && len(vs) > 0 && !strings.Contains(vs[0].Detail, "destroyed") {
				t.Errorf("detail %q", vs[0].Detail)
			}
		})
	}
}
