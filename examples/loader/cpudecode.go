package main

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/seed743c36cf/cudashare/examples/internal/dataset"
)

// hostBatch is a batch decoded on the CPU into pix: B images, NCHW.
type hostBatch struct {
	items []item
	pix   []byte
	wg    sync.WaitGroup
	mu    sync.Mutex
	err   error
}

// cpuDecoder decodes with image/jpeg on worker goroutines, each image of a
// batch on its own worker, and hands the batches out in order.
type cpuDecoder struct {
	crop    int
	decodeN atomic.Int64 // nanoseconds spent decoding, all workers together
	// free takes back a batch's pixels once they are copied to the GPU.
	free chan []byte
}

func newCPUDecoder(crop, depth int) *cpuDecoder {
	return &cpuDecoder{crop: crop, free: make(chan []byte, depth+2)}
}

// done gives b's pixels back for a later batch.
func (c *cpuDecoder) done(b *hostBatch) {
	select {
	case c.free <- b.pix:
	default:
	}
}

// run decodes the batches from in and sends them, in order, to out, with
// at most depth batches decoding at once.
func (c *cpuDecoder) run(ctx context.Context, workers, depth int, in <-chan []item, out chan<- *hostBatch) {
	defer close(out)
	type job struct {
		b *hostBatch
		i int
	}
	jobs := make(chan job, workers*4)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				it := &j.b.items[j.i]
				sz := 3 * c.crop * c.crop
				t0 := time.Now()
				err := dataset.DecodeCrop(it.JPEG, it.X, it.Y, c.crop, j.b.pix[j.i*sz:(j.i+1)*sz])
				c.decodeN.Add(int64(time.Since(t0)))
				if err != nil {
					j.b.mu.Lock()
					if j.b.err == nil {
						j.b.err = err
					}
					j.b.mu.Unlock()
				}
				j.b.wg.Done()
			}
		}()
	}
	defer func() { close(jobs); wg.Wait() }()
	for items := range in {
		var pix []byte
		select {
		case pix = <-c.free:
		default:
			pix = make([]byte, len(items)*3*c.crop*c.crop)
		}
		b := &hostBatch{items: items, pix: pix}
		b.wg.Add(len(items))
		for i := range items {
			select {
			case jobs <- job{b, i}:
			case <-ctx.Done():
				b.wg.Add(i - len(items)) // the ones never queued
				return
			}
		}
		select {
		case out <- b:
		case <-ctx.Done():
			return
		}
	}
}
