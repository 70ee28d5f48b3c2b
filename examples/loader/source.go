package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"

	"github.com/seed743c36cf/cudashare/examples/internal/dataset"
)

// item is one image of a batch with where it is cropped.
type item struct {
	dataset.Sample
	Epoch      int
	W, H, X, Y int
}

// source reads the shards epoch after epoch, in an order drawn from the
// seed and the epoch (shards shuffled, then the samples of each shard, as
// WebDataset loaders do), and sends batches of n items until ctx ends.
// Each item's crop offset comes from dataset.CropOffset, so that a check
// can redo it. A batch may span two epochs.
func source(ctx context.Context, dir string, idx *dataset.Index, seed uint64, n, crop int, out chan<- []item) error {
	defer close(out)
	batch := make([]item, 0, n)
	for epoch := 0; ; epoch++ {
		r := rand.New(rand.NewPCG(seed, uint64(epoch)))
		order := r.Perm(len(idx.Shards))
		for _, si := range order {
			samples, err := dataset.ReadShard(filepath.Join(dir, idx.Shards[si]), idx)
			if err != nil {
				return err
			}
			r.Shuffle(len(samples), func(i, j int) { samples[i], samples[j] = samples[j], samples[i] })
			for _, s := range samples {
				w, h, err := dataset.Config(s.JPEG)
				if err != nil {
					return fmt.Errorf("key %d: %w", s.Key, err)
				}
				if w < crop || h < crop {
					return fmt.Errorf("key %d: %dx%d is smaller than the crop %d", s.Key, w, h, crop)
				}
				x, y := dataset.CropOffset(seed, epoch, s.Key, w, h, crop)
				batch = append(batch, item{Sample: s, Epoch: epoch, W: w, H: h, X: x, Y: y})
				if len(batch) == n {
					select {
					case out <- batch:
					case <-ctx.Done():
						return nil
					}
					batch = make([]item, 0, n)
				}
			}
		}
	}
}
