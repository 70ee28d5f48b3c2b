package gpudecode

import (
	"errors"
	"fmt"
	"runtime"
	"time"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver"
)

// Config is what Open needs.
type Config struct {
	// Library is libnvjpeg's path; "" probes the usual sonames and places.
	Library string
	// Backends are tried in order (ParseBackends).
	Backends []Backend
	// Crop is the side of the square each image is cropped to.
	Crop int
}

// Decoder decodes batches of JPEGs on one stream. It is not safe for
// concurrent use: the loader runs it in one goroutine.
type Decoder struct {
	ctx    uintptr // CUcontext, made current for every call
	stream uintptr // CUstream
	alloc  func(uint64) (uint64, error)
	free   func(uint64) error
	cu     *cuda
	lib    *nvjpeg
	crop   int

	handle, state uintptr
	backend       Backend
	next          []Backend // the backends left to fall back to
	why           []string  // why earlier backends were left
	checked       bool      // the first batch was checked with nvjpegDecodeBatchedSupported
	inited        int       // the batch size nvjpegDecodeBatchedInitialize was given

	staging     uint64
	stagingSize uint64

	ptrs []uintptr
	lens []uint64
	imgs []image
	// keep holds the previous batch's bitstreams until the next decode
	// returns: nvJPEG may still read host input it was given after the
	// call returns (it copies it to the GPU on the stream), and Go memory
	// must stay alive until then. The Go heap does not move objects, so a
	// live slice's address stays valid.
	keep [][]byte

	decodeTime time.Duration
	images     uint64
	batches    uint64
}

// Open loads nvJPEG and creates a handle with the first backend that
// nvjpegCreateEx accepts. ctx must be the CUDA (not simulated) driver's;
// stream is where every decode and crop is queued.
func Open(ctx *driver.Context, stream *driver.Stream, cfg Config) (*Decoder, error) {
	if cfg.Crop < 1 {
		return nil, fmt.Errorf("gpudecode: crop %d", cfg.Crop)
	}
	if len(cfg.Backends) == 0 {
		cfg.Backends, _ = ParseBackends("auto")
	}
	cu, err := loadCUDA("libcuda.so.1")
	if err != nil {
		return nil, err
	}
	lib, err := loadNvjpeg(cfg.Library)
	if err != nil {
		return nil, err
	}
	alloc := func(n uint64) (uint64, error) {
		p, err := ctx.Alloc(n)
		return uint64(p), err
	}
	free := func(p uint64) error { return ctx.Free(driver.DevicePtr(p)) }
	return open(cu, lib, ctx.Handle(), stream.Handle(), alloc, free, cfg)
}

// open is Open with the libraries, the context, the stream and the device
// allocator given (the tests give fakes).
func open(cu *cuda, lib *nvjpeg, ctx, stream uintptr, alloc func(uint64) (uint64, error), free func(uint64) error, cfg Config) (*Decoder, error) {
	d := &Decoder{ctx: ctx, stream: stream, alloc: alloc, free: free, cu: cu, lib: lib, crop: cfg.Crop, next: cfg.Backends}
	unlock, err := d.enter()
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := d.createNext(); err != nil {
		return nil, err
	}
	return d, nil
}

// enter locks the goroutine to its thread and makes the loader's context
// current there, for nvJPEG's runtime and for the copies.
func (d *Decoder) enter() (func(), error) {
	runtime.LockOSThread()
	if err := cuCall("cuCtxSetCurrent", d.cu.ctxSetCurrent, d.ctx); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return runtime.UnlockOSThread, nil
}

// createNext destroys the current handle, if any, and creates one with the
// next backend that nvjpegCreateEx accepts.
func (d *Decoder) createNext() error {
	d.destroyHandle()
	for len(d.next) > 0 {
		b := d.next[0]
		d.next = d.next[1:]
		var h uintptr
		if err := call("nvjpegCreateEx", d.lib.createEx, uintptr(b), 0, 0, 0, uintptr(unsafe.Pointer(&h))); err != nil {
			d.why = append(d.why, fmt.Sprintf("%s: %v", b, err))
			continue
		}
		var st uintptr
		if err := call("nvjpegJpegStateCreate", d.lib.jpegStateCreate, h, uintptr(unsafe.Pointer(&st))); err != nil {
			call("nvjpegDestroy", d.lib.destroy, h)
			d.why = append(d.why, fmt.Sprintf("%s: %v", b, err))
			continue
		}
		d.handle, d.state, d.backend, d.inited = h, st, b, 0
		return nil
	}
	return fmt.Errorf("%w: no backend works: %v", ErrNvjpeg, d.why)
}

