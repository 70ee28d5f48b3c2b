package main

import (
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/examples/internal/dataset"
	"github.com/seed743c36cf/cudashare/examples/internal/gpudecode"
)

// checkResult is one backend's comparison with image/jpeg.
type checkResult struct {
	Role      string  `json:"role"`
	Backend   string  `json:"backend"`
	Place     string  `json:"place"`  // roi or copy
	Result    string  `json:"result"` // PASS, FAIL or unavailable
	Why       string  `json:"why,omitempty"`
	Nvjpeg    string  `json:"nvjpeg,omitempty"`
	Images    int     `json:"images"`
	MeanAbs   float64 `json:"mean_abs_diff"`
	WorstMean float64 `json:"worst_image_mean_abs_diff"`
	MaxAbs    int     `json:"max_abs_diff"`
	Threshold float64 `json:"threshold"`
	SizesOK   bool    `json:"sizes_ok"`
}

// selfcheck decodes the first K images of the first shard with nvJPEG,
// once per backend (hardware, then gpu-hybrid), cropped as the loader
// crops them, and with image/jpeg, and compares the pixels: the decoders
// differ slightly (IDCT, chroma upsampling), so the mean absolute
// difference per value must stay under -threshold. It passes when every
// backend that can be created passes and at least one can; the hardware
// backend's absence is said, not failed.
func selfcheck(cfg config, stdout, stderr io.Writer) int {
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stdout, "selfcheck: FAIL: "+format+"\n", a...)
		return 1
	}
	idx, err := dataset.LoadIndex(cfg.data)
	if err != nil {
		return fail("%v", err)
	}
	var samples []dataset.Sample
	for _, name := range idx.Shards {
		s, err := dataset.ReadShard(filepath.Join(cfg.data, name), idx)
		if err != nil {
			return fail("%v", err)
		}
		samples = append(samples, s...)
		if len(samples) >= cfg.selfcheck {
			break
		}
	}
	samples = samples[:min(len(samples), cfg.selfcheck)]
	k, c := len(samples), cfg.crop
	sz := 3 * c * c
	ws, hs, xs, ys := make([]int, k), make([]int, k), make([]int, k), make([]int, k)
	jpgs := make([][]byte, k)
	want := make([]byte, k*sz)
	for i, s := range samples {
		w, h, err := dataset.Config(s.JPEG)
		if err != nil {
			return fail("key %d: %v", s.Key, err)
		}
		ws[i], hs[i], jpgs[i] = w, h, s.JPEG
		xs[i], ys[i] = dataset.CropOffset(cfg.seed, 0, s.Key, w, h, c)
		if err := dataset.DecodeCrop(s.JPEG, xs[i], ys[i], c, want[i*sz:(i+1)*sz]); err != nil {
			return fail("image/jpeg, key %d: %v", s.Key, err)
		}
	}

	d, dctx, err := openContext(cfg.driver, cfg.device)
	if err != nil {
		return fail("%v", err)
	}
	defer dctx.Close()
	if d.Backend() != "cuda" {
		return fail("the %s driver: nvJPEG needs a GPU", d.Backend())
	}
	stream, err := dctx.NewStream(true)
	if err != nil {
		return fail("%v", err)
	}
	defer stream.Close()
	dst, err := dctx.Alloc(uint64(k * sz))
	if err != nil {
		return fail("%v", err)
	}
	defer dctx.Free(dst)

	passed, failed := 0, 0
	for _, b := range []gpudecode.Backend{gpudecode.BackendHardware, gpudecode.BackendGPUHybrid} {
		for _, p := range []gpudecode.Place{gpudecode.PlaceROI, gpudecode.PlaceCopy} {
			r := checkResult{Role: "selfcheck", Backend: b.String(), Place: p.String(), Images: k, Threshold: cfg.threshold, SizesOK: true}
			r.Result, r.Why = checkBackend(cfg, dctx, stream, dst, b, p, jpgs, ws, hs, xs, ys, want, &r)
			switch r.Result {
			case "PASS":
				passed++
			case "FAIL":
				failed++
			}
			fmt.Fprintf(stdout, "selfcheck: %s/%s: %s: %d images, mean abs diff %.3f (threshold %.2f), worst image %.3f, max %d; sizes agree: %v %s\n",
				b, p, r.Result, k, r.MeanAbs, cfg.threshold, r.WorstMean, r.MaxAbs, r.SizesOK, r.Why)
			j, _ := json.Marshal(&r)
			fmt.Fprintf(stdout, "%s\n", j)
		}
	}
	if failed > 0 || passed == 0 {
		fmt.Fprintf(stdout, "selfcheck: FAIL: %d backend/placement pair(s) passed, %d failed\n", passed, failed)
		return 1
	}
	fmt.Fprintf(stdout, "selfcheck: PASS: %d backend/placement pair(s) passed\n", passed)
	return 0
}

