package driver

import (
	"bytes"
	"errors"
	"testing"
)

// TestVMMSafeAPI: the safe VMM types in one process, on whichever backend
// the tests run: an exportable allocation is mapped, written, exported and
// imported again, the import's mapping reads the same bytes after the
// original allocation and its mapping are closed, Close is idempotent
// everywhere, and closed or unsuitable objects give errors, not calls.
func TestVMMSafeAPI(t *testing.T) {
	dev, err := testDriver.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	s, err := dev.VMMSupport()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %+v", dev, s)
	if !s.VMM || !s.PosixFD {
		t.Skipf("%s lacks VMM or POSIX-fd handles: %+v", dev, s)
	}
	gran, rec, err := dev.AllocationGranularity()
	if err != nil {
		t.Fatal(err)
	}
	if gran == 0 || rec < gran {
		t.Fatalf("granularity %d, recommended %d", gran, rec)
	}
	ctx, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()

	if _, err := ctx.MemCreate(gran, MemCreateOptions{Fabric: true}); !errors.Is(err, ErrNotSupported) || !errors.Is(err, ErrFabricUnsupported) {
		t.Errorf("MemCreate with Fabric = %v, want ErrFabricUnsupported (an ErrNotSupported)", err)
	}
	plain, err := ctx.MemCreate(gran, MemCreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := plain.ExportFD(); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("ExportFD of an allocation made without Exportable = %v, want ErrInvalidValue", err)
	}
	if err := plain.Close(); err != nil {
		t.Fatal(err)
	}

	a, err := ctx.MemCreate(2*gran, MemCreateOptions{Exportable: true})
	if err != nil {
		t.Fatal(err)
	}
	m, err := ctx.Map(a)
	if err != nil {
		t.Fatal(err)
	}
	if acc, err := m.Access(dev); err != nil || acc != 3 {
		t.Errorf("Access = %d, %v; want 3 (read-write)", acc, err)
	}
	want := vmmPattern(2 * gran)
	if err := ctx.CopyHtoD(m.Ptr(), want); err != nil {
		t.Fatal(err)
	}
	f, err := a.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	b, err := ctx.ImportFD(int(f.Fd()), a.Size())
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	mb, err := ctx.Map(b)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []interface{ Close() error }{m, a, b} {
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		if err := c.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	}
	got := make([]byte, len(want))
	if err := ctx.CopyDtoH(got, mb.Ptr()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Error("the imported mapping does not hold what was written through the first one")
	}
	if _, err := ctx.Map(a); !errors.Is(err, ErrClosed) {
		t.Errorf("Map of a closed allocation = %v, want ErrClosed", err)
	}
	if _, err := a.ExportFD(); !errors.Is(err, ErrClosed) {
		t.Errorf("ExportFD of a closed allocation = %v, want ErrClosed", err)
	}
	if err := mb.Close(); err != nil {
		t.Fatal(err)
	}
	if err := mb.Close(); err != nil {
		t.Errorf("second Mapping.Close: %v", err)
	}
	var nilA *Allocation
	var nilM *Mapping
	if nilA.Close() != nil || nilM.Close() != nil {
		t.Error("Close of nil is not a no-op")
	}
}
