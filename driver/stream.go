package driver

import (
	"sync/atomic"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Stream is a CUstream of a context.
type Stream struct {
	ctx    *Context
	h      api.Stream
	closed atomic.Bool
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

// Close is cuStreamDestroy_v2; idempotent.
func (s *Stream) Close() error {
	if s == nil || s.closed.Swap(true) {
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
