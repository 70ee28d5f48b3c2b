package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/examples/internal/dataset"
	"github.com/seed743c36cf/cudashare/share"
)

// envChild makes the test binary the loader: its value is the loader's
// arguments, as a JSON array.
const envChild = "CUDASHARE_LOADER_TEST_ARGS"

func TestMain(m *testing.M) {
	if a := os.Getenv(envChild); a != "" {
		var args []string
		if err := json.Unmarshal([]byte(a), &args); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		os.Exit(run(context.Background(), args, os.Stdout, os.Stderr))
	}
	dir, err := os.MkdirTemp("", "cudashare-loader-sim-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// The simulator's state is shared by this process and the loader's.
	os.Setenv("CUDASHARE_SIM_DIR", dir)
	os.Setenv("CUDASHARE_DRIVER", "sim")
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

const (
	testImages = 64
	testBatch  = 16
	testCrop   = 224
	testSeed   = 7
)

// smallSet writes a data set of 64 small images (just larger than the crop,
// so that it takes a fraction of a second) in two shards.
func smallSet(t *testing.T) (string, *dataset.Index) {
	t.Helper()
	dir := t.TempDir()
	spec := dataset.Spec{Seed: 3, Images: testImages, Classes: 10, MinW: 230, MaxW: 260, MinH: 226, MaxH: 240, Quality: 90, PerShard: 32}
	idx, err := dataset.Write(context.Background(), dir, spec, 0)
	if err != nil {
		t.Fatal(err)
	}
	return dir, idx
}

// startLoader runs the loader in a child process and returns a function
// that waits for it and returns its report.
func startLoader(t *testing.T, args ...string) (func() Report, *bytes.Buffer) {
	t.Helper()
	a, _ := json.Marshal(args)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"="+string(a))
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatal(err)
	}
	return func() Report {
		defer cancel()
		err := cmd.Wait()
		var rep Report
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		if jerr := json.Unmarshal([]byte(lines[len(lines)-1]), &rep); jerr != nil {
			t.Fatalf("loader's report: %v\nstdout: %s\nstderr: %s", jerr, out.String(), errb.String())
		}
		if err != nil {
			t.Fatalf("loader: %v\nreport: %+v\nstderr: %s", err, rep, errb.String())
		}
		return rep
	}, &errb
}

// expected is the crop the loader must have sent for key at (x, y): the
// data set's JPEG decoded with image/jpeg here.
type expected struct {
	dir string
	idx *dataset.Index
	jpg map[int][]byte
}

func newExpected(t *testing.T, dir string, idx *dataset.Index) *expected {
	e := &expected{dir: dir, idx: idx, jpg: map[int][]byte{}}
	for _, name := range idx.Shards {
		s, err := dataset.ReadShard(filepath.Join(dir, name), idx)
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range s {
			e.jpg[x.Key] = x.JPEG
		}
	}
	return e
}

// crop checks that (x, y) is the crop offset the seed gives key in epoch,
// and returns the data set's crop there.
func (e *expected) crop(key, epoch, x, y int) ([]byte, error) {
	jpg, ok := e.jpg[key]
	if !ok {
		return nil, fmt.Errorf("key %d is not in the data set", key)
	}
	w, h, err := dataset.Config(jpg)
	if err != nil {
		return nil, err
	}
	if wx, wy := dataset.CropOffset(testSeed, epoch, key, w, h, testCrop); wx != x || wy != y {
		return nil, fmt.Errorf("key %d, epoch %d: crop at (%d,%d), the seed says (%d,%d)", key, epoch, x, y, wx, wy)
	}
	want := make([]byte, 3*testCrop*testCrop)
	if err := dataset.DecodeCrop(jpg, x, y, testCrop, want); err != nil {
		return nil, err
	}
	return want, nil
}

// check checks one image of a batch: its crop offset is the one the seed
// gives, and its pixels are the data set's at that offset.
func (e *expected) check(key, epoch, x, y int, pix []byte) error {
	want, err := e.crop(key, epoch, x, y)
	if err != nil {
		return err
	}
	if !bytes.Equal(pix, want) {
		n := 0
		for i := range want {
			if i >= len(pix) || pix[i] != want[i] {
				n++
			}
		}
		return fmt.Errorf("key %d: %d of %d bytes differ from the data set's crop at (%d,%d)", key, n, len(want), x, y)
	}
	return nil
}

