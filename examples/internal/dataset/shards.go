package dataset

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"image/jpeg"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sync/errgroup"
)

// IndexFile is the name of the index in a data set's directory.
const IndexFile = "index.json"

// Index describes a data set: index.json.
type Index struct {
	Images  int      `json:"images"`
	Classes int      `json:"classes"`
	Seed    uint64   `json:"seed"`
	Quality int      `json:"quality"`
	Shards  []string `json:"shards"` // file names, in key order
	// Labels[key] is key's class.
	Labels []int `json:"labels"`
	// Bytes is the size of all the JPEGs together.
	Bytes int64 `json:"bytes"`
}

// ErrDataset: a data set that cannot be read as one (a missing index, a
// shard member that is not NNNNNN.jpg or NNNNNN.cls, a label that
// disagrees with the index).
var ErrDataset = errors.New("dataset")

// ShardName is the file name of shard i.
func ShardName(i int) string { return fmt.Sprintf("shard-%06d.tar", i) }

// Write generates spec's data set into dir, encoding on workers
// goroutines (0: GOMAXPROCS), and returns its index.
func Write(ctx context.Context, dir string, spec Spec, workers int) (*Index, error) {
	if spec.Images < 1 || spec.Classes < 1 || spec.PerShard < 1 || spec.MinW > spec.MaxW || spec.MinH > spec.MaxH || spec.MinW < 1 || spec.MinH < 1 {
		return nil, fmt.Errorf("%w: bad spec %+v", ErrDataset, spec)
	}
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	idx := &Index{Images: spec.Images, Classes: spec.Classes, Seed: spec.Seed, Quality: spec.Quality, Labels: make([]int, spec.Images)}
	for first := 0; first < spec.Images; first += spec.PerShard {
		n := min(spec.PerShard, spec.Images-first)
		jpgs := make([][]byte, n)
		g, gctx := errgroup.WithContext(ctx)
		g.SetLimit(workers)
		for i := 0; i < n; i++ {
			key := first + i
			g.Go(func() error {
				if err := gctx.Err(); err != nil {
					return err
				}
				var b bytes.Buffer
				if err := jpeg.Encode(&b, spec.Image(key), &jpeg.Options{Quality: spec.Quality}); err != nil {
					return fmt.Errorf("encode image %d: %w", key, err)
				}
				jpgs[i] = b.Bytes()
				return nil
			})
		}
		if err := g.Wait(); err != nil {
			return nil, err
		}
		name := ShardName(len(idx.Shards))
		if err := writeShard(filepath.Join(dir, name), first, jpgs, spec, idx); err != nil {
			return nil, err
		}
		idx.Shards = append(idx.Shards, name)
	}
	b, err := json.Marshal(idx)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, IndexFile), append(b, '\n'), 0o644); err != nil {
		return nil, err
	}
	return idx, nil
}

func writeShard(path string, first int, jpgs [][]byte, spec Spec, idx *Index) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	put := func(name string, b []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), Typeflag: tar.TypeReg, Format: tar.FormatUSTAR}); err != nil {
			return err
		}
		_, err := tw.Write(b)
		return err
	}
	for i, j := range jpgs {
		key := first + i
		label := spec.Label(key)
		idx.Labels[key] = label
		idx.Bytes += int64(len(j))
		if err := put(fmt.Sprintf("%06d.jpg", key), j); err != nil {
			f.Close()
			return err
		}
		if err := put(fmt.Sprintf("%06d.cls", key), []byte(strconv.Itoa(label))); err != nil {
			f.Close()
			return err
		}
	}
	if err := tw.Close(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// LoadIndex reads dir's index.json.
func LoadIndex(dir string) (*Index, error) {
	b, err := os.ReadFile(filepath.Join(dir, IndexFile))
	if err != nil {
		return nil, fmt.Errorf("%w: %v (make one with examples/datagen)", ErrDataset, err)
	}
	var idx Index
	if err := json.Unmarshal(b, &idx); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrDataset, IndexFile, err)
	}
	if idx.Images != len(idx.Labels) || len(idx.Shards) == 0 {
		return nil, fmt.Errorf("%w: %s: %d images but %d labels and %d shards", ErrDataset, IndexFile, idx.Images, len(idx.Labels), len(idx.Shards))
	}
	return &idx, nil
}

// Sample is one image of a shard.
type Sample struct {
	Key   int
	Label int
	JPEG  []byte
}

// ReadShard reads every sample of a shard, in the shard's order, and
// checks each label against the index.
func ReadShard(path string, idx *Index) ([]Sample, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	var out []Sample
	byKey := map[int]int{}
	at := func(key int) *Sample {
		i, ok := byKey[key]
		if !ok {
			i = len(out)
			byKey[key] = i
			out = append(out, Sample{Key: key, Label: -1})
		}
		return &out[i]
	}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrDataset, path, err)
		}
		stem, ext, _ := strings.Cut(h.Name, ".")
		key, err := strconv.Atoi(stem)
		if err != nil || key < 0 || (idx != nil && key >= idx.Images) {
			return nil, fmt.Errorf("%w: %s: member %q is not NNNNNN.jpg or NNNNNN.cls of a key in the index", ErrDataset, path, h.Name)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %s: %v", ErrDataset, path, h.Name, err)
		}
		s := at(key)
		switch ext {
		case "jpg":
			s.JPEG = b
		case "cls":
			l, err := strconv.Atoi(strings.TrimSpace(string(b)))
			if err != nil {
				return nil, fmt.Errorf("%w: %s: %s: %v", ErrDataset, path, h.Name, err)
			}
			s.Label = l
		default:
			return nil, fmt.Errorf("%w: %s: member %q: unknown extension", ErrDataset, path, h.Name)
		}
	}
	for _, s := range out {
		if s.JPEG == nil || s.Label < 0 {
			return nil, fmt.Errorf("%w: %s: key %d lacks its .jpg or its .cls", ErrDataset, path, s.Key)
		}
		if idx != nil && idx.Labels[s.Key] != s.Label {
			return nil, fmt.Errorf("%w: %s: key %d has label %d, the index %d", ErrDataset, path, s.Key, s.Label, idx.Labels[s.Key])
		}
	}
	return out, nil
}
