package sim

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// The seals of a VMM allocation's memfd (issue 29, defect 1): a process
// that receives the fd must not be able to resize it under its creator's
// mappings, and an import must refuse a memfd that its sender still can.

const sealTestSize = 2 << 20

// TestVMMSealedAgainstPeer: a consumer process that receives the creator's
// exported fd cannot shrink it, grow it or add a seal to it, and the
// creator goes on using its memory. Before the memfd was sealed, the
// shrink worked and the creator died of SIGBUS at its next access.
func TestVMMSealedAgainstPeer(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	d := newDriver(t, Config{Dir: dir})
	primary(t, d, 0)
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(sp[0])
	theirs := os.NewFile(uintptr(sp[1]), "helper socket")
	c := startHelperFiles(t, "vmm-send", dir, []*os.File{theirs})
	theirs.Close()
	c.expect("sent")
	fd := recvFD(t, sp[0])
	defer unix.Close(fd)

	var h api.MemHandle
	ok(t, "MemImportFromShareableHandle", d.MemImportFromShareableHandle(&h, uintptr(fd), api.MemHandleTypePosixFileDescriptor))
	p := vmmMapped(t, d, h, sealTestSize, 0)
	t.Cleanup(func() {
		ok(t, "MemUnmap", d.MemUnmap(p, sealTestSize))
		ok(t, "MemAddressFree", d.MemAddressFree(p, sealTestSize))
		ok(t, "MemRelease", d.MemRelease(h))
	})
	if got := read(t, d, p, 8); string(got) != "creator!" {
		t.Fatalf("the importer reads %q", got)
	}

	// The consumer turns hostile.
	if err := unix.Ftruncate(fd, vmmHeaderSize+2*sealTestSize); !errors.Is(err, unix.EPERM) {
		t.Errorf("ftruncate of the received fd to twice its size: %v, want EPERM", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_WRITE); !errors.Is(err, unix.EPERM) {
		t.Errorf("F_ADD_SEALS F_SEAL_WRITE on the received fd: %v, want EPERM", err)
	}
	// The shrink last: a grow after it would give the memory back (as
	// zeros) and hide the fault.
	resized := false
	if err := unix.Ftruncate(fd, vmmHeaderSize); !errors.Is(err, unix.EPERM) {
		resized = err == nil
		t.Errorf("ftruncate of the received fd to its header: %v, want EPERM", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&0o777 != 0o600 {
		t.Errorf("mode of the received fd %#o (%v), want 0600", st.Mode&0o777, err)
	}

	c.send("touch")
	if got := c.expect("touched"); got != fmt.Sprintf("%x", "creator!") {
		t.Errorf("the creator read %q back", got)
	}
	c.finish()
	if !resized {
		if got := read(t, d, p, 8); string(got) != "touched!" {
			t.Errorf("after the creator's write the importer reads %q", got)
		}
	}
}

// recvFD receives one descriptor sent on the socket sock.
func recvFD(t *testing.T, sock int) int {
	t.Helper()
	var b [16]byte
	oob := make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(sock, b[:], oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		t.Fatalf("recvmsg: %v", err)
	}
	cms, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(cms) != 1 {
		t.Fatalf("control messages %v, %v", cms, err)
	}
	fds, err := unix.ParseUnixRights(&cms[0])
	if err != nil || len(fds) != 1 {
		t.Fatalf("descriptors %v, %v", fds, err)
	}
	return fds[0]
}

// helperVMMSend is the creator of TestVMMSealedAgainstPeer: it maps an
// allocation, writes "creator!" at its start, sends its fd on descriptor
// 3, and on "touch" reads its first 8 bytes back and writes "touched!".
func helperVMMSend(d *Driver, next func() string) error {
	must := func(what string, r api.Result) error {
		if r != api.Success {
			return fmt.Errorf("%s: %s", what, r.Name())
		}
		return nil
	}
	var h api.MemHandle
	var p api.DevicePtr
	desc := api.MemAccessDesc{Location: api.MemLocation{Type: api.MemLocationTypeDevice, ID: 0}, Flags: api.MemAccessProtReadWrite}
	msg := []byte("creator!")
	var fd int32
	if err := errors.Join(must("MemCreate", d.MemCreate(&h, sealTestSize, vmmProp(0, api.MemHandleTypePosixFileDescriptor), 0)),
		must("MemAddressReserve", d.MemAddressReserve(&p, sealTestSize, 0, 0, 0)),
		must("MemMap", d.MemMap(p, sealTestSize, 0, h, 0)),
		must("MemSetAccess", d.MemSetAccess(p, sealTestSize, &desc, 1)),
		must("MemcpyHtoD", d.MemcpyHtoD(p, unsafe.Pointer(&msg[0]), 8)),
		must("MemExportToShareableHandle", d.MemExportToShareableHandle(unsafe.Pointer(&fd), h, api.MemHandleTypePosixFileDescriptor, 0))); err != nil {
		return err
	}
	err := unix.Sendmsg(3, []byte{0}, unix.UnixRights(int(fd)), nil, 0)
	unix.Close(int(fd))
	if err != nil {
		return fmt.Errorf("sendmsg: %w", err)
	}
	fmt.Println("sent")
	for {
		switch cmd := next(); cmd {
		case "touch":
			var b [8]byte
			msg := []byte("touched!")
			if err := errors.Join(must("MemcpyDtoH", d.MemcpyDtoH(unsafe.Pointer(&b[0]), p, 8)),
				must("MemcpyHtoD", d.MemcpyHtoD(p, unsafe.Pointer(&msg[0]), 8))); err != nil {
				return err
			}
			fmt.Printf("touched %x\n", b)
		case "exit":
			return nil
		default:
			return fmt.Errorf("unknown command %q", cmd)
		}
	}
}

// importExplainer is api.ImportExplainer, named here so that the test
// says what is missing rather than failing to build without it.
type importExplainer interface {
	ExplainImport(osHandle uintptr, handleType int32) error
}

// TestVMMImportRefusesUnsafe: a memfd with a genuine header (a copy of a
// real allocation's, checksum and all) imports only when it is sealed
// against shrinking and growing, not against writing, and exactly the
// header and the memory in size. Anything else is CUDA_ERROR_UNKNOWN, as
// for any fd that is not an exported allocation, and ExplainImport names
// the cause.
func TestVMMImportRefusesUnsafe(t *testing.T) {
	lockThread(t)
	a := newDriver(t, Config{})
	b := newDriver(t, Config{Dir: a.Dir()})
	primary(t, a, 0)
	var h api.MemHandle
	ok(t, "MemCreate", a.MemCreate(&h, sealTestSize, vmmProp(0, api.MemHandleTypePosixFileDescriptor), 0))
	defer a.MemRelease(h)
	var efd int32
	ok(t, "MemExportToShareableHandle", a.MemExportToShareableHandle(unsafe.Pointer(&efd), h, api.MemHandleTypePosixFileDescriptor, 0))
	hdr := make([]byte, vmmHeaderSize)
	_, err := unix.Pread(int(efd), hdr, 0)
	unix.Close(int(efd))
	if err != nil {
		t.Fatal(err)
	}

	const full = vmmHeaderSize + sealTestSize
	forge := func(t *testing.T, size int64, seals int) int {
		fd, err := unix.MemfdCreate("cudashare-sim-vmm-forged", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Close(fd) })
		if err := unix.Ftruncate(fd, size); err != nil {
			t.Fatal(err)
		}
		if _, err := unix.Pwrite(fd, hdr, 0); err != nil {
			t.Fatal(err)
		}
		if seals != 0 {
			if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
				t.Fatal(err)
			}
		}
		return fd
	}
	plainFile := func(t *testing.T) int {
		path := filepath.Join(t.TempDir(), "allocation")
		if err := os.WriteFile(path, append(hdr, make([]byte, sealTestSize)...), 0o600); err != nil {
			t.Fatal(err)
		}
		fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Close(fd) })
		return fd
	}
	const sealed = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW
	for _, tc := range []struct {
		name  string
		fd    func(t *testing.T) int
		cause string // "" when it imports
	}{
		{"sealed copy", func(t *testing.T) int { return forge(t, full, sealed) }, ""},
		{"sealed copy, seals sealed", func(t *testing.T) int { return forge(t, full, sealed|unix.F_SEAL_SEAL) }, ""},
		{"unsealed", func(t *testing.T) int { return forge(t, full, 0) }, "not sealed against shrinking and growing"},
		{"sealed against shrinking only", func(t *testing.T) int { return forge(t, full, unix.F_SEAL_SHRINK) }, "not sealed against shrinking and growing"},
		{"sealed against growing only", func(t *testing.T) int { return forge(t, full, unix.F_SEAL_GROW) }, "not sealed against shrinking and growing"},
		{"sealed against writing", func(t *testing.T) int { return forge(t, full, sealed|unix.F_SEAL_WRITE) }, "sealed against writing"},
		{"one page too long", func(t *testing.T) int { return forge(t, full+4096, sealed) }, "the memfd has"},
		{"shrunk before sealing", func(t *testing.T) int { return forge(t, vmmHeaderSize+4096, sealed) }, "the memfd has"},
		{"header only", func(t *testing.T) int { return forge(t, vmmHeaderSize, sealed) }, "the memfd has"},
		// Whether F_GET_SEALS fails (a disk file) or shows no seal but
		// F_SEAL_SEAL (a tmpfs file), a file is refused.
		{"a file, not a memfd", plainFile, "not a VMM allocation of the simulator"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lockThread(t)
			primary(t, b, 0)
			fd := tc.fd(t)
			var hb api.MemHandle
			r := b.MemImportFromShareableHandle(&hb, uintptr(fd), api.MemHandleTypePosixFileDescriptor)
			if tc.cause == "" {
				ok(t, "import", r)
				ok(t, "MemRelease", b.MemRelease(hb))
				return
			}
			if r == api.Success {
				b.MemRelease(hb)
			}
			check(t, "import", r, api.ErrorUnknown)
			ex, isEx := any(b).(importExplainer)
			if !isEx {
				t.Fatal("the sim does not explain a refused import")
			}
			if why := ex.ExplainImport(uintptr(fd), api.MemHandleTypePosixFileDescriptor); why == nil || !strings.Contains(why.Error(), tc.cause) {
				t.Errorf("ExplainImport = %v, want %q", why, tc.cause)
			}
		})
	}
	// The creator's own fd explains nothing: it imports.
	ok(t, "MemExportToShareableHandle", a.MemExportToShareableHandle(unsafe.Pointer(&efd), h, api.MemHandleTypePosixFileDescriptor, 0))
	defer unix.Close(int(efd))
	if ex, isEx := any(b).(importExplainer); isEx {
		if why := ex.ExplainImport(uintptr(efd), api.MemHandleTypePosixFileDescriptor); why != nil {
			t.Errorf("ExplainImport of a genuine allocation: %v", why)
		}
	}
}

