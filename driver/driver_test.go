package driver

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

func TestOpenUnknownBackend(t *testing.T) {
	t.Setenv(EnvBackend, "")
	if _, err := Open(Config{Backend: "opencl"}); !errors.Is(err, ErrUnknownBackend) {
		t.Fatalf("Open(opencl) = %v, want ErrUnknownBackend", err)
	}
	t.Setenv(EnvBackend, "vulkan")
	if _, err := Open(Config{Backend: BackendSim}); !errors.Is(err, ErrUnknownBackend) {
		t.Fatalf("CUDASHARE_DRIVER=vulkan: Open = %v, want ErrUnknownBackend (the variable overrides Config)", err)
	}
}

func TestOpenMissingLibrary(t *testing.T) {
	t.Setenv(EnvBackend, "")
	_, err := Open(Config{Backend: BackendCUDA, LibraryPath: "/nonexistent/libcuda.so.1"})
	if !errors.Is(err, ErrLibraryNotFound) {
		t.Fatalf("Open(cuda, missing library) = %v, want ErrLibraryNotFound", err)
	}
}

func TestOpenAutoFallsBackToSim(t *testing.T) {
	t.Setenv(EnvBackend, "")
	d, err := Open(Config{Backend: BackendAuto, LibraryPath: "/nonexistent/libcuda.so.1"})
	if err != nil {
		t.Fatal(err)
	}
	if d.Backend() != BackendSim {
		t.Fatalf("auto without libcuda chose %s (%s)", d.Backend(), d.Reason())
	}
	if d.Reason() == "" {
		t.Fatal("auto gave no reason for its choice")
	}
}

func TestErrorsMatchSentinels(t *testing.T) {
	err := fmt.Errorf("enable peer: %w", &Error{Code: api.ErrorPeerAccessAlreadyEnabled, Op: "cuCtxEnablePeerAccess"})
	if !errors.Is(err, ErrPeerAccessAlreadyEnabled) {
		t.Errorf("%v does not match ErrPeerAccessAlreadyEnabled", err)
	}
	if errors.Is(err, ErrTooManyPeers) {
		t.Errorf("%v matches ErrTooManyPeers", err)
	}
	var de *Error
	if !errors.As(err, &de) || de.Code != api.ErrorPeerAccessAlreadyEnabled {
		t.Errorf("errors.As: %v", de)
	}
	if got, want := de.Error(), "cuCtxEnablePeerAccess: CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED (704)"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	if check(api.Success, "x") != nil {
		t.Error("check(Success) is not nil")
	}
}

func TestDevices(t *testing.T) {
	devs, err := testDriver.Devices()
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) == 0 {
		t.Fatal("no devices")
	}
	seen := map[UUID]bool{}
	for _, dev := range devs {
		name, err := dev.Name()
		if err != nil || name == "" {
			t.Errorf("%s: name %q, %v", dev, name, err)
		}
		if seen[dev.UUID()] {
			t.Errorf("%s: duplicate UUID", dev)
		}
		seen[dev.UUID()] = true
		if mem, err := dev.TotalMem(); err != nil || mem == 0 {
			t.Errorf("%s: total memory %d, %v", dev, mem, err)
		}
		for _, a := range []DeviceAttribute{AttrUnifiedAddressing, AttrIpcEventSupported} {
			if v, err := dev.Attribute(a); err != nil || v != 1 {
				t.Errorf("%s: attribute %d = %d, %v; cudashare needs 1", dev, a, v, err)
			}
		}
		got, err := testDriver.DeviceByUUID(dev.UUID())
		if err != nil || got != dev {
			t.Errorf("DeviceByUUID(%s) = %v, %v", dev.UUID(), got, err)
		}
		t.Logf("%s: %s", dev, name)
	}
	if _, err := testDriver.DeviceByUUID(UUID{1, 2, 3}); !errors.Is(err, ErrDeviceNotVisible) {
		t.Errorf("DeviceByUUID(unknown) = %v, want ErrDeviceNotVisible", err)
	}
}

