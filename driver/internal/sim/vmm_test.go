package sim

import (
	"bytes"
	"encoding/binary"
	"slices"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

func vmmProp(dev int32, types int32) *api.MemAllocationProp {
	return &api.MemAllocationProp{Type: api.MemAllocationTypePinned, RequestedHandleTypes: types,
		Location: api.MemLocation{Type: api.MemLocationTypeDevice, ID: dev}}
}

// vmmMapped reserves, maps and grants dev read-write access to h's first size
// bytes, and returns the address.
func vmmMapped(t *testing.T, d *Driver, h api.MemHandle, size uint64, dev int32) api.DevicePtr {
	t.Helper()
	var p api.DevicePtr
	ok(t, "MemAddressReserve", d.MemAddressReserve(&p, size, 0, 0, 0))
	ok(t, "MemMap", d.MemMap(p, size, 0, h, 0))
	desc := api.MemAccessDesc{Location: api.MemLocation{Type: api.MemLocationTypeDevice, ID: dev}, Flags: api.MemAccessProtReadWrite}
	ok(t, "MemSetAccess", d.MemSetAccess(p, size, &desc, 1))
	return p
}

func freeMem(t *testing.T, d *Driver) uint64 {
	t.Helper()
	var f, total uint64
	ok(t, "MemGetInfo", d.MemGetInfo(&f, &total))
	return f
}

// TestVMMAcrossProcesses: an allocation exported as an fd and imported by
// another simulated process holds the same bytes, stays charged to the
// device while either process holds it, and outlives its creator's handle
// and mapping; the creator's exit does not end it.
func TestVMMAcrossProcesses(t *testing.T) {
	lockThread(t)
	a := newDriver(t, Config{})
	b := newDriver(t, Config{Dir: a.Dir()})
	primary(t, a, 0)
	const size = 4 << 20
	free0 := freeMem(t, a)

	var h api.MemHandle
	ok(t, "MemCreate", a.MemCreate(&h, size, vmmProp(0, api.MemHandleTypePosixFileDescriptor), 0))
	if got := freeMem(t, a); free0-got != size {
		t.Fatalf("free memory went from %d to %d after a %d-byte cuMemCreate", free0, got, size)
	}
	pa := vmmMapped(t, a, h, size, 0)
	want := bytes.Repeat([]byte{1, 2, 3, 4, 5, 6, 7, 8}, size/8)
	write(t, a, pa, want)

	var fd int32
	ok(t, "MemExportToShareableHandle", a.MemExportToShareableHandle(unsafe.Pointer(&fd), h, api.MemHandleTypePosixFileDescriptor, 0))
	// The memfd is readable as documented: header page, then the memory.
	var hdr [32]byte
	if _, err := unix.Pread(int(fd), hdr[:], 0); err != nil || string(hdr[:8]) != vmmMagic || binary.LittleEndian.Uint64(hdr[16:]) != size {
		t.Fatalf("header of the exported fd: %q, %v", hdr, err)
	}
	data := make([]byte, 8)
	if _, err := unix.Pread(int(fd), data, vmmHeaderSize); err != nil || !bytes.Equal(data, want[:8]) {
		t.Fatalf("memory at offset %d of the fd: %v, %v", vmmHeaderSize, data, err)
	}

	primary(t, b, 1)
	var hb api.MemHandle
	ok(t, "MemImportFromShareableHandle", b.MemImportFromShareableHandle(&hb, uintptr(fd), api.MemHandleTypePosixFileDescriptor))
	unix.Close(int(fd))
	pb := vmmMapped(t, b, hb, size, 1)
	if got := read(t, b, pb, size); !bytes.Equal(got, want) {
		t.Fatal("the importer does not read what the creator wrote")
	}

	// The creator lets go of everything and exits: the importer's mapping
	// and handle keep the memory, and the device still counts it.
	ok(t, "MemUnmap", a.MemUnmap(pa, size))
	ok(t, "MemAddressFree", a.MemAddressFree(pa, size))
	ok(t, "MemRelease", a.MemRelease(h))
	a.Deinit()
	var f0, tot uint64
	primary(t, b, 0)
	ok(t, "MemGetInfo", b.MemGetInfo(&f0, &tot))
	if free0-f0 != size {
		t.Errorf("device 0 free %d after the creator exited, want %d: the importer still holds the memory", f0, free0-size)
	}
	primary(t, b, 1)
	if got := read(t, b, pb, 8); !bytes.Equal(got, want[:8]) {
		t.Fatal("the importer's mapping lost the memory when the creator exited")
	}
	ok(t, "MemRelease", b.MemRelease(hb))
	ok(t, "MemUnmap", b.MemUnmap(pb, size))
	ok(t, "MemAddressFree", b.MemAddressFree(pb, size))
	primary(t, b, 0)
	ok(t, "MemGetInfo", b.MemGetInfo(&f0, &tot))
	if f0 != free0 {
		t.Errorf("device 0 free %d once every handle and mapping is gone, want %d", f0, free0)
	}
	if v := violations(t, b); len(v) != 0 {
		t.Errorf("violations: %v", v)
	}
}

// TestVMMStrict: the lifetime rules the real driver leaves undefined are
// refused and recorded.
func TestVMMStrict(t *testing.T) {
	lockThread(t)
	d := newDriver(t, Config{})
	primary(t, d, 0)
	const size = 2 << 20
	var h api.MemHandle
	ok(t, "MemCreate", d.MemCreate(&h, size, vmmProp(0, 0), 0))
	var p api.DevicePtr
	ok(t, "MemAddressReserve", d.MemAddressReserve(&p, size, 0, 0, 0))
	ok(t, "MemMap", d.MemMap(p, size, 0, h, 0))
	var b [8]byte
	check(t, "copy before cuMemSetAccess", d.MemcpyDtoH(unsafe.Pointer(&b[0]), p, 8), api.ErrorInvalidValue)
	desc := api.MemAccessDesc{Location: api.MemLocation{Type: api.MemLocationTypeDevice, ID: 0}, Flags: api.MemAccessProtReadWrite}
	ok(t, "MemSetAccess", d.MemSetAccess(p, size, &desc, 1))
	var flags uint64
	ok(t, "MemGetAccess", d.MemGetAccess(&flags, &desc.Location, p))
	if flags != uint64(api.MemAccessProtReadWrite) {
		t.Errorf("MemGetAccess = %d", flags)
	}
	var fd int32
	check(t, "export without a requested handle type", d.MemExportToShareableHandle(unsafe.Pointer(&fd), h, api.MemHandleTypePosixFileDescriptor, 0), api.ErrorInvalidValue)
	check(t, "MemAddressFree while mapped", d.MemAddressFree(p, size), api.ErrorInvalidValue)
	ok(t, "MemRelease", d.MemRelease(h))
	// The mapping keeps the memory after the handle is released.
	ok(t, "copy after release, still mapped", d.MemcpyDtoH(unsafe.Pointer(&b[0]), p, 8))
	check(t, "second MemRelease", d.MemRelease(h), api.ErrorInvalidValue)
	check(t, "MemMap of a released handle", d.MemMap(p, size, 0, h, 0), api.ErrorInvalidValue)
	ok(t, "MemUnmap", d.MemUnmap(p, size))
	check(t, "copy after unmap", d.MemcpyDtoH(unsafe.Pointer(&b[0]), p, 8), api.ErrorInvalidValue)
	ok(t, "MemAddressFree", d.MemAddressFree(p, size))
	want := []string{kindAccessDenied, kindDoubleRelease, kindMapReleased, kindAccessAfterUnmap}
	if got := kinds(violations(t, d)); !slices.Equal(got, want) {
		t.Errorf("violations %v, want %v", got, want)
	}
}

// TestPresence: a process of another PID namespace is alive while its
// presence file is locked, gone once nobody holds it (and the file goes),
// and gone when it has no file.
func TestPresence(t *testing.T) {
	dir := t.TempDir()
	self, err := newProcID()
	if err != nil {
		t.Fatal(err)
	}
	l := newLiveness(self)
	l.dir = dir
	foreign := procID{pid: 7, start: 12345}
	const ns = 1 // no real PID namespace has inode 1
	path := dir + "/" + presenceName(ns, foreign)
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(fd, unix.LOCK_SH); err != nil {
		t.Fatal(err)
	}
	if !l.aliveIn(foreign, ns) {
		t.Error("a process holding its presence file reads as gone")
	}
	if l.aliveIn(procID{pid: 8, start: 12345}, ns) {
		t.Error("a process without a presence file reads as alive")
	}
	sweepPresence(dir)
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Error("sweepPresence removed a held presence file")
	}
	unix.Close(fd)
	if l.aliveIn(foreign, ns) {
		t.Error("a process whose presence file nobody holds reads as alive")
	}
	if unix.Stat(path, &st) == nil {
		t.Error("the dead process's presence file is still there")
	}
}
