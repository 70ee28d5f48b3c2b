package app

import (
	"errors"
	"fmt"
	"sync"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/share"
)

// -verify async: real GPU work per batch with no host wait. Each pool
// worker has a stream of its own; a batch is copied device to device into
// the worker's local buffer on that stream (the work a trainer would do),
// and the lease is released stream-ordered after the copy.
//
// The same copy leaves a 16-byte sample of the batch to check, with no
// other driver call: batch k of a round goes to local + 16k. Copies on one
// stream run in order, so batch k+1, written from local + 16(k+1) on,
// overwrites all of batch k but its first 16 bytes: after asyncSlots
// batches, the first asyncSlots x 16 bytes hold each batch's first 16.
// (The local buffer is that much larger than a batch.)
//
// The slots come in asyncGroups groups of asyncSlots. Once a group is full,
// its samples go back to pinned host memory with one asynchronous copy on
// the stream, queued before any later batch's copy can overwrite them, and
// an event is recorded after it; the group is checked when it comes round
// again, by which time the GPU has long finished with it (a query of the
// event says so, with no wait). Only a GPU more than (asyncGroups-1) x
// asyncSlots batches behind the worker makes it wait, and Waits counts
// those. Until then nothing on the host waits for the GPU, and the checks
// cost two driver calls per asyncSlots batches.

const (
	asyncSlots      = 64
	asyncGroups     = 4
	asyncSampleSize = 16
)

// asyncGroup is asyncSlots samples: their batches, and the event recorded
// after their copy back.
type asyncGroup struct {
	ev      *driver.Event
	seqs    [asyncSlots]uint64
	lens    [asyncSlots]uint8
	n       int
	pending bool // copied back (queued), not yet checked
}

// asyncWorker is one pool worker's buffers, found by its stream.
type asyncWorker struct {
	local     driver.DevicePtr   // asyncSampleBytes, then room for a batch
	localSize uint64             // the room for a batch
	host      *driver.HostBuffer // the samples' pinned copy
	groups    [asyncGroups]asyncGroup
	cur       int
}

// asyncState holds the workers' buffers.
type asyncState struct {
	mu      sync.Mutex
	workers map[*driver.Stream]*asyncWorker
	waits   uint64 // times a worker waited for its GPU work to catch up
}

const (
	asyncGroupBytes  = asyncSlots * asyncSampleSize
	asyncSampleBytes = asyncGroups * asyncGroupBytes // the samples at the start of the local buffer
)

// asyncWorker returns the buffers of the worker whose stream is s, with
// room for a batch of size bytes.
func (c *consumer) asyncWorker(s *driver.Stream, size uint64) (*asyncWorker, error) {
	a := &c.async
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.workers == nil {
		a.workers = make(map[*driver.Stream]*asyncWorker)
	}
	w := a.workers[s]
	if w == nil {
		var err error
		if w, err = c.newAsyncWorker(); err != nil {
			return nil, err
		}
		a.workers[s] = w
	}
	if w.localSize < size {
		if err := c.growLocal(w, s, size); err != nil {
			return nil, err
		}
	}
	return w, nil
}

func (c *consumer) newAsyncWorker() (w *asyncWorker, err error) {
	ctx := c.dev.ctx
	w = &asyncWorker{}
	defer func() {
		if err != nil {
			c.freeAsyncWorker(w)
		}
	}()
	if w.host, err = ctx.AllocHost(asyncSampleBytes); err != nil {
		return nil, fmt.Errorf("allocate pinned memory for the checks: %w", err)
	}
	for i := range w.groups {
		if w.groups[i].ev, err = ctx.NewEvent(driver.EventDisableTiming); err != nil {
			return nil, fmt.Errorf("create a check event: %w", err)
		}
	}
	return w, nil
}

// growLocal gives w a local buffer with room for a batch of size bytes,
// moving the samples taken so far.
func (c *consumer) growLocal(w *asyncWorker, s *driver.Stream, size uint64) error {
	ctx := c.dev.ctx
	p, err := ctx.Alloc(asyncSampleBytes + size)
	if err != nil {
		return fmt.Errorf("allocate a %s local buffer: %w", FormatSize(size), err)
	}
	if w.local != 0 {
		// Work on s may still read or write the old buffer; the group
		// being filled has samples nowhere else. Rare: the host waits.
		err := s.Synchronize()
		if err == nil {
			err = ctx.CopyDtoD(p, w.local, asyncSampleBytes)
		}
		if err != nil {
			ctx.Free(p)
			return err
		}
		ctx.Free(w.local)
	}
	w.local, w.localSize = p, size
	return nil
}

// handleAsync is one batch of -verify async on the lease's stream. The
// pool releases the lease stream-ordered after it returns.
func (c *consumer) handleAsync(l *share.Lease, seq uint64, ok bool) error {
	s := l.Stream()
	if s == nil {
		return errors.New("-verify async: a lease without a worker stream")
	}
	return c.asyncBatch(s, l.Ptr(), l.Size(), seq, ok)
}

