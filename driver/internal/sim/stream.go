package sim

import (
	"sync/atomic"
	"time"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Work is synchronous in the sim: a copy or set has completed when its call
// returns, so streams hold no queue and an event is complete once recorded
// (and, as in CUDA, before it was ever recorded). What the sim does check is
// every handle: an unknown or destroyed stream or event is
// CUDA_ERROR_INVALID_HANDLE. (The real driver sometimes answers
// CUDA_ERROR_INVALID_VALUE, or crashes, for a destroyed handle; the sim
// picks the documented code.)

// The special stream handles CU_STREAM_LEGACY and CU_STREAM_PER_THREAD. Like
// 0, they name a default stream of the current context.
const (
	streamLegacy    api.Stream = 1
	streamPerThread api.Stream = 2
)

// CU_EVENT_WAIT_EXTERNAL is the only cuStreamWaitEvent flag.
const eventWaitExternal = 0x1

type streamState struct {
	h     api.Stream
	ctx   *ctxState
	flags uint32
}

type eventState struct {
	h     api.Event
	ctx   *ctxState
	flags uint32
	// origin and serial name the event across processes: those of the
	// exporter for an event opened from an IPC handle.
	origin procID
	serial uint64
	// recorded is when it was last recorded, in ns since Driver.epoch plus
	// one; zero: never.
	recorded atomic.Int64
}

// streamContext resolves a stream to its context. It takes no lock: it runs
// on the per-handoff path.
func (d *Driver) streamContext(s api.Stream) (*ctxState, api.Result) {
	switch s {
	case 0, streamLegacy, streamPerThread:
		return d.current()
	}
	st := d.streams.get(uintptr(s))
	if st == nil {
		return nil, api.ErrorInvalidHandle
	}
	return st.ctx, api.Success
}

// StreamCreate implements api.API.
func (d *Driver) StreamCreate(stream *api.Stream, flags uint32) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if stream == nil || flags&^api.StreamNonBlocking != 0 {
		return api.ErrorInvalidValue
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	c, r := d.current()
	if r != api.Success {
		return r
	}
	_, s, ok := d.streams.add(func(h uintptr) *streamState {
		return &streamState{h: api.Stream(h), ctx: c, flags: flags}
	})
	if !ok {
		return api.ErrorOutOfMemory
	}
	c.streams[s] = struct{}{}
	*stream = s.h
	return api.Success
}

// StreamDestroy implements api.API. The default streams cannot be
// destroyed: CUDA_ERROR_INVALID_HANDLE (measured for 0).
func (d *Driver) StreamDestroy(stream api.Stream) api.Result {
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	s := d.streams.get(uintptr(stream))
	if s == nil {
		return api.ErrorInvalidHandle
	}
	d.streams.remove(uintptr(stream))
	delete(s.ctx.streams, s)
	return api.Success
}

// StreamSynchronize implements api.API.
func (d *Driver) StreamSynchronize(stream api.Stream) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if _, r := d.streamContext(stream); r != api.Success {
		return r
	}
	d.hostWaited()
	return api.Success
}

// StreamWaitEvent implements api.API. The event may belong to another
// context, as in CUDA. Order: flags, stream, event. CU_EVENT_WAIT_EXTERNAL
// outside stream capture (the sim never captures) is
// CUDA_ERROR_ILLEGAL_STATE (measured).
func (d *Driver) StreamWaitEvent(stream api.Stream, event api.Event, flags uint32) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if flags&^eventWaitExternal != 0 {
		return api.ErrorInvalidValue
	}
	if _, r := d.streamContext(stream); r != api.Success {
		return r
	}
	if d.events.get(uintptr(event)) == nil {
		return api.ErrorInvalidHandle
	}
	if flags == eventWaitExternal {
		return api.ErrorIllegalState
	}
	return api.Success
}

