package main

import (
	"context"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/seed743c36cf/cudashare/driver"
)

// cropDecoder decodes a batch of JPEGs and crops each into dst, queued on
// the decoder's own stream (gpudecode.Decoder; a test's fake).
type cropDecoder interface {
	DecodeCrop(jpgs [][]byte, ws, hs, xs, ys []int, dst driver.DevicePtr) error
}

// lanes decodes on the GPU with one goroutine per decoder (a lane: its
// own nvJPEG state, stream, staging and ring buffer), so that several
// batches are queued at once: a decode call that waits on the host for the
// GPU (nvJPEG's batched decode has host phases) holds up its lane only,
// and the loader's context has work queued whenever the GPU turns to it.
// Without MPS the trainer's context and the loader's take turns on the
// GPU, and an empty queue when the loader's turn comes is a turn lost.
//
// Batches take their buffer and are offered in the source's order, each
// turn handed on by closing a channel. Taking in order is what keeps the
// lanes from deadlocking: the buffers the lanes hold belong to the oldest
// batches not yet offered, so the oldest one has its buffer whenever a
// later one does, and it never waits for a buffer that a lane holds while
// waiting for the oldest to be offered. Only the oldest batch waits for a
// consumer's credit, and the consumer gives it back without needing a new
// batch first. A lane holds no lock while it waits for anything.
// It returns when the last batch was offered, and the time of that offer.
func (l *loader) lanes(ctx context.Context, decs []cropDecoder, outs []sink, batches <-chan []item, t0 time.Time) (time.Time, int, error) {
	// job is one batch and its turns: took and offered are closed once
	// the batch before it took its buffer and was offered; this batch
	// closes tookNext and offeredNext.
	type job struct {
		n                     uint64
		items                 []item
		took, offered         <-chan struct{}
		tookNext, offeredNext chan struct{}
	}
	cfg := l.cfg
	jobs := make(chan job)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		defer close(jobs)
		took, offered := make(chan struct{}), make(chan struct{})
		close(took)
		close(offered)
		for n := uint64(0); cfg.batches == 0 || n < cfg.batches; n++ {
			var items []item
			var ok bool
			select {
			case items, ok = <-batches:
			case <-gctx.Done():
				return nil
			}
			if !ok {
				return nil
			}
			j := job{n: n, items: items, took: took, offered: offered,
				tookNext: make(chan struct{}), offeredNext: make(chan struct{})}
			select {
			case jobs <- j:
			case <-gctx.Done():
				return nil
			}
			took, offered = j.tookNext, j.offeredNext
		}
		return nil
	})

	// What the offers count, under mu (lanes offer one at a time already;
	// the lock orders the counts for the return).
	var mu sync.Mutex
	end, epochs := t0, 0

	for i := range decs {
		dec, out := decs[i], outs[i]
		g.Go(func() error {
			for j := range jobs {
				select {
				case <-j.took:
				case <-gctx.Done():
					return nil
				}
				dst, err := out.take(gctx)
				if err != nil {
					return quiet(gctx, err)
				}
				close(j.tookNext)
				its := j.items
				ws, hs, xs, ys := make([]int, len(its)), make([]int, len(its)), make([]int, len(its)), make([]int, len(its))
				jpgs := make([][]byte, len(its))
				for k, it := range its {
					ws[k], hs[k], xs[k], ys[k], jpgs[k] = it.W, it.H, it.X, it.Y, it.JPEG
				}
				err = dec.DecodeCrop(jpgs, ws, hs, xs, ys, dst)
				var meta []byte
				if err == nil {
					meta, err = batchMeta(j.n, its, cfg.crop)
				}
				if err != nil {
					out.drop()
					return err
				}
				select {
				case <-j.offered:
				case <-gctx.Done():
					out.drop()
					return nil
				}
				if err := out.give(gctx, meta); err != nil {
					return quiet(gctx, err)
				}
				mu.Lock()
				l.rep.Batches++
				l.rep.Images += uint64(len(its))
				epochs = max(epochs, its[len(its)-1].Epoch+1)
				end = time.Now()
				mu.Unlock()
				close(j.offeredNext)
			}
			return nil
		})
	}
	err := g.Wait()
	mu.Lock()
	defer mu.Unlock()
	return end, epochs, err
}

// quiet: an error that comes of the run's end is no error.
func quiet(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return nil
	}
	return err
}
