package driver

import (
	"fmt"
	"sync/atomic"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Stream is a CUstream of a context: one made by NewStream, which Close
// destroys, or one made elsewhere and wrapped by WrapStream, which Close
// leaves alone.
type Stream struct {
	ctx     *Context
	h       api.Stream
	foreign bool // not ours to destroy
	closed  atomic.Bool
}

// handle is the CUstream; a nil *Stream is the NULL stream.
func (s *Stream) handle() api.Stream {
	if s == nil {
		return 0
	}
	return s.h
}

// NewStream is cuStreamCreate. A non-blocking stream does not synchronize
// with the NULL stream.
func (c *Context) NewStream(nonBlocking bool) (*Stream, error) {
	if err := c.enter(); err != nil {
		return nil, err
	}
	defer c.exit()
	flags := api.StreamDefault
	if nonBlocking {
		flags = api.StreamNonBlocking
	}
	var h api.Stream
	if err := check(c.a.StreamCreate(&h, flags), "cuStreamCreate"); err != nil {
		return nil, err
	}
	return &Stream{ctx: c, h: h}, nil
}

// Handle is the raw CUstream, for CUDA code outside this package (cgo,
// another binding) that queues work on the stream: a kernel that writes a
// buffer before Offer, or reads a lease. It stays valid until Close of the
// stream that owns it; 0 for a nil *Stream (the NULL stream).
func (s *Stream) Handle() uintptr { return uintptr(s.handle()) }

// WrapStream returns a Stream for h, a CUstream of this context made by
// code outside this package, so that h can be used wherever this package
// takes a *Stream (Event.Record, Lease.ReleaseAfter, an offer's stream).
// 0 is the NULL stream.
//
// # Ownership
//
// The caller keeps h: Close of the returned Stream does not destroy it, and
// h must stay alive until the Stream is no longer used.
//
// WrapStream checks h with cuStreamGetCtx and refuses, with an error
// matching ErrInvalidHandle, a stream of another context: events recorded
// on it would fail later, and far from the cause. The real driver cannot
// tell a garbage handle from a stream (it may crash on one); the simulator
// refuses any handle it did not create, with ErrInvalidHandle.
func (c *Context) WrapStream(h uintptr) (*Stream, error) {
	if err := c.enter(); err != nil {
		return nil, err
	}
	defer c.exit()
	var owner api.Context
	if err := check(c.a.StreamGetCtx(api.Stream(h), &owner), "cuStreamGetCtx"); err != nil {
		return nil, fmt.Errorf("wrap stream %#x: %w", h, err)
	}
	if owner != c.h {
		return nil, fmt.Errorf("wrap stream %#x: it belongs to context %#x, not to the %s (%#x): %w",
			h, uintptr(owner), c, uintptr(c.h), ErrInvalidHandle)
	}
	return &Stream{ctx: c, h: api.Stream(h), foreign: true}, nil
}

// Close is cuStreamDestroy_v2 for a stream made by NewStream; for one of
// WrapStream it destroys nothing (the stream is its maker's). Idempotent.
func (s *Stream) Close() error {
	if s == nil || s.closed.Swap(true) || s.foreign {
		return nil
	}
	if err := s.ctx.enter(); err != nil {
		return err
	}
	defer s.ctx.exit()
	return check(s.ctx.a.StreamDestroy(s.h), "cuStreamDestroy_v2")
}

// Synchronize is cuStreamSynchronize.
func (s *Stream) Synchronize() error {
	if err := s.ctx.enter(); err != nil {
		return err
	}
	defer s.ctx.exit()
	return check(s.ctx.a.StreamSynchronize(s.h), "cuStreamSynchronize")
}

// WaitEvent is cuStreamWaitEvent: work queued on s after this call waits
// for e, without blocking the host. e may come from another process.
func (s *Stream) WaitEvent(e *Event) error {
	if err := s.ctx.enter(); err != nil {
		return err
	}
	defer s.ctx.exit()
	return check(s.ctx.a.StreamWaitEvent(s.h, e.h, 0), "cuStreamWaitEvent")
}

// EventFlags are CUevent_flags.
type EventFlags uint32

// Event flags. Interprocess events must also disable timing.
const (
	EventDefault       = EventFlags(api.EventDefault)
	EventBlockingSync  = EventFlags(api.EventBlockingSync)
	EventDisableTiming = EventFlags(api.EventDisableTiming)
	EventInterprocess  = EventFlags(api.EventInterprocess)
)

// Event is a CUevent of a context.
type Event struct {
	ctx    *Context
	h      api.Event
	closed atomic.Bool
}

// NewEvent is cuEventCreate.
func (c *Context) NewEvent(flags EventFlags) (*Event, error) {
	if err := c.enter(); err != nil {
		return nil, err
	}
	defer c.exit()
	var h api.Event
	if err := check(c.a.EventCreate(&h, uint32(flags)), "cuEventCreate"); err != nil {
		return nil, err
	}
	return &Event{ctx: c, h: h}, nil
}

// IpcOpenEventHandle is cuIpcOpenEventHandle: an event of another process.
func (c *Context) IpcOpenEventHandle(h IpcEventHandle) (*Event, error) {
	if err := c.enter(); err != nil {
		return nil, err
	}
	defer c.exit()
	var e api.Event
	if err := check(c.a.IpcOpenEventHandle(&e, api.IpcEventHandle{Reserved: h}), "cuIpcOpenEventHandle"); err != nil {
		return nil, err
	}
	return &Event{ctx: c, h: e}, nil
}

// Close is cuEventDestroy_v2; idempotent.
func (e *Event) Close() error {
	if e == nil || e.closed.Swap(true) {
		return nil
	}
	if err := e.ctx.enter(); err != nil {
		return err
	}
	defer e.ctx.exit()
	return check(e.ctx.a.EventDestroy(e.h), "cuEventDestroy_v2")
}

// Record is cuEventRecord on s (nil: the NULL stream).
func (e *Event) Record(s *Stream) error {
	if err := e.ctx.enter(); err != nil {
		return err
	}
	defer e.ctx.exit()
	return check(e.ctx.a.EventRecord(e.h, s.handle()), "cuEventRecord")
}

// Synchronize is cuEventSynchronize.
func (e *Event) Synchronize() error {
	if err := e.ctx.enter(); err != nil {
		return err
	}
	defer e.ctx.exit()
	return check(e.ctx.a.EventSynchronize(e.h), "cuEventSynchronize")
}

// Done is cuEventQuery: true when the work before the record has finished.
func (e *Event) Done() (bool, error) {
	if err := e.ctx.enter(); err != nil {
		return false, err
	}
	defer e.ctx.exit()
	switch r := e.ctx.a.EventQuery(e.h); r {
	case api.Success:
		return true, nil
	case api.ErrorNotReady:
		return false, nil
	default:
		return false, check(r, "cuEventQuery")
	}
}

// IpcHandle is cuIpcGetEventHandle. The event must have been created with
// EventInterprocess|EventDisableTiming.
func (e *Event) IpcHandle() (IpcEventHandle, error) {
	if err := e.ctx.enter(); err != nil {
		return IpcEventHandle{}, err
	}
	defer e.ctx.exit()
	var h api.IpcEventHandle
	err := check(e.ctx.a.IpcGetEventHandle(&h, e.h), "cuIpcGetEventHandle")
	return IpcEventHandle(h.Reserved), err
}
