package driver

import (
	"bytes"
	"errors"
	"runtime"
	"testing"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

func primaryCtx(t *testing.T, ord int) *Context {
	t.Helper()
	dev, err := testDriver.Device(ord)
	if err != nil {
		t.Fatal(err)
	}
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// foreignStream makes a stream in c the way code outside this package
// would: straight through the driver API, with c current on this thread.
func foreignStream(t *testing.T, c *Context) api.Stream {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	a := testDriver.raw()
	if r := a.CtxSetCurrent(api.Context(c.Handle())); r != api.Success {
		t.Fatalf("cuCtxSetCurrent: %s", r.Name())
	}
	var s api.Stream
	if r := a.StreamCreate(&s, api.StreamNonBlocking); r != api.Success {
		t.Fatalf("cuStreamCreate: %s", r.Name())
	}
	return s
}

// TestWrapStream: a stream made outside the package works as a *Stream
// (async copies, an event recorded on it), and Close of the wrapper leaves
// it alive: its maker can still use it and destroy it.
func TestWrapStream(t *testing.T) {
	c := primaryCtx(t, 0)
	h := foreignStream(t, c)
	s, err := c.WrapStream(uintptr(h))
	if err != nil {
		t.Fatal(err)
	}
	if s.Handle() != uintptr(h) {
		t.Fatalf("Handle() = %#x, want %#x", s.Handle(), uintptr(h))
	}
	p, err := c.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Free(p)
	src := bytes.Repeat([]byte("foreign!"), 512)
	if err := c.CopyHtoDAsync(p, src, s); err != nil {
		t.Fatal(err)
	}
	ev, err := c.NewEvent(EventDisableTiming)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	if err := ev.Record(s); err != nil {
		t.Fatalf("record on a wrapped stream: %v", err)
	}
	if err := ev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(src))
	if err := c.CopyDtoHAsync(got, p, s); err != nil { // pageable: complete on return
		t.Fatal(err)
	}
	if !bytes.Equal(got, src) {
		t.Fatal("the bytes copied back on the wrapped stream differ")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	a := testDriver.raw()
	a.CtxSetCurrent(api.Context(c.Handle()))
	if r := a.StreamSynchronize(h); r != api.Success {
		t.Fatalf("the stream after its wrapper's Close: cuStreamSynchronize = %s (Close destroyed what it did not create)", r.Name())
	}
	if r := a.StreamDestroy(h); r != api.Success {
		t.Fatalf("its maker destroys it: %s", r.Name())
	}
}

// TestWrapStreamRefused: a handle the driver does not know (the simulator
// can tell; the real driver may crash on one), a destroyed stream (same),
// and a stream of another context are refused with ErrInvalidHandle.
func TestWrapStreamRefused(t *testing.T) {
	c := primaryCtx(t, 0)
	if testDriver.Backend() == BackendSim {
		if _, err := c.WrapStream(0xdead0); !errors.Is(err, ErrInvalidHandle) {
			t.Errorf("WrapStream(garbage) = %v, want ErrInvalidHandle", err)
		}
		own, err := c.NewStream(true)
		if err != nil {
			t.Fatal(err)
		}
		h := own.Handle()
		own.Close()
		if _, err := c.WrapStream(h); !errors.Is(err, ErrInvalidHandle) {
			t.Errorf("WrapStream(destroyed) = %v, want ErrInvalidHandle", err)
		}
	}
	n, _ := testDriver.DeviceCount()
	if n < 2 {
		t.Skip("the other-context case needs 2 devices")
	}
	other := primaryCtx(t, 1)
	s, err := other.NewStream(true)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := c.WrapStream(s.Handle()); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("WrapStream(a stream of device 1's context) in device 0's = %v, want ErrInvalidHandle", err)
	}
}

// TestWrapNullStream: 0 is the NULL stream, as a nil *Stream is.
func TestWrapNullStream(t *testing.T) {
	c := primaryCtx(t, 0)
	s, err := c.WrapStream(0)
	if err != nil {
		t.Fatal(err)
	}
	if s.Handle() != 0 || (*Stream)(nil).Handle() != 0 {
		t.Fatalf("handles %#x, %#x", s.Handle(), (*Stream)(nil).Handle())
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if c.Handle() == 0 {
		t.Fatal("Context.Handle() is 0")
	}
}

// TestHostBuffer: pinned memory round trip through async copies on a
// stream, and an idempotent Close after which Bytes is nil.
func TestHostBuffer(t *testing.T) {
	c := primaryCtx(t, 0)
	s, err := c.NewStream(true)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const n = 1 << 16
	in, err := c.AllocHost(n)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := c.AllocHost(n)
	if err != nil {
		t.Fatal(err)
	}
	if len(in.Bytes()) != n {
		t.Fatalf("len(Bytes()) = %d", len(in.Bytes()))
	}
	for i := range in.Bytes() {
		in.Bytes()[i] = byte(i * 13)
	}
	p, err := c.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Free(p)
	if err := c.CopyHtoDAsync(p, in.Bytes(), s); err != nil {
		t.Fatal(err)
	}
	if err := c.CopyDtoHAsync(out.Bytes(), p, s); err != nil {
		t.Fatal(err)
	}
	// Pinned: the copies are done only once the stream is.
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(in.Bytes(), out.Bytes()) {
		t.Fatal("pinned round trip: bytes differ")
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if out.Bytes() != nil {
		t.Fatal("Bytes() after Close is not nil")
	}
	if err := (*HostBuffer)(nil).Close(); err != nil {
		t.Fatal(err)
	}
	// Empty copies are nothing to do, whatever the stream.
	if err := c.CopyHtoDAsync(p, nil, s); err != nil {
		t.Fatal(err)
	}
	if err := c.CopyDtoHAsync(nil, p, s); err != nil {
		t.Fatal(err)
	}
	// Past the end of the allocation.
	if err := c.CopyHtoDAsync(p+n-1, make([]byte, 2), s); !errors.Is(err, ErrInvalidValue) {
		t.Fatalf("copy past the allocation = %v, want ErrInvalidValue", err)
	}
}
