package dataset

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

var tiny = Spec{Seed: 5, Images: 10, Classes: 3, MinW: 230, MaxW: 240, MinH: 226, MaxH: 230, Quality: 90, PerShard: 4}

// TestWriteIsReproducible: the same spec writes the same bytes (the data
// set is a function of the seed), in ceil(10/4) = 3 shards whose samples
// are every key once, each with the index's label and a JPEG of the size
// the spec gives it.
func TestWriteIsReproducible(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	ia, err := Write(context.Background(), a, tiny, 2)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Write(context.Background(), b, tiny, 1); err != nil {
		t.Fatal(err)
	}
	if len(ia.Shards) != 3 {
		t.Fatalf("%d shards, want 3", len(ia.Shards))
	}
	seen := map[int]bool{}
	for _, name := range append(ia.Shards, IndexFile) {
		x, _ := os.ReadFile(filepath.Join(a, name))
		y, _ := os.ReadFile(filepath.Join(b, name))
		if len(x) == 0 || !bytes.Equal(x, y) {
			t.Fatalf("%s differs between two writes of one spec (%d and %d bytes)", name, len(x), len(y))
		}
		if name == IndexFile {
			continue
		}
		ss, err := ReadShard(filepath.Join(a, name), ia)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range ss {
			w, h, err := Config(s.JPEG)
			if err != nil {
				t.Fatal(err)
			}
			if ww, wh := tiny.Size(s.Key); w != ww || h != wh || s.Label != tiny.Label(s.Key) || seen[s.Key] {
				t.Fatalf("key %d: %dx%d label %d (seen before: %v); the spec says %dx%d label %d", s.Key, w, h, s.Label, seen[s.Key], ww, wh, tiny.Label(s.Key))
			}
			seen[s.Key] = true
		}
	}
	if len(seen) != tiny.Images {
		t.Fatalf("%d keys in the shards, want %d", len(seen), tiny.Images)
	}
	idx, err := LoadIndex(a)
	if err != nil || idx.Images != tiny.Images || len(idx.Labels) != tiny.Images {
		t.Fatalf("LoadIndex: %+v, %v", idx, err)
	}
}

// TestReadShardRefusesWrongLabels: a shard whose .cls disagrees with the
// index, or with a member that is not NNNNNN.jpg or .cls, is ErrDataset.
func TestReadShardRefusesWrongLabels(t *testing.T) {
	dir := t.TempDir()
	idx, err := Write(context.Background(), dir, tiny, 0)
	if err != nil {
		t.Fatal(err)
	}
	bad := *idx
	bad.Labels = append([]int(nil), idx.Labels...)
	bad.Labels[0]++
	if _, err := ReadShard(filepath.Join(dir, idx.Shards[0]), &bad); !errors.Is(err, ErrDataset) {
		t.Fatalf("a label the index disagrees with: %v, want ErrDataset", err)
	}
	p := filepath.Join(dir, "odd.tar")
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "readme.txt", Mode: 0o644, Size: 1})
	tw.Write([]byte("x"))
	tw.Close()
	os.WriteFile(p, buf.Bytes(), 0o644)
	if _, err := ReadShard(p, idx); !errors.Is(err, ErrDataset) {
		t.Fatalf("a member readme.txt: %v, want ErrDataset", err)
	}
}

// TestDecodeCropIsTheImage: a crop of a decoded image is close to the
// same square of the image the JPEG encoded (quality 90: a mean error of a
// few levels), and a crop that does not fit is an error.
func TestDecodeCropIsTheImage(t *testing.T) {
	dir := t.TempDir()
	idx, err := Write(context.Background(), dir, tiny, 0)
	if err != nil {
		t.Fatal(err)
	}
	ss, err := ReadShard(filepath.Join(dir, idx.Shards[0]), idx)
	if err != nil {
		t.Fatal(err)
	}
	s := ss[0]
	img := tiny.Image(s.Key)
	const c = 224
	out := make([]byte, 3*c*c)
	if err := DecodeCrop(s.JPEG, 3, 2, c, out); err != nil {
		t.Fatal(err)
	}
	var sum int
	for y := 0; y < c; y++ {
		for x := 0; x < c; x++ {
			p := img.Pix[(y+2)*img.Stride+(x+3)*4:]
			for ch := 0; ch < 3; ch++ {
				d := int(out[ch*c*c+y*c+x]) - int(p[ch])
				sum += max(d, -d)
			}
		}
	}
	if mean := float64(sum) / float64(3*c*c); mean > 6 {
		t.Fatalf("mean abs difference %.2f between the crop and the image it encodes", mean)
	}
	w, _ := tiny.Size(s.Key)
	if err := DecodeCrop(s.JPEG, w-c+1, 0, c, out); !errors.Is(err, ErrDataset) {
		t.Fatalf("a crop past the right edge: %v, want ErrDataset", err)
	}
}
