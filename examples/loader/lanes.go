package main

import (
	"context"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/seed743c36cf/cudashare/examples/internal/gpudecode"
)

// lanes decodes on the GPU with one goroutine per decoder (a lane: its
// own nvJPEG state, stream, staging and ring buffer), so that several
// batches are queued at once: a decode call that waits on the host for the
// GPU (nvJPEG's batched decode has host phases) holds up its lane only,
// and the loader's context has work queued whenever the GPU turns to it.
// Without MPS the trainer's context and the loader's take turns on the
// GPU, and an empty queue when the loader's turn comes is a turn lost.
// Batches are still offered in the source's order: a lane that finishes
// early waits for its turn to offer (its GPU work is queued meanwhile).
// It returns when the last batch was offered, and the time of that offer.
func (l *loader) lanes(ctx context.Context, gpu []*gpudecode.Decoder, outs []sink, batches <-chan []item, t0 time.Time) (time.Time, int, error) {
	type job struct {
		n     uint64
		items []item
	}
	cfg := l.cfg
	jobs := make(chan job)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		defer close(jobs)
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
			select {
			case jobs <- job{n, items}:
			case <-gctx.Done():
				return nil
			}
		}
		return nil
	})

	// The turn to offer: batch next is offered next.
	var mu sync.Mutex
	turn := sync.NewCond(&mu)
	var next uint64
	end, epochs := t0, 0
	stop := context.AfterFunc(gctx, func() {
		mu.Lock()
		defer mu.Unlock()
		turn.Broadcast()
	})
	defer stop()

	for i := range gpu {
		dec, out := gpu[i], outs[i]
		g.Go(func() error {
			for j := range jobs {
				dst, err := out.take(gctx)
				if err != nil {
					return quiet(gctx, err)
				}
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
				mu.Lock()
				for next != j.n && gctx.Err() == nil {
					turn.Wait()
				}
				if gctx.Err() != nil {
					mu.Unlock()
					out.drop()
					return nil
				}
				err = out.give(gctx, meta)
				if err == nil {
					next++
					l.rep.Batches++
					l.rep.Images += uint64(len(its))
					epochs = max(epochs, its[len(its)-1].Epoch+1)
					end = time.Now()
					turn.Broadcast()
				}
				mu.Unlock()
				if err != nil {
					return quiet(gctx, err)
				}
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