// checkBackend checks one backend with one placement of the crops (roi:
// the region decoded in place, as the loader does where it can; copy:
// whole images and 2D copies). A placement or backend the library or the
// GPU does not take is "unavailable", except gpu-hybrid with copies, the
// loader's last resort.
func checkBackend(cfg config, dctx *driver.Context, stream *driver.Stream, dst driver.DevicePtr, b gpudecode.Backend, p gpudecode.Place,
	jpgs [][]byte, ws, hs, xs, ys []int, want []byte, r *checkResult) (string, string) {
	optional := b == gpudecode.BackendHardware || p == gpudecode.PlaceROI
	dec, err := gpudecode.Open(dctx, stream, gpudecode.Config{Library: cfg.nvjpeg, Backends: []gpudecode.Backend{b}, Crop: cfg.crop, Place: p})
	if err != nil {
		if optional {
			return "unavailable", err.Error()
		}
		return "FAIL", err.Error()
	}
	defer dec.Close()
	r.Nvjpeg = dec.Library()
	for i, j := range jpgs {
		w, h, err := dec.Info(j)
		if err != nil {
			return "FAIL", fmt.Sprintf("nvjpegGetImageInfo: %v", err)
		}
		if w != ws[i] || h != hs[i] {
			r.SizesOK = false
		}
	}
	// Poison dst first: a placement that writes nothing must not pass on
	// the previous check's pixels.
	if err := dctx.MemsetAsync(dst, 0x5a, uint64(len(want)), stream); err != nil {
		return "FAIL", err.Error()
	}
	if err := dec.DecodeCrop(jpgs, ws, hs, xs, ys, dst); err != nil {
		if optional {
			return "unavailable", err.Error()
		}
		return "FAIL", err.Error()
	}
	if _, why := dec.Backend(); len(why) > 0 {
		// Only one backend was given: a fallback cannot have happened, but
		// a "not supported" answer is said.
		return "unavailable", fmt.Sprint(why)
	}
	if got, why := dec.Place(); got != p {
		return "FAIL", fmt.Sprintf("asked to place by %v, placed by %v (%s)", p, got, why)
	}
	got := make([]byte, len(want))
	if err := dctx.CopyDtoHAsync(got, dst, stream); err != nil {
		return "FAIL", err.Error()
	}
	if err := stream.Synchronize(); err != nil {
		return "FAIL", err.Error()
	}
	sz := len(want) / len(jpgs)
	var sum int64
	for i := range jpgs {
		var s int64
		for o := i * sz; o < (i+1)*sz; o++ {
			d := int(got[o]) - int(want[o])
			if d < 0 {
				d = -d
			}
			s += int64(d)
			r.MaxAbs = max(r.MaxAbs, d)
		}
		sum += s
		r.WorstMean = max(r.WorstMean, float64(s)/float64(sz))
	}
	r.MeanAbs = float64(sum) / float64(len(want))
	r.MeanAbs, r.WorstMean = round3(r.MeanAbs), round3(r.WorstMean)
	if !r.SizesOK {
		return "FAIL", "nvjpegGetImageInfo and image/jpeg disagree on a size"
	}
	if r.WorstMean > 2*cfg.threshold || r.MeanAbs > cfg.threshold {
		return "FAIL", ""
	}
	return "PASS", ""
}
