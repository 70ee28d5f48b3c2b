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
	// Place is how a crop gets to its place in the batch (ParsePlace).
	Place Place
}

// Place is how each image's crop is written into the batch.
type Place int

const (
	// PlaceAuto: PlaceROI where the library has it and
	// nvjpegDecodeBatchedSupportedEx takes the first image with a region,
	// else PlaceCopy.
	PlaceAuto Place = iota
	// PlaceROI: nvjpegDecodeBatchedEx decodes only each image's region,
	// straight into the batch: no staging, and one call queues the whole
	// batch (no 3 copies per image). Under time-slicing with another
	// process's context every queued operation counts.
	PlaceROI
	// PlaceCopy: nvjpegDecodeBatched decodes whole images into staging,
	// and a 2D copy per plane crops each into the batch.
	PlaceCopy
)

func (p Place) String() string {
	switch p {
	case PlaceROI:
		return "roi"
	case PlaceCopy:
		return "copy"
	}
	return "auto"
}

// ParsePlace reads -place: auto, roi or copy.
func ParsePlace(s string) (Place, error) {
	switch s {
	case "auto", "":
		return PlaceAuto, nil
	case "roi":
		return PlaceROI, nil
	case "copy":
		return PlaceCopy, nil
	}
	return 0, fmt.Errorf("unknown crop placement %q: auto, roi or copy", s)
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

	place      Place     // as asked
	roi        bool      // the ROI decode is in use
	roiChecked bool      // placed: roi decided (on the first batch)
	params     []uintptr // nvjpegDecodeParams_t per image of a batch, of handle
	placeWhy   string    // why crops are copied, where roi was not taken

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
	d := &Decoder{ctx: ctx, stream: stream, alloc: alloc, free: free, cu: cu, lib: lib, crop: cfg.Crop, next: cfg.Backends, place: cfg.Place}
	if cfg.Place == PlaceROI && !lib.hasROI() {
		return nil, fmt.Errorf("%w: -place roi: %s lacks nvjpegDecodeBatchedEx or the decode parameters' calls", ErrNvjpeg, lib.path)
	}
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
	for _, p := range d.params {
		call("nvjpegDecodeParamsDestroy", d.lib.decodeParamsDestroy, p)
	}
	d.params = d.params[:0]
	d.roiChecked = false // a new handle is asked again
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

// Place is how crops are placed: PlaceROI or PlaceCopy once the first
// batch decided it (PlaceAuto before), and why not PlaceROI.
func (d *Decoder) Place() (Place, string) {
	switch {
	case !d.roiChecked:
		return PlaceAuto, ""
	case d.roi:
		return PlaceROI, ""
	}
	return PlaceCopy, d.placeWhy
}

// Library is libnvjpeg's path and version.
func (d *Decoder) Library() string { return d.lib.path + " " + d.lib.version() }

// DecodeTime is the host time spent in DecodeCrop, and the images and
// batches decoded.
func (d *Decoder) DecodeTime() (time.Duration, uint64, uint64) {
	return d.decodeTime, d.images, d.batches
}

// supported asks nvJPEG whether the batched decoder of this handle takes
// jpg (nvjpegDecodeBatchedSupported: 0 means it does); with params, the
// ROI decode (nvjpegDecodeBatchedSupportedEx).
func (d *Decoder) supported(jpg []byte, params uintptr) (bool, error) {
	var js uintptr
	if err := call("nvjpegJpegStreamCreate", d.lib.jpegStreamCreate, d.handle, uintptr(unsafe.Pointer(&js))); err != nil {
		return false, err
	}
	defer call("nvjpegJpegStreamDestroy", d.lib.jpegStreamDestroy, js)
	if err := call("nvjpegJpegStreamParse", d.lib.jpegStreamParse, d.handle, uintptr(unsafe.Pointer(&jpg[0])), uintptr(len(jpg)), 0, 0, js); err != nil {
		return false, err
	}
	var not int32 = -1
	if params != 0 {
		if err := call("nvjpegDecodeBatchedSupportedEx", d.lib.decodeBatchedSuppEx, d.handle, js, params, uintptr(unsafe.Pointer(&not))); err != nil {
			return false, err
		}
		return not == 0, nil
	}
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
		if ok, err := d.supported(jpegs[0], 0); err != nil || !ok {
			d.why = append(d.why, fmt.Sprintf("hardware: nvjpegDecodeBatchedSupported says no (%v)", err))
			if err := d.createNext(); err != nil {
				return err
			}
		}
	}

	if !d.roiChecked {
		d.roiChecked, d.roi = true, false
		if d.place != PlaceCopy && d.lib.hasROI() {
			ok, err := d.roiSupported(jpegs[0], x[0], y[0])
			switch {
			case ok:
				d.roi = true
			case d.place == PlaceROI:
				return fmt.Errorf("%w: -place roi: nvjpegDecodeBatchedSupportedEx says no (%v)", ErrNvjpeg, err)
			default:
				d.placeWhy = fmt.Sprintf("nvjpegDecodeBatchedSupportedEx says no (%v)", err)
			}
		} else if d.place != PlaceCopy {
			d.placeWhy = d.lib.path + " lacks nvjpegDecodeBatchedEx"
		}
	}
	if d.roi {
		err := d.decodeROI(jpegs, x, y, dst)
		if err == nil {
			d.keep = append(d.keep[:0], jpegs...)
			runtime.KeepAlive(jpegs)
			d.images += uint64(n)
			d.batches++
			return nil
		}
		if d.batches > 0 || d.place == PlaceROI {
			return err
		}
		// The first batch failed with regions: copy crops from now on.
		d.roi, d.placeWhy = false, err.Error()
	}
	if err := d.decodeCopy(jpegs, w, h, x, y, dst, maxW, maxH); err != nil {
		return err
	}
	d.images += uint64(n)
	d.batches++
	return nil
}

