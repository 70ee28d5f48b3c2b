package app

import (
	"errors"
	"fmt"
	"sync"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/share"
)

// -verify async: real GPU work per batch with no host wait per batch. Each
// pool worker has a stream of its own; a batch is copied device to device
// into the worker's local buffer on that stream (the work a trainer would
// do), a 16-byte sample of it into one of asyncSlots check slots, and the
// lease is released stream-ordered after those copies. Once a worker's
// slots are full it waits for its stream once and checks all of them with
// one copy back: one host wait per asyncSlots batches.

const (
	asyncSlots      = 64
	asyncSampleSize = 16
)

// asyncWorker is one pool worker's device buffers, found by its stream.
type asyncWorker struct {
	local     driver.DevicePtr
	localSize uint64
	slots     driver.DevicePtr // asyncSlots samples of asyncSampleSize bytes
	seqs      [asyncSlots]uint64
	n         int
	host      [asyncSlots * asyncSampleSize]byte
}

// asyncState holds the workers' buffers.
type asyncState struct {
	mu      sync.Mutex
	workers map[*driver.Stream]*asyncWorker
}

// worker returns the buffers of the worker whose stream is s, with room
// for a batch of size bytes.
func (c *consumer) asyncWorker(s *driver.Stream, size uint64) (*asyncWorker, error) {
	a := &c.async
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.workers == nil {
		a.workers = make(map[*driver.Stream]*asyncWorker)
	}
	w := a.workers[s]
	if w == nil {
		slots, err := c.dev.ctx.Alloc(asyncSlots * asyncSampleSize)
		if err != nil {
			return nil, fmt.Errorf("allocate check slots: %w", err)
		}
		w = &asyncWorker{slots: slots}
		a.workers[s] = w
	}
	if w.localSize < size {
		if w.local != 0 {
			// Work on s may still read the old buffer.
			if err := s.Synchronize(); err != nil {
				return nil, err
			}
			c.dev.ctx.Free(w.local)
		}
		p, err := c.dev.ctx.Alloc(size)
		if err != nil {
			w.local, w.localSize = 0, 0
			return nil, fmt.Errorf("allocate a %s local buffer: %w", FormatSize(size), err)
		}
		w.local, w.localSize = p, size
	}
	return w, nil
}

// handleAsync is one batch of -verify async on the lease's stream. The
// pool releases the lease stream-ordered after it returns.
func (c *consumer) handleAsync(l *share.Lease, seq uint64, ok bool) error {
	s := l.Stream()
	if s == nil {
		return errors.New("-verify async: a lease without a worker stream")
	}
	w, err := c.asyncWorker(s, l.Size())
	if err != nil {
		return err
	}
	ctx := c.dev.ctx
	if err := ctx.CopyDtoDAsync(w.local, l.Ptr(), l.Size(), s); err != nil {
		return fmt.Errorf("copy the batch on the worker's stream: %w", err)
	}
	if !ok {
		return nil
	}
	n := min(asyncSampleSize, l.Size())
	if err := ctx.CopyDtoDAsync(w.slots+driver.DevicePtr(w.n*asyncSampleSize), l.Ptr(), n, s); err != nil {
		return fmt.Errorf("sample the batch: %w", err)
	}
	w.seqs[w.n] = seq
	if w.n++; w.n == asyncSlots {
		if err := s.Synchronize(); err != nil {
			return err
		}
		c.checkSlots(w, n)
	}
	return nil
}

// checkSlots reads a worker's samples back, once its stream is done with
// them, and checks each against its batch's byte.
func (c *consumer) checkSlots(w *asyncWorker, n uint64) {
	if w.n == 0 {
		return
	}
	buf := w.host[:w.n*asyncSampleSize]
	if err := c.dev.ctx.CopyDtoH(buf, w.slots); err != nil {
		c.errs.Add(1)
		c.log.Error("cannot read the samples back from the GPU", "err", err)
		w.n = 0
		return
	}
	for i := range w.n {
		want := patternByte(w.seqs[i])
		good := true
		for _, b := range buf[i*asyncSampleSize : i*asyncSampleSize+int(n)] {
			if b != want {
				good = false
				break
			}
		}
		if good {
			c.verified.Add(1)
		} else if c.verifyErrors.Add(1) <= 10 {
			c.log.Error("wrong batch content", "seq", w.seqs[i], "want", want)
		}
	}
	w.n = 0
}

// finishAsync checks what the workers sampled since their last check and
// frees their buffers. The pool has ended: the importer waited for the
// stream-ordered releases, whose events were recorded after the copies.
func (c *consumer) finishAsync() {
	a := &c.async
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, w := range a.workers {
		c.dev.ctx.Synchronize()
		c.checkSlots(w, min(asyncSampleSize, c.lastSize.Load()))
		c.dev.ctx.Free(w.slots)
		if w.local != 0 {
			c.dev.ctx.Free(w.local)
		}
	}
	a.workers = nil
}
