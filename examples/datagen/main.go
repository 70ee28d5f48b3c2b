// Command datagen writes the labelled JPEG data set of the pipeline example
// (examples/loader, examples/python/train.py, bench/pipeline.sh):
// WebDataset-style tar shards of NNNNNN.jpg and NNNNNN.cls, and index.json
// (package examples/internal/dataset says what is in them). The images are a
// function of -seed alone, so the same command makes the same bytes
// anywhere.
//
//	go run ./examples/datagen -out /tmp/ds -images 20000
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/seed743c36cf/cudashare/examples/internal/dataset"
)

func main() {
	spec := dataset.DefaultSpec()
	out := flag.String("out", "", "directory to write the shards and index.json into (created)")
	flag.IntVar(&spec.Images, "images", spec.Images, "images in the data set")
	flag.IntVar(&spec.Classes, "classes", spec.Classes, "classes (labels 0 to classes-1)")
	flag.Uint64Var(&spec.Seed, "seed", spec.Seed, "seed: the same seed makes the same data set")
	flag.IntVar(&spec.PerShard, "per-shard", spec.PerShard, "images per tar shard")
	flag.IntVar(&spec.Quality, "quality", spec.Quality, "JPEG quality, 1 to 100")
	flag.IntVar(&spec.MinW, "min-width", spec.MinW, "smallest image width (at least the loader's crop, 224)")
	flag.IntVar(&spec.MaxW, "max-width", spec.MaxW, "largest image width")
	flag.IntVar(&spec.MinH, "min-height", spec.MinH, "smallest image height (at least the loader's crop, 224)")
	flag.IntVar(&spec.MaxH, "max-height", spec.MaxH, "largest image height")
	workers := flag.Int("workers", 0, "goroutines encoding images (0: GOMAXPROCS)")
	flag.Parse()
	if *out == "" {
		fmt.Fprintln(os.Stderr, "datagen: -out DIR is required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	t0 := time.Now()
	idx, err := dataset.Write(ctx, *out, spec, *workers)
	if err != nil {
		fmt.Fprintf(os.Stderr, "datagen: %v\n", err)
		os.Exit(1)
	}
	d := time.Since(t0)
	json.NewEncoder(os.Stdout).Encode(map[string]any{
		"role": "datagen", "dir": *out, "images": idx.Images, "classes": idx.Classes, "shards": len(idx.Shards),
		"bytes": idx.Bytes, "mean_jpeg_bytes": idx.Bytes / int64(idx.Images),
		"seconds": d.Seconds(), "images_per_s": float64(idx.Images) / d.Seconds(),
	})
}