// asyncBatch queues the work on batch seq, size bytes at ptr, on the
// worker's stream s; ok: its metadata was read, so it can be checked.
func (c *consumer) asyncBatch(s *driver.Stream, ptr driver.DevicePtr, size, seq uint64, ok bool) error {
	w, err := c.asyncWorker(s, size)
	if err != nil {
		return err
	}
	g := &w.groups[w.cur]
	if ok && g.pending {
		// Its last round is still to be checked: done long ago, unless
		// the GPU is far behind.
		if err := c.checkGroup(w, w.cur); err != nil {
			return err
		}
	}
	// The batch goes where its first bytes are this slot's sample; a batch
	// that cannot be checked (!ok) is copied there too, and the next one
	// overwrites it.
	ctx := c.dev.ctx
	at := w.local + driver.DevicePtr(w.cur*asyncGroupBytes+g.n*asyncSampleSize)
	if err := ctx.CopyDtoDAsync(at, ptr, size, s); err != nil {
		return fmt.Errorf("copy the batch on the worker's stream: %w", err)
	}
	if !ok {
		return nil
	}
	g.seqs[g.n], g.lens[g.n] = seq, uint8(min(asyncSampleSize, size))
	if g.n++; g.n < asyncSlots {
		return nil
	}
	// Full: back to the host before any later copy overwrites it, and
	// checked when the group comes round again.
	off := w.cur * asyncGroupBytes
	if err := ctx.CopyDtoHAsync(w.host.Bytes()[off:off+asyncGroupBytes], w.local+driver.DevicePtr(off), s); err != nil {
		return fmt.Errorf("copy the samples back: %w", err)
	}
	if err := g.ev.Record(s); err != nil {
		return fmt.Errorf("record the samples' event: %w", err)
	}
	g.pending = true
	w.cur = (w.cur + 1) % asyncGroups
	return nil
}

// checkGroup checks group i's samples, once its copy back is done: at
// once if its event says so, else after waiting for it (counted).
func (c *consumer) checkGroup(w *asyncWorker, i int) error {
	g := &w.groups[i]
	done, err := g.ev.Done()
	if err == nil && !done {
		c.async.mu.Lock()
		c.async.waits++
		c.async.mu.Unlock()
		err = g.ev.Synchronize()
	}
	if err != nil {
		return fmt.Errorf("wait for the samples' copy back: %w", err)
	}
	c.checkSamples(g, w.host.Bytes()[i*asyncGroupBytes:])
	return nil
}

// checkSamples compares each of g's samples, in buf, with its batch's byte.
func (c *consumer) checkSamples(g *asyncGroup, buf []byte) {
	for i := range g.n {
		want := patternByte(g.seqs[i])
		good := true
		for _, b := range buf[i*asyncSampleSize : i*asyncSampleSize+int(g.lens[i])] {
			if b != want {
				good = false
				break
			}
		}
		if good {
			c.verified.Add(1)
		} else if c.verifyErrors.Add(1) <= 10 {
			c.log.Error("wrong batch content", "seq", g.seqs[i], "want", want)
		}
	}
	g.n, g.pending = 0, false
}

// finishAsync checks what the workers sampled since their last check and
// frees their buffers. The pool has ended: the importer waited for the
// stream-ordered releases, whose events were recorded after the copies.
func (c *consumer) finishAsync() {
	a := &c.async
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.workers) > 0 {
		if err := c.dev.ctx.Synchronize(); err != nil {
			c.errs.Add(1)
			c.log.Error("cannot wait for the GPU work to finish", "err", err)
		}
	}
	for _, w := range a.workers {
		for i := range w.groups {
			g := &w.groups[i]
			if g.n == 0 {
				continue
			}
			buf := w.host.Bytes()[i*asyncGroupBytes : (i+1)*asyncGroupBytes]
			if !g.pending {
				// The group being filled: its samples were never copied back.
				if err := c.dev.ctx.CopyDtoH(buf, w.local+driver.DevicePtr(i*asyncGroupBytes)); err != nil {
					c.errs.Add(1)
					c.log.Error("cannot read the samples back from the GPU", "err", err)
					g.n = 0
					continue
				}
			}
			c.checkSamples(g, buf)
		}
		c.freeAsyncWorker(w)
	}
	a.workers = nil
	waits := a.waits
	c.rep.AsyncWaits = &waits
}

// freeAsyncWorker frees w's buffers and events; the GPU is done with them.
func (c *consumer) freeAsyncWorker(w *asyncWorker) {
	ctx := c.dev.ctx
	for i := range w.groups {
		if ev := w.groups[i].ev; ev != nil {
			ev.Close()
		}
	}
	w.host.Close()
	if w.local != 0 {
		ctx.Free(w.local)
	}
}