// newEvent makes an event in c. mu held.
func (d *Driver) newEvent(c *ctxState, flags uint32, origin procID, serial uint64) (*eventState, api.Result) {
	_, e, ok := d.events.add(func(h uintptr) *eventState {
		return &eventState{h: api.Event(h), ctx: c, flags: flags, origin: origin, serial: serial}
	})
	if !ok {
		return nil, api.ErrorOutOfMemory
	}
	c.events[e] = struct{}{}
	return e, api.Success
}

// EventCreate implements api.API. CU_EVENT_INTERPROCESS requires
// CU_EVENT_DISABLE_TIMING.
func (d *Driver) EventCreate(event *api.Event, flags uint32) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	const valid = api.EventBlockingSync | api.EventDisableTiming | api.EventInterprocess
	if event == nil || flags&^valid != 0 ||
		flags&api.EventInterprocess != 0 && flags&api.EventDisableTiming == 0 {
		return api.ErrorInvalidValue
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	c, r := d.current()
	if r != api.Success {
		return r
	}
	d.lastEvent++
	e, r := d.newEvent(c, flags, d.self, d.lastEvent)
	if r != api.Success {
		return r
	}
	*event = e.h
	return api.Success
}

// EventDestroy implements api.API; it also ends events opened from IPC
// handles.
func (d *Driver) EventDestroy(event api.Event) api.Result {
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	e := d.events.get(uintptr(event))
	if e == nil {
		return api.ErrorInvalidHandle
	}
	d.events.remove(uintptr(event))
	delete(e.ctx.events, e)
	return api.Success
}

// EventRecord implements api.API. The event and the stream must belong to
// the same context, else CUDA_ERROR_INVALID_HANDLE, as cuEventRecord
// documents; for a default stream that is the current context (measured;
// with none current, CUDA_ERROR_INVALID_CONTEXT, measured).
// No lock, no allocation: it runs on every handoff.
func (d *Driver) EventRecord(event api.Event, stream api.Stream) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	e := d.events.get(uintptr(event))
	if e == nil {
		return api.ErrorInvalidHandle
	}
	c, r := d.streamContext(stream)
	if r != api.Success {
		return r
	}
	if c != e.ctx {
		return api.ErrorInvalidHandle
	}
	e.recorded.Store(int64(time.Since(d.epoch)) + 1)
	return api.Success
}

// EventSynchronize implements api.API.
func (d *Driver) EventSynchronize(event api.Event) api.Result {
	return d.EventQuery(event)
}

// EventQuery implements api.API: CUDA_SUCCESS for any live event.
func (d *Driver) EventQuery(event api.Event) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if d.events.get(uintptr(event)) == nil {
		return api.ErrorInvalidHandle
	}
	d.hostWaited()
	return api.Success
}

// EventElapsedTime implements api.API. An event made with
// CU_EVENT_DISABLE_TIMING, or never recorded, is CUDA_ERROR_INVALID_HANDLE,
// as with the real driver.
func (d *Driver) EventElapsedTime(ms *float32, start, end api.Event) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if ms == nil {
		return api.ErrorInvalidValue
	}
	s, e := d.events.get(uintptr(start)), d.events.get(uintptr(end))
	if s == nil || e == nil || (s.flags|e.flags)&api.EventDisableTiming != 0 {
		return api.ErrorInvalidHandle
	}
	t0, t1 := s.recorded.Load(), e.recorded.Load()
	if t0 == 0 || t1 == 0 {
		return api.ErrorInvalidHandle
	}
	*ms = float32(t1-t0) / 1e6
	return api.Success
}

// StreamGetCtx implements api.API: the context a stream was created in; for
// a default stream, the current context. A handle the sim did not create,
// or one destroyed, is CUDA_ERROR_INVALID_HANDLE: this is what lets the
// safe layer refuse a foreign handle that is no stream (the real driver
// cannot tell, and may crash on one).
func (d *Driver) StreamGetCtx(stream api.Stream, ctx *api.Context) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if ctx == nil {
		return api.ErrorInvalidValue
	}
	c, r := d.streamContext(stream)
	if r != api.Success {
		return r
	}
	*ctx = c.h
	return api.Success
}
