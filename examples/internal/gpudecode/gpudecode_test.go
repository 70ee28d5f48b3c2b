package gpudecode

import (
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/seed743c36cf/cudashare/driver"
)

// The tests here need no GPU: they load testdata/fakenvjpeg.c, built with
// gcc into a fake libnvjpeg and libcuda whose types are nvjpeg.h's and
// cuda.h's, so that the binding's struct layouts, argument orders and the
// crop arithmetic are checked against what C compiles. On the GPU machine,
// `loader -selfcheck` checks the real library.

const (
	kNoHW = iota
	kHWUnsupported
	kLastBackend
	kBatch
	kFormat
	kCurCtx
	kLastStream
	kCopies
	kDecodes
	kNoROI
	kROIFail
	kROIDecodes
	kParamsLive
)

type fake struct {
	path     string
	set, get func(k int, v int64) int64
	mem      [][]byte // "device" memory: Go memory the fake writes, kept alive here
}

func buildFake(t *testing.T) *fake {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("gcc not in PATH: cannot build testdata/fakenvjpeg.c, the fake nvJPEG this test loads")
	}
	out := filepath.Join(t.TempDir(), "libfakenvjpeg.so")
	if b, err := exec.Command(gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-Bsymbolic", "-o", out, "testdata/fakenvjpeg.c").CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, b)
	}
	h, err := purego.Dlopen(out, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Fatal(err)
	}
	f := &fake{path: out}
	setp, _ := purego.Dlsym(h, "fake_set")
	getp, _ := purego.Dlsym(h, "fake_get")
	f.set = func(k int, v int64) int64 { purego.SyscallN(setp, uintptr(k), uintptr(v)); return 0 }
	f.get = func(k int, _ int64) int64 { r, _, _ := purego.SyscallN(getp, uintptr(k)); return int64(r) }
	return f
}