func (d *Decoder) destroyHandle() {
	if d.state != 0 {
		call("nvjpegJpegStateDestroy", d.lib.jpegStateDestroy, d.state)
		d.state = 0
	}
	if d.handle != 0 {
		call("nvjpegDestroy", d.lib.destroy, d.handle)
		d.handle = 0
	}
}

// Backend is the backend in use, and why earlier ones were left.
func (d *Decoder) Backend() (Backend, []string) { return d.backend, d.why }

// Library is libnvjpeg's path and version.
func (d *Decoder) Library() string { return d.lib.path + " " + d.lib.version() }

// DecodeTime is the host time spent in DecodeCrop, and the images and
// batches decoded.
func (d *Decoder) DecodeTime() (time.Duration, uint64, uint64) {
	return d.decodeTime, d.images, d.batches
}

// supported asks nvJPEG whether the batched decoder of this handle takes
// jpg (nvjpegDecodeBatchedSupported: 0 means it does).
func (d *Decoder) supported(jpg []byte) (bool, error) {
	var js uintptr
	if err := call("nvjpegJpegStreamCreate", d.lib.jpegStreamCreate, d.handle, uintptr(unsafe.Pointer(&js))); err != nil {
		return false, err
	}
	defer call("nvjpegJpegStreamDestroy", d.lib.jpegStreamDestroy, js)
	if err := call("nvjpegJpegStreamParse", d.lib.jpegStreamParse, d.handle, uintptr(unsafe.Pointer(&jpg[0])), uintptr(len(jpg)), 0, 0, js); err != nil {
		return false, err
	}
	var not int32 = -1
	if err := call("nvjpegDecodeBatchedSupported", d.lib.decodeBatchedSupport, d.handle, js, uintptr(unsafe.Pointer(&not))); err != nil {
		return false, err
	}
	return not == 0, nil
}

// Info is nvjpegGetImageInfo: the image's size (of its first component).
func (d *Decoder) Info(jpg []byte) (w, h int, err error) {
	if len(jpg) == 0 {
		return 0, 0, fmt.Errorf("%w: empty JPEG", ErrNvjpeg)
	}
	var comps, css int32
	var ws, hs [4]int32
	err = call("nvjpegGetImageInfo", d.lib.getImageInfo, d.handle, uintptr(unsafe.Pointer(&jpg[0])), uintptr(len(jpg)),
		uintptr(unsafe.Pointer(&comps)), uintptr(unsafe.Pointer(&css)), uintptr(unsafe.Pointer(&ws[0])), uintptr(unsafe.Pointer(&hs[0])))
	return int(ws[0]), int(hs[0]), err
}