type batchMetaT struct {
	DType  string   `msgpack:"dtype"`
	Shape  []uint64 `msgpack:"shape"`
	Batch  uint64   `msgpack:"batch"`
	Epoch  int      `msgpack:"epoch"`
	Labels []int    `msgpack:"labels"`
	Keys   []int    `msgpack:"keys"`
	Crops  []int    `msgpack:"crops"`
}

// TestLoaderFeedsGoConsumer: the whole pipeline on the simulator with CPU
// decode: the loader reads the shards, crops, and lends 8 batches (two
// epochs); a Go consumer gets every one, in order, with uint8 NCHW dtype
// and shape, every label the index's, every crop offset the seed's, and
// every pixel the data set's image decoded here and cropped there; each
// epoch covers the data set once. The loader then reports what it sent.
func TestLoaderFeedsGoConsumer(t *testing.T) {
	dir, idx := smallSet(t)
	exp := newExpected(t, dir, idx)
	sock := sockPath(t)
	const batches = 2 * testImages / testBatch
	wait, lerr := startLoader(t, "-data", dir, "-socket", sock, "-driver", "sim", "-batch", fmt.Sprint(testBatch),
		"-batches", fmt.Sprint(batches), "-seed", fmt.Sprint(testSeed), "-ring", "3", "-wait", "30s")

	d, err := driver.Open(driver.Config{Backend: "sim"})
	if err != nil {
		t.Fatal(err)
	}
	dev, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	dctx, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	defer dctx.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var im *share.Importer
	for {
		im, err = share.Dial(ctx, sock, dctx, share.ImporterConfig{Credits: 2})
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("dial the loader: %v; its stderr: %s", err, lerr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer im.Close()

	seen := map[[2]int]int{} // (epoch, key) -> times
	n := 0
	for {
		l, err := im.Next(ctx)
		if err != nil {
			if errors.Is(err, share.ErrClosed) || errors.Is(err, share.ErrProducerGone) {
				break
			}
			t.Fatalf("batch %d: %v", n, err)
		}
		var m batchMetaT
		if err := l.DecodeMeta(&m); err != nil {
			t.Fatal(err)
		}
		want := []uint64{testBatch, 3, testCrop, testCrop}
		if m.DType != "uint8" || fmt.Sprint(m.Shape) != fmt.Sprint(want) || m.Batch != uint64(n) {
			t.Fatalf("batch %d: dtype %q shape %v batch %d; want uint8 %v %d", n, m.DType, m.Shape, m.Batch, want, n)
		}
		if len(m.Labels) != testBatch || len(m.Keys) != testBatch || len(m.Crops) != 2*testBatch {
			t.Fatalf("batch %d: %d labels, %d keys, %d crop values", n, len(m.Labels), len(m.Keys), len(m.Crops))
		}
		pix := make([]byte, l.Size())
		if _, err := l.CopyToHost(pix); err != nil {
			t.Fatal(err)
		}
		sz := 3 * testCrop * testCrop
		for i, key := range m.Keys {
			if key < 0 || key >= idx.Images || m.Labels[i] != idx.Labels[key] {
				t.Fatalf("batch %d image %d: key %d label %d; the index says %v", n, i, key, m.Labels[i], idx.Labels[max(0, min(key, idx.Images-1))])
			}
			if err := exp.check(key, m.Epoch, m.Crops[2*i], m.Crops[2*i+1], pix[i*sz:(i+1)*sz]); err != nil {
				t.Fatalf("batch %d image %d: %v", n, i, err)
			}
			seen[[2]int{m.Epoch, key}]++
		}
		l.Release()
		n++
	}
	rep := wait()
	if n != batches {
		t.Fatalf("got %d batches, the loader was to send %d", n, batches)
	}
	for e := 0; e < 2; e++ {
		for k := 0; k < testImages; k++ {
			if seen[[2]int{e, k}] != 1 {
				t.Fatalf("epoch %d: key %d came %d times, not once", e, k, seen[[2]int{e, k}])
			}
		}
	}
	if rep.Decode != "cpu" || rep.Driver != "sim" || rep.Batches != batches || rep.Images != batches*testBatch || rep.End != "batches" || rep.Epochs != 2 {
		t.Fatalf("loader's report: %+v", rep)
	}
	if rep.CPUS <= 0 || rep.DecodeS <= 0 || rep.ImagesPerS <= 0 {
		t.Fatalf("the report lacks CPU, decode time or rate: %+v", rep)
	}
}

// TestLoaderAloneDecodeRate: with -consumers 0 the loader decodes and
// crops with no consumer, and reports it.
func TestLoaderAloneDecodeRate(t *testing.T) {
	dir, _ := smallSet(t)
	wait, _ := startLoader(t, "-data", dir, "-driver", "sim", "-consumers", "0", "-batch", "8", "-batches", "4")
	rep := wait()
	if rep.Batches != 4 || rep.Images != 32 || rep.Consumers != 0 || rep.End != "batches" || rep.DecodeS <= 0 {
		t.Fatalf("loader's report: %+v", rep)
	}
}

// TestSelfcheckNeedsGPU: -selfcheck says FAIL, and why, without a GPU
// (on the GPU machine it is run there instead, by bench/pipeline.sh).
func TestSelfcheckNeedsGPU(t *testing.T) {
	dir, _ := smallSet(t)
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"-data", dir, "-driver", "sim", "-selfcheck", "4"}, &out, &errb)
	if code != 1 || !strings.Contains(out.String(), "selfcheck: FAIL: the sim driver: nvJPEG needs a GPU") {
		t.Fatalf("exit %d, stdout %q", code, out.String())
	}
}