func (f *fake) open(t *testing.T, backends []Backend, place Place) *Decoder {
	t.Helper()
	lib, err := loadNvjpeg(f.path)
	if err != nil {
		t.Fatal(err)
	}
	cu, err := loadCUDA(f.path)
	if err != nil {
		t.Fatal(err)
	}
	alloc := func(n uint64) (uint64, error) {
		b := make([]byte, n)
		f.mem = append(f.mem, b)
		return uint64(uintptr(unsafe.Pointer(&b[0]))), nil
	}
	d, err := open(cu, lib, 0xc7c7, 0x5e5e, alloc, func(uint64) error { return nil }, Config{Backends: backends, Crop: 4, Place: place})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// jpeg is a fake JPEG: width, height, seed.
func jpeg(w, h int, seed byte) []byte {
	return []byte{byte(w), byte(w >> 8), byte(h), byte(h >> 8), seed, 0xff}
}

// TestDecodeCropLayout: three images of different sizes, decoded in one
// batch into planar RGB and cropped 4x4 at their own offsets, land at
// dst + i*3*16, plane after plane, each pixel the one the fake decoder
// wrote at (x+X, y+Y): nvjpegImage_t's channels and pitches, the batch's
// pointer and length arrays, and CUDA_MEMCPY2D are laid out as C has them.
// The decode and the copies ran on the decoder's stream with its context
// current, after nvjpegDecodeBatchedInitialize for a batch of 3 with
// NVJPEG_OUTPUT_RGB.
func TestDecodeCropLayout(t *testing.T) {
	f := buildFake(t)
	d := f.open(t, []Backend{BackendHardware, BackendGPUHybrid}, PlaceCopy)
	if b, why := d.Backend(); b != BackendHardware || len(why) != 0 {
		t.Fatalf("backend %v (%v), want hardware", b, why)
	}
	if w, h, err := d.Info(jpeg(300, 257, 1)); err != nil || w != 300 || h != 257 {
		t.Fatalf("Info: %dx%d, %v", w, h, err)
	}
	jp := [][]byte{jpeg(9, 7, 10), jpeg(5, 12, 77), jpeg(20, 4, 200)}
	ws, hs := []int{9, 5, 20}, []int{7, 12, 4}
	xs, ys := []int{5, 1, 16}, []int{3, 8, 0}
	dst := make([]byte, 3*3*16+7)
	for i := range dst {
		dst[i] = 0xee
	}
	if err := d.DecodeCrop(jp, ws, hs, xs, ys, uint64ToPtr(&dst[0])); err != nil {
		t.Fatal(err)
	}
	for i := range jp {
		for c := 0; c < 3; c++ {
			for y := 0; y < 4; y++ {
				for x := 0; x < 4; x++ {
					want := byte(int(jp[i][4]) + 50*c + 3*(y+ys[i]) + (x + xs[i]))
					if got := dst[i*48+c*16+y*4+x]; got != want {
						t.Fatalf("image %d plane %d (%d,%d): %d, want %d", i, c, x, y, got, want)
					}
				}
			}
		}
	}
	for _, b := range dst[3*48:] {
		if b != 0xee {
			t.Fatal("DecodeCrop wrote past the batch")
		}
	}
	if f.get(kBatch, 0) != 3 || f.get(kFormat, 0) != 3 || f.get(kCurCtx, 0) != 0xc7c7 || f.get(kLastStream, 0) != 0x5e5e || f.get(kCopies, 0) != 9 {
		t.Fatalf("batch %d format %d context %#x stream %#x copies %d", f.get(kBatch, 0), f.get(kFormat, 0), f.get(kCurCtx, 0), f.get(kLastStream, 0), f.get(kCopies, 0))
	}
	// A second, smaller batch initializes again; a crop that does not fit
	// is refused before any call.
	if err := d.DecodeCrop(jp[:1], ws[:1], hs[:1], xs[:1], ys[:1], uint64ToPtr(&dst[0])); err != nil || f.get(kBatch, 0) != 1 {
		t.Fatalf("a batch of 1: %v, initialized for %d", err, f.get(kBatch, 0))
	}
	if err := d.DecodeCrop(jp[:1], ws[:1], hs[:1], []int{6}, ys[:1], uint64ToPtr(&dst[0])); err == nil || !strings.Contains(err.Error(), "does not fit") {
		t.Fatalf("a crop past the edge: %v", err)
	}
	if _, n, b := d.DecodeTime(); n != 4 || b != 2 {
		t.Fatalf("DecodeTime counts %d images in %d batches, want 4 in 2", n, b)
	}
}

// TestBackendFallback: without the hardware backend (nvjpegCreateEx says
// NVJPEG_STATUS_ARCH_MISMATCH) the decoder takes gpu-hybrid and says why;
// with it but a JPEG it does not take, it moves to gpu-hybrid on the first
// batch and decodes that batch there.
func TestBackendFallback(t *testing.T) {
	f := buildFake(t)
	f.set(kNoHW, 1)
	d := f.open(t, []Backend{BackendHardware, BackendGPUHybrid}, PlaceAuto)
	b, why := d.Backend()
	if b != BackendGPUHybrid || len(why) != 1 || !strings.Contains(why[0], "NVJPEG_STATUS_ARCH_MISMATCH") {
		t.Fatalf("backend %v, why %v", b, why)
	}
	f.set(kNoHW, 0)
	f.set(kHWUnsupported, 1)
	d = f.open(t, []Backend{BackendHardware, BackendGPUHybrid}, PlaceAuto)
	dst := make([]byte, 48)
	if err := d.DecodeCrop([][]byte{jpeg(4, 4, 1)}, []int{4}, []int{4}, []int{0}, []int{0}, uint64ToPtr(&dst[0])); err != nil {
		t.Fatal(err)
	}
	if b, why := d.Backend(); b != BackendGPUHybrid || len(why) != 1 || f.get(kLastBackend, 0) != int64(BackendGPUHybrid) || dst[47] != byte(1+100+9+3) {
		t.Fatalf("backend %v, why %v, last created %d, last byte %d", b, why, f.get(kLastBackend, 0), dst[47])
	}
	if p, why := d.Place(); p != PlaceCopy || why == "" || f.get(kROIDecodes, 0) != 0 {
		t.Fatalf("gpu-hybrid placed crops by %v (%q), %d ROI decodes: the ROI decode is the hardware's", p, why, f.get(kROIDecodes, 0))
	}
	f.set(kNoHW, 1)
	lib, _ := loadNvjpeg(f.path)
	cu, _ := loadCUDA(f.path)
	if _, err := open(cu, lib, 1, 1, nil, nil, Config{Backends: []Backend{BackendHardware}, Crop: 4}); !errors.Is(err, ErrNvjpeg) {
		t.Fatalf("hardware only, without hardware: %v, want ErrNvjpeg", err)
	}
}

// TestDecodeCropROI: where the library has nvjpegDecodeBatchedEx and it
// takes a region, each image's crop is decoded straight into its place
// (the same bytes as TestDecodeCropLayout's copies give), with one decode
// parameters object per image, in one call on the decoder's stream, and no
// copy at all; past the batch nothing is written. Close destroys every
// parameters object.
func TestDecodeCropROI(t *testing.T) {
	f := buildFake(t)
	d := f.open(t, []Backend{BackendHardware, BackendGPUHybrid}, PlaceAuto)
	jp := [][]byte{jpeg(9, 7, 10), jpeg(5, 12, 77), jpeg(20, 4, 200)}
	ws, hs := []int{9, 5, 20}, []int{7, 12, 4}
	xs, ys := []int{5, 1, 16}, []int{3, 8, 0}
	for round := 0; round < 2; round++ {
		dst := make([]byte, 3*3*16+7)
		for i := range dst {
			dst[i] = 0xee
		}
		if err := d.DecodeCrop(jp, ws, hs, xs, ys, uint64ToPtr(&dst[0])); err != nil {
			t.Fatal(err)
		}
		checkCrops(t, dst, jp, xs, ys)
		xs[0], ys[1] = 0, 0 // other regions the second time
	}
	if p, why := d.Place(); p != PlaceROI || why != "" {
		t.Fatalf("placed by %v (%q), want roi", p, why)
	}
	if f.get(kROIDecodes, 0) != 2 || f.get(kCopies, 0) != 0 || f.get(kDecodes, 0) != 0 || f.get(kLastStream, 0) != 0x5e5e || f.get(kParamsLive, 0) != 3 {
		t.Fatalf("%d ROI decodes, %d copies, %d whole decodes, stream %#x, %d parameters", f.get(kROIDecodes, 0), f.get(kCopies, 0), f.get(kDecodes, 0), f.get(kLastStream, 0), f.get(kParamsLive, 0))
	}
	d.Close()
	if n := f.get(kParamsLive, 0); n != 0 {
		t.Fatalf("%d decode parameters left after Close", n)
	}
}

// TestROIFallback: where nvjpegDecodeBatchedSupportedEx says no, or the
// first ROI batch fails, crops are copied (and the decoder says why), the
// first batch's pixels right either way; -place roi fails instead, and
// -place copy never asks.
func TestROIFallback(t *testing.T) {
	f := buildFake(t)
	jp := [][]byte{jpeg(9, 7, 10), jpeg(5, 12, 77)}
	ws, hs, xs, ys := []int{9, 5}, []int{7, 12}, []int{5, 1}, []int{3, 8}
	for _, knob := range []int{kNoROI, kROIFail} {
		f.set(knob, 1)
		d := f.open(t, []Backend{BackendHardware}, PlaceAuto)
		dst := make([]byte, 2*48)
		if err := d.DecodeCrop(jp, ws, hs, xs, ys, uint64ToPtr(&dst[0])); err != nil {
			t.Fatal(err)
		}
		checkCrops(t, dst, jp, xs, ys)
		if p, why := d.Place(); p != PlaceCopy || why == "" {
			t.Fatalf("knob %d: placed by %v (%q), want copy with a reason", knob, p, why)
		}
		d = f.open(t, []Backend{BackendHardware}, PlaceROI)
		if err := d.DecodeCrop(jp, ws, hs, xs, ys, uint64ToPtr(&dst[0])); err == nil {
			t.Fatalf("knob %d: -place roi did not fail", knob)
		}
		f.set(knob, 0)
	}
	before := f.get(kROIDecodes, 0)
	d := f.open(t, []Backend{BackendHardware}, PlaceCopy)
	dst := make([]byte, 2*48)
	if err := d.DecodeCrop(jp, ws, hs, xs, ys, uint64ToPtr(&dst[0])); err != nil {
		t.Fatal(err)
	}
	checkCrops(t, dst, jp, xs, ys)
	if p, _ := d.Place(); p != PlaceCopy || f.get(kROIDecodes, 0) != before {
		t.Fatalf("-place copy placed by %v", p)
	}
	if _, err := ParsePlace("inplace"); err == nil {
		t.Fatal("ParsePlace(inplace) did not fail")
	}
}

// checkCrops: image i's 4x4 crop at (xs[i], ys[i]) is at dst + i*48, plane
// after plane, as the fake decoder draws it, and nothing past the batch
// changed from 0xee (where dst has room past it).
func checkCrops(t *testing.T, dst []byte, jp [][]byte, xs, ys []int) {
	t.Helper()
	for i := range jp {
		for c := 0; c < 3; c++ {
			for y := 0; y < 4; y++ {
				for x := 0; x < 4; x++ {
					want := byte(int(jp[i][4]) + 50*c + 3*(y+ys[i]) + (x + xs[i]))
					if got := dst[i*48+c*16+y*4+x]; got != want {
						t.Fatalf("image %d plane %d (%d,%d): %d, want %d", i, c, x, y, got, want)
					}
				}
			}
		}
	}
	for _, b := range dst[len(jp)*48:] {
		if b != 0xee {
			t.Fatal("DecodeCrop wrote past the batch")
		}
	}
}

// TestMissingLibrary: a library that does not load, or lacks a symbol, is
// ErrUnavailable, naming it.
func TestMissingLibrary(t *testing.T) {
	if _, err := loadNvjpeg("/nonexistent/libnvjpeg.so.12"); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "/nonexistent/libnvjpeg.so.12") {
		t.Fatalf("%v", err)
	}
	if _, err := loadCUDA("/nonexistent/libcuda.so.1"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("%v", err)
	}
	if _, err := ParseBackends("fast"); err == nil {
		t.Fatal("ParseBackends(fast) did not fail")
	}
}

// uint64ToPtr is Go memory as the fake's "device" pointer.
func uint64ToPtr(p *byte) driver.DevicePtr { return driver.DevicePtr(uintptr(unsafe.Pointer(p))) }