// DecodeCrop decodes jpegs[i] (sizes w[i] x h[i]) and writes the crop x
// crop square at (x[i], y[i]) of each, as planar RGB (3 planes of crop x
// crop bytes), at dst + i*3*crop*crop, all queued on the stream: the
// caller records an event after it (the offer does) and never waits.
func (d *Decoder) DecodeCrop(jpegs [][]byte, w, h, x, y []int, dst driver.DevicePtr) error {
	n := len(jpegs)
	if n == 0 || len(w) != n || len(h) != n || len(x) != n || len(y) != n {
		return fmt.Errorf("gpudecode: DecodeCrop of %d images with %d, %d, %d, %d sizes and offsets", n, len(w), len(h), len(x), len(y))
	}
	maxW, maxH := 0, 0
	for i := range jpegs {
		if len(jpegs[i]) == 0 || x[i] < 0 || y[i] < 0 || x[i]+d.crop > w[i] || y[i]+d.crop > h[i] {
			return fmt.Errorf("gpudecode: image %d (%dx%d, %d bytes): crop %d at (%d,%d) does not fit", i, w[i], h[i], len(jpegs[i]), d.crop, x[i], y[i])
		}
		maxW, maxH = max(maxW, w[i]), max(maxH, h[i])
	}
	unlock, err := d.enter()
	if err != nil {
		return err
	}
	defer unlock()
	t0 := time.Now()
	defer func() { d.decodeTime += time.Since(t0) }()

	if !d.checked && d.backend == BackendHardware {
		// The hardware backend takes baseline JPEGs with one scan and not
		// every subsampling: ask, once, rather than fail on the first batch.
		d.checked = true
		if ok, err := d.supported(jpegs[0]); err != nil || !ok {
			d.why = append(d.why, fmt.Sprintf("hardware: nvjpegDecodeBatchedSupported says no (%v)", err))
			if err := d.createNext(); err != nil {
				return err
			}
		}
	}

	pitch := uint64(maxW+63) &^ 63
	plane := pitch * uint64(maxH)
	slot := 3 * plane
	if need := slot * uint64(n); need > d.stagingSize {
		if d.staging != 0 {
			// The previous batches' work still reads it.
			if err := cuCall("cuStreamSynchronize", d.cu.streamSynchonize, d.stream); err != nil {
				return err
			}
			d.free(d.staging)
			d.staging, d.stagingSize = 0, 0
		}
		p, err := d.alloc(need)
		if err != nil {
			return fmt.Errorf("gpudecode: staging for %d images of up to %dx%d: %w", n, maxW, maxH, err)
		}
		d.staging, d.stagingSize = p, need
	}
	if cap(d.ptrs) < n {
		d.ptrs, d.lens, d.imgs = make([]uintptr, n), make([]uint64, n), make([]image, n)
	}
	ptrs, lens, imgs := d.ptrs[:n], d.lens[:n], d.imgs[:n]
	for i, j := range jpegs {
		ptrs[i] = uintptr(unsafe.Pointer(&j[0]))
		lens[i] = uint64(len(j))
		base := d.staging + uint64(i)*slot
		imgs[i] = image{
			channel: [4]uintptr{uintptr(base), uintptr(base + plane), uintptr(base + 2*plane), 0},
			pitch:   [4]uint64{pitch, pitch, pitch, 0},
		}
	}
	err = d.decode(ptrs, lens, imgs)
	for err != nil && d.batches == 0 && len(d.next) > 0 {
		// A backend that fails its first batch is left for the next one.
		d.why = append(d.why, fmt.Sprintf("%s: %v", d.backend, err))
		if cerr := d.createNext(); cerr != nil {
			return errors.Join(err, cerr)
		}
		err = d.decode(ptrs, lens, imgs)
	}
	d.keep = append(d.keep[:0], jpegs...)
	runtime.KeepAlive(jpegs)
	if err != nil {
		return err
	}
	c := uint64(d.crop)
	for i := range jpegs {
		src := d.staging + uint64(i)*slot + uint64(y[i])*pitch + uint64(x[i])
		out := uint64(dst) + uint64(i)*3*c*c
		for ch := uint64(0); ch < 3; ch++ {
			if err := d.cu.copy2D(out+ch*c*c, c, src+ch*plane, pitch, c, c, d.stream); err != nil {
				return fmt.Errorf("gpudecode: crop image %d: %w", i, err)
			}
		}
	}
	d.images += uint64(n)
	d.batches++
	return nil
}

func (d *Decoder) decode(ptrs []uintptr, lens []uint64, imgs []image) error {
	n := len(ptrs)
	if d.inited != n {
		if err := call("nvjpegDecodeBatchedInitialize", d.lib.decodeBatchedInit, d.handle, d.state, uintptr(n), 1, outputRGB); err != nil {
			return err
		}
		d.inited = n
	}
	err := call("nvjpegDecodeBatched", d.lib.decodeBatched, d.handle, d.state,
		uintptr(unsafe.Pointer(&ptrs[0])), uintptr(unsafe.Pointer(&lens[0])), uintptr(unsafe.Pointer(&imgs[0])), d.stream)
	if err != nil {
		d.inited = 0 // nvJPEG: after a failed batch, initialize again
	}
	return err
}

// Close waits for the stream, then frees the staging memory and destroys
// the handle. It is idempotent.
func (d *Decoder) Close() error {
	if d == nil || d.lib == nil {
		return nil
	}
	unlock, err := d.enter()
	if err != nil {
		return err
	}
	defer unlock()
	err = cuCall("cuStreamSynchronize", d.cu.streamSynchonize, d.stream)
	d.destroyHandle()
	if d.staging != 0 {
		if ferr := d.free(d.staging); ferr != nil && err == nil {
			err = ferr
		}
		d.staging = 0
	}
	d.keep = nil
	d.lib = nil
	return err
}