// sockPath is a socket path in a directory of mode 0700, as the transport
// requires.
func sockPath(t *testing.T) string {
	d := t.TempDir()
	if err := os.Chmod(d, 0o700); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(d, "loader.sock")
}

// readLines is the JSON lines of r.
func readLines(t *testing.T, b []byte) []map[string]any {
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

// TestLoaderFeedsPythonConsumer: the same pipeline to the Python consumer
// (examples/python/batchcheck.py, plain Python and msgpack: no torch or
// Pillow here) over VMM, the sharing the simulator lets Python read. The
// script checks shapes and labels against index.json and prints each
// image's SHA-256 with its key and crop offset; every one must be that of
// the data set's JPEG decoded here and cropped there, and every image of
// both epochs must come once.
func TestLoaderFeedsPythonConsumer(t *testing.T) {
	py := "/usr/bin/python3"
	if exec.Command(py, "-c", "import msgpack").Run() != nil {
		t.Skip("no /usr/bin/python3 with msgpack (Debian: python3-msgpack): the Python consumer's check did not run")
	}
	dir, idx := smallSet(t)
	exp := newExpected(t, dir, idx)
	sock := sockPath(t)
	const batches = 2 * testImages / testBatch
	wait, _ := startLoader(t, "-data", dir, "-socket", sock, "-driver", "sim", "-sharing", "vmm", "-batch", fmt.Sprint(testBatch),
		"-batches", fmt.Sprint(batches), "-seed", fmt.Sprint(testSeed), "-ring", "3", "-wait", "30s")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, "../python/batchcheck.py", "--socket", sock, "--data", dir, "--backend", "sim")
	cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1")
	var errb bytes.Buffer
	cmd.Stderr = &errb
	out, err := cmd.Output()
	rep := wait()
	if err != nil {
		t.Fatalf("batchcheck.py: %v\nstdout: %s\nstderr: %s", err, out, errb.String())
	}
	lines := readLines(t, out)
	if len(lines) == 0 {
		t.Fatalf("batchcheck.py printed nothing: %s", errb.String())
	}
	sum := lines[len(lines)-1]
	if sum["role"] != "batchcheck" || sum["batches"] != float64(batches) || sum["images"] != float64(batches*testBatch) || len(sum["errors"].([]any)) != 0 {
		t.Fatalf("batchcheck.py's summary: %v", sum)
	}
	seen := map[[2]int]int{}
	for _, l := range lines[:len(lines)-1] {
		key, epoch, x, y := int(l["key"].(float64)), int(l["epoch"].(float64)), int(l["x"].(float64)), int(l["y"].(float64))
		want, err := exp.crop(key, epoch, x, y)
		if err != nil {
			t.Fatal(err)
		}
		h := sha256.Sum256(want)
		if got := l["sha256"]; got != hex.EncodeToString(h[:]) {
			t.Fatalf("key %d at (%d,%d): Python got bytes with SHA-256 %v, the data set's crop has %x", key, x, y, got, h)
		}
		seen[[2]int{epoch, key}]++
	}
	for e := 0; e < 2; e++ {
		for k := 0; k < testImages; k++ {
			if seen[[2]int{e, k}] != 1 {
				t.Fatalf("epoch %d: key %d came %d times, not once", e, k, seen[[2]int{e, k}])
			}
		}
	}
	if rep.Batches != batches || rep.Sharing != "vmm" {
		t.Fatalf("loader's report: %+v", rep)
	}
}