// TestContextCallsIgnoreThreadState: whatever context a thread has current
// (here: none, set by goroutines that scribble on their threads), every
// method runs on its own context. Allocations land on the right device.
func TestContextCallsIgnoreThreadState(t *testing.T) {
	devs, err := testDriver.Devices()
	if err != nil {
		t.Fatal(err)
	}
	var ctxs []*Context
	for _, dev := range devs {
		c, err := dev.RetainPrimaryContext()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		ctxs = append(ctxs, c)
	}
	a := testDriver.raw()
	stop := make(chan struct{})
	var scribblers sync.WaitGroup
	for i := 0; i < 4; i++ {
		scribblers.Add(1)
		go func() {
			defer scribblers.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				runtime.LockOSThread()
				a.CtxSetCurrent(0)
				runtime.UnlockOSThread()
				runtime.Gosched()
			}
		}()
	}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for w := 0; w < 8; w++ {
		c := ctxs[w%len(ctxs)]
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				p, err := c.Alloc(4096)
				if err != nil {
					errs <- err
					return
				}
				var ord int32 = -1
				if r := a.PointerGetAttribute(unsafe.Pointer(&ord), api.PointerAttrDeviceOrdinal, api.DevicePtr(p)); r != api.Success {
					errs <- check(r, "cuPointerGetAttribute")
				} else if int(ord) != c.Device().Ordinal() {
					errs <- fmt.Errorf("allocation through %s landed on device %d", c, ord)
				}
				if err := c.Free(p); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	scribblers.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestContextCloseIsIdempotent(t *testing.T) {
	dev, err := testDriver.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := c.Alloc(16); !errors.Is(err, ErrClosed) {
		t.Fatalf("Alloc after Close = %v, want ErrClosed", err)
	}
	var nilCtx *Context
	if err := nilCtx.Close(); err != nil {
		t.Fatalf("nil Close: %v", err)
	}
}

func TestMemoryRoundTrip(t *testing.T) {
	dev, _ := testDriver.Device(0)
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const n = 1 << 16
	p, err := c.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Free(p)
	if err := c.Memset(p, 0xAB, n); err != nil {
		t.Fatal(err)
	}
	src := make([]byte, 100)
	for i := range src {
		src[i] = byte(i * 7)
	}
	if err := c.CopyHtoD(p+1000, src); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, n)
	if err := c.CopyDtoH(got, p); err != nil {
		t.Fatal(err)
	}
	for i := range got {
		want := byte(0xAB)
		if i >= 1000 && i < 1100 {
			want = src[i-1000]
		}
		if got[i] != want {
			t.Fatalf("byte %d = %#x, want %#x", i, got[i], want)
		}
	}
	base, size, err := c.AddressRange(p + 1234)
	if err != nil || base != p || size < n {
		t.Fatalf("AddressRange(p+1234) = %#x, %d, %v; want %#x, >= %d", base, size, err, p, n)
	}
	id1, err := c.BufferID(p)
	if err != nil || id1 == 0 {
		t.Fatalf("BufferID = %d, %v", id1, err)
	}
	free, total, err := c.MemInfo()
	if err != nil || total == 0 || free > total {
		t.Fatalf("MemInfo = %d, %d, %v", free, total, err)
	}
}

func TestEvents(t *testing.T) {
	dev, _ := testDriver.Device(0)
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.NewStream(true)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	e, err := c.NewEvent(EventInterprocess | EventDisableTiming)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := s.WaitEvent(e); err != nil {
		t.Fatal(err)
	}
	if err := e.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if done, err := e.Done(); err != nil || !done {
		t.Fatalf("Done after Synchronize = %v, %v", done, err)
	}
	if _, err := e.IpcHandle(); err != nil {
		t.Fatal(err)
	}
	plain, err := c.NewEvent(EventDefault)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	// Driver 580 says INVALID_HANDLE (measured on an H100).
	if _, err := plain.IpcHandle(); !errors.Is(err, ErrInvalidHandle) {
		t.Fatalf("IpcHandle of a non-interprocess event = %v, want ErrInvalidHandle", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Stream.Close: %v", err)
	}
}

// BenchmarkContextCall measures what the context-safety design adds to one
// driver call: "safe" is Event.Done (thread lock, cuCtxSetCurrent,
// cuEventQuery, unlock); "raw" is cuEventQuery alone on a thread that
// already has the context current.
func BenchmarkContextCall(b *testing.B) {
	dev, _ := testDriver.Device(0)
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	e, err := c.NewEvent(EventDisableTiming)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	if err := e.Record(nil); err != nil {
		b.Fatal(err)
	}
	e.Synchronize()
	b.Run("safe", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			if _, err := e.Done(); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("raw", func(b *testing.B) {
		b.ReportAllocs()
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		a := testDriver.raw()
		a.CtxSetCurrent(c.h)
		for i := 0; i < b.N; i++ {
			if r := a.EventQuery(e.h); r != api.Success {
				b.Fatal(r.Name())
			}
		}
	})
	b.Run("setcurrent", func(b *testing.B) {
		b.ReportAllocs()
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		a := testDriver.raw()
		for i := 0; i < b.N; i++ {
			a.CtxSetCurrent(c.h)
		}
	})
}