// roiSupported asks whether the ROI decode takes jpg with a crop at (x, y).
func (d *Decoder) roiSupported(jpg []byte, x, y int) (bool, error) {
	if err := d.makeParams(1); err != nil {
		return false, err
	}
	if err := call("nvjpegDecodeParamsSetROI", d.lib.decodeParamsSetROI, d.params[0], uintptr(x), uintptr(y), uintptr(d.crop), uintptr(d.crop)); err != nil {
		return false, err
	}
	return d.supported(jpg, d.params[0])
}

// makeParams creates decode parameters up to n, each for RGB output.
func (d *Decoder) makeParams(n int) error {
	for len(d.params) < n {
		var p uintptr
		if err := call("nvjpegDecodeParamsCreate", d.lib.decodeParamsCreate, d.handle, uintptr(unsafe.Pointer(&p))); err != nil {
			return err
		}
		d.params = append(d.params, p)
		if err := call("nvjpegDecodeParamsSetOutputFormat", d.lib.decodeParamsSetFmt, p, outputRGB); err != nil {
			return err
		}
	}
	return nil
}

// decodeROI decodes each image's crop straight into its place in dst:
// image i's planes at dst + (3i+c)*crop*crop, pitch crop. One call queues
// the batch; nothing is staged and nothing copied.
func (d *Decoder) decodeROI(jpegs [][]byte, x, y []int, dst driver.DevicePtr) error {
	n := len(jpegs)
	if err := d.makeParams(n); err != nil {
		return err
	}
	ptrs, lens, imgs := d.arrays(n)
	c := uint64(d.crop)
	for i, j := range jpegs {
		ptrs[i] = uintptr(unsafe.Pointer(&j[0]))
		lens[i] = uint64(len(j))
		base := uint64(dst) + uint64(i)*3*c*c
		imgs[i] = image{
			channel: [4]uintptr{uintptr(base), uintptr(base + c*c), uintptr(base + 2*c*c), 0},
			pitch:   [4]uint64{c, c, c, 0},
		}
		if err := call("nvjpegDecodeParamsSetROI", d.lib.decodeParamsSetROI, d.params[i], uintptr(x[i]), uintptr(y[i]), uintptr(d.crop), uintptr(d.crop)); err != nil {
			return err
		}
	}
	if err := d.initialize(n); err != nil {
		return err
	}
	err := call("nvjpegDecodeBatchedEx", d.lib.decodeBatchedEx, d.handle, d.state,
		uintptr(unsafe.Pointer(&ptrs[0])), uintptr(unsafe.Pointer(&lens[0])), uintptr(unsafe.Pointer(&imgs[0])),
		uintptr(unsafe.Pointer(&d.params[0])), d.stream)
	if err != nil {
		d.inited = 0
	}
	return err
}

func (d *Decoder) arrays(n int) ([]uintptr, []uint64, []image) {
	if cap(d.ptrs) < n {
		d.ptrs, d.lens, d.imgs = make([]uintptr, n), make([]uint64, n), make([]image, n)
	}
	return d.ptrs[:n], d.lens[:n], d.imgs[:n]
}

func (d *Decoder) initialize(n int) error {
	if d.inited == n {
		return nil
	}
	if err := call("nvjpegDecodeBatchedInitialize", d.lib.decodeBatchedInit, d.handle, d.state, uintptr(n), 1, outputRGB); err != nil {
		return err
	}
	d.inited = n
	return nil
}

// decodeCopy decodes whole images into staging and copies each crop,
// plane by plane, into dst.
func (d *Decoder) decodeCopy(jpegs [][]byte, w, h, x, y []int, dst driver.DevicePtr, maxW, maxH int) error {
	n := len(jpegs)
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
	ptrs, lens, imgs := d.arrays(n)
	for i, j := range jpegs {
		ptrs[i] = uintptr(unsafe.Pointer(&j[0]))
		lens[i] = uint64(len(j))
		base := d.staging + uint64(i)*slot
		imgs[i] = image{
			channel: [4]uintptr{uintptr(base), uintptr(base + plane), uintptr(base + 2*plane), 0},
			pitch:   [4]uint64{pitch, pitch, pitch, 0},
		}
	}
	err := d.decode(ptrs, lens, imgs)
	for err != nil && d.batches == 0 && len(d.next) > 0 {
		// A backend that fails its first batch is left for the next one.
		d.why = append(d.why, fmt.Sprintf("%s: %v", d.backend, err))
		if cerr := d.createNext(); cerr != nil {
			return errors.Join(err, cerr)
		}
		d.roiChecked, d.roi = true, false // the handle is new: stay with copies
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
	return nil
}

func (d *Decoder) decode(ptrs []uintptr, lens []uint64, imgs []image) error {
	if err := d.initialize(len(ptrs)); err != nil {
		return err
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