// TestVMMLayoutDocumented: PROTOCOL.md section 4.1.1, from which a peer in
// another language maps the simulator's allocations, says where each field
// of the header is, and the seals a receiver checks, as the sim has them.
func TestVMMLayoutDocumented(t *testing.T) {
	b, err := os.ReadFile("../../../PROTOCOL.md")
	if err != nil {
		t.Fatal(err)
	}
	_, sec, found := strings.Cut(string(b), "\n### 4.1.1 ")
	if !found {
		t.Fatal("PROTOCOL.md has no section 4.1.1 on the simulator's vmm allocations")
	}
	sec, _, _ = strings.Cut(sec, "\n### ")
	type row struct{ off, n int }
	var rows []row
	for _, l := range strings.Split(sec, "\n") {
		var r row
		if _, err := fmt.Sscanf(l, "| %d |", &r.off); err == nil {
			fmt.Sscanf(l, "| %d | %d |", &r.off, &r.n) // the memory's row has `size`
			rows = append(rows, r)
		}
	}
	d := newDriver(t, Config{})
	h := vmmHeader{dev: 1, size: 2 << 20, gid: 3, slot: 4, handleTypes: api.MemHandleTypePosixFileDescriptor,
		creator: procID{pid: 5, inst: 6, start: 7}}
	enc := d.encodeVMMHeader(h)
	le := func(off, n int) uint64 {
		var v uint64
		for i := n - 1; i >= 0; i-- {
			v = v<<8 | uint64(enc[off+i])
		}
		return v
	}
	// The rows in order, each with the value the encoder put there.
	want := []struct {
		off, n int
		val    uint64
	}{
		{0, 8, le(0, 8)}, {8, 4, vmmVersion}, {12, 4, 1}, {16, 8, 2 << 20}, {24, 8, 3}, {32, 4, 4},
		{36, 4, uint64(api.MemHandleTypePosixFileDescriptor)}, {40, 4, 5}, {44, 4, 6}, {48, 8, 7},
		{vmmSumOffset, 8, d.vmmSum(&enc)}, {64, vmmHeaderSize - 64, 0}, {vmmHeaderSize, 0, 0},
	}
	if len(rows) != len(want) {
		t.Fatalf("section 4.1.1 has %d rows of offsets, want %d: %v", len(rows), len(want), rows)
	}
	for i, w := range want {
		if rows[i].off != w.off || (w.n != 0 && rows[i].n != w.n) {
			t.Errorf("row %d: offset %d, %d bytes; the sim has offset %d, %d bytes", i, rows[i].off, rows[i].n, w.off, w.n)
			continue
		}
		if w.n != 0 && w.n <= 8 && le(w.off, w.n) != w.val {
			t.Errorf("row %d: the sim has %#x at offset %d, want %#x", i, le(w.off, w.n), w.off, w.val)
		}
	}
	if string(enc[:8]) != vmmMagic || !strings.Contains(sec, "`"+vmmMagic+"`") {
		t.Errorf("the magic %q is not the page's", enc[:8])
	}
	for _, s := range []struct {
		name string
		val  int
	}{{"F_SEAL_SHRINK", unix.F_SEAL_SHRINK}, {"F_SEAL_GROW", unix.F_SEAL_GROW}, {"F_SEAL_WRITE", unix.F_SEAL_WRITE}, {"F_SEAL_FUTURE_WRITE", unix.F_SEAL_FUTURE_WRITE}} {
		if !strings.Contains(sec, fmt.Sprintf("`%s` (%d)", s.name, s.val)) {
			t.Errorf("section 4.1.1 does not give %s as %d", s.name, s.val)
		}
	}
}
