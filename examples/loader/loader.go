package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/examples/internal/dataset"
	"github.com/seed743c36cf/cudashare/examples/internal/gpudecode"
	"github.com/seed743c36cf/cudashare/share"
)

type config struct {
	data, socket, driver, decode, backend, nvjpeg, sharing, place string
	device, batch, crop, ring, workers, consumers, depth, lanes   int
	seed, batches                                                 uint64
	duration, wait                                                time.Duration
	selfcheck                                                     int
	threshold                                                     float64
	jsonOnly                                                      bool
}

// Report is the loader's last line on stdout.
type Report struct {
	Role       string   `json:"role"`
	Decode     string   `json:"decode"` // gpu or cpu
	DecodeWhy  string   `json:"decode_why,omitempty"`
	Backend    string   `json:"backend,omitempty"`
	BackendWhy []string `json:"backend_why,omitempty"`
	Place      string   `json:"place,omitempty"` // roi or copy: how crops reach the batch
	PlaceWhy   string   `json:"place_why,omitempty"`
	Lanes      int      `json:"lanes,omitempty"` // GPU decode: batches decoded at once
	Nvjpeg     string   `json:"nvjpeg,omitempty"`
	Driver     string   `json:"driver"`
	Sharing    string   `json:"sharing,omitempty"`
	Batch      int      `json:"batch"`
	Crop       int      `json:"crop"`
	Ring       int      `json:"ring"`
	Consumers  int      `json:"consumers"`
	Workers    int      `json:"workers,omitempty"`
	Batches    uint64   `json:"batches"`
	Images     uint64   `json:"images"`
	Epochs     int      `json:"epochs"`
	Seconds    float64  `json:"seconds"`
	ImagesPerS float64  `json:"images_per_s"`
	// The process's CPU time (getrusage), all of it and during Seconds.
	CPUUserS   float64 `json:"cpu_user_s"`
	CPUSysS    float64 `json:"cpu_sys_s"`
	CPUS       float64 `json:"cpu_s"`
	CPUWindowS float64 `json:"cpu_window_s"`
	// DecodeS: on the GPU, the host time inside the decode and crop calls;
	// on the CPU, the time the workers spent decoding, summed.
	DecodeS float64 `json:"decode_s"`
	End     string  `json:"end"`
	Error   string  `json:"error,omitempty"`
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	var cfg config
	fs := flag.NewFlagSet("loader", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.data, "data", "", "the data set's directory (examples/datagen -out)")
	fs.StringVar(&cfg.socket, "socket", fmt.Sprintf("/tmp/cudashare-%d/loader.sock", syscall.Getuid()), "Unix socket to lend the batches on")
	fs.StringVar(&cfg.driver, "driver", driver.BackendAuto, "driver: auto, cuda or sim (CUDASHARE_DRIVER overrides it)")
	fs.IntVar(&cfg.device, "device", 0, "GPU to decode on and allocate the batches on")
	fs.StringVar(&cfg.decode, "decode", "auto", "where to decode: gpu (nvJPEG), cpu (image/jpeg in goroutines), auto (gpu where nvJPEG and a GPU are, else cpu)")
	fs.StringVar(&cfg.backend, "backend", "auto", "nvJPEG backend: auto (hardware, then gpu-hybrid), hardware, gpu-hybrid, hybrid, default")
	fs.StringVar(&cfg.nvjpeg, "nvjpeg", "", "libnvjpeg's path (default: probe libnvjpeg.so.13, .12, ..., the toolkit's and pip's directories; CUDASHARE_NVJPEG)")
	fs.StringVar(&cfg.place, "place", "auto", "nvJPEG: how each crop reaches the batch: roi (decode the region in place, nvjpegDecodeBatchedEx), copy (decode whole, 2D copies), auto (roi where it is taken)")
	fs.IntVar(&cfg.lanes, "lanes", 2, "nvJPEG: batches decoded at once, each with its own decoder state, stream and goroutine (a decode call that waits for the GPU holds up one lane only); at most -ring - 1")
	fs.StringVar(&cfg.sharing, "sharing", "auto", "how buffers are shared: auto, vmm or ipc")
	fs.IntVar(&cfg.batch, "batch", 256, "images per batch (the metadata carries a label, key and crop offset per image: at most about 300 fit in PROTOCOL.md's 4 KiB)")
	fs.IntVar(&cfg.crop, "crop", 224, "side of the square each image is cropped to")
	fs.IntVar(&cfg.ring, "ring", 8, "GPU buffers of one batch each, lent in turn")
	fs.IntVar(&cfg.workers, "workers", 0, "CPU decode goroutines (0: GOMAXPROCS)")
	fs.IntVar(&cfg.depth, "depth", 4, "CPU decode: batches decoded ahead")
	fs.IntVar(&cfg.consumers, "consumers", 1, "wait for this many consumers; 0: no consumer, decode and crop only (the loader's own rate)")
	fs.Uint64Var(&cfg.seed, "seed", 1, "order and crop offsets: the same seed gives the same batches")
	fs.Uint64Var(&cfg.batches, "batches", 0, "stop after this many batches (0: until the consumers leave, -duration or a signal)")
	fs.DurationVar(&cfg.duration, "duration", 0, "stop after this long, from when the consumers are connected (0: no limit)")
	fs.DurationVar(&cfg.wait, "wait", 60*time.Second, "fail if the consumers have not connected within this long")
	fs.IntVar(&cfg.selfcheck, "selfcheck", 0, "decode this many images with nvJPEG and with image/jpeg, compare, print PASS or FAIL, and exit")
	fs.Float64Var(&cfg.threshold, "threshold", 2.0, "-selfcheck: the largest mean absolute difference per pixel value that passes")
	fs.BoolVar(&cfg.jsonOnly, "json", true, "print the report as one JSON line")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if cfg.data == "" {
		fmt.Fprintln(stderr, "loader: -data DIR is required (make one with examples/datagen)")
		return 2
	}
	if cfg.batch < 1 || cfg.crop < 1 || cfg.ring < 1 || cfg.consumers < 0 || cfg.depth < 1 || cfg.lanes < 1 {
		fmt.Fprintln(stderr, "loader: -batch, -crop, -ring, -depth and -lanes must be at least 1, -consumers at least 0")
		return 2
	}
	if cfg.lanes >= cfg.ring && cfg.consumers > 0 {
		// Each lane holds a buffer while it decodes; the consumer needs
		// one offered meanwhile.
		fmt.Fprintf(stderr, "loader: -lanes %d needs -ring of at least %d\n", cfg.lanes, cfg.lanes+1)
		return 2
	}
	if cfg.workers <= 0 {
		cfg.workers = runtime.GOMAXPROCS(0)
	}
	if cfg.selfcheck > 0 {
		return selfcheck(cfg, stdout, stderr)
	}
	l := &loader{cfg: cfg, stderr: stderr}
	l.rep = Report{Role: "loader", Batch: cfg.batch, Crop: cfg.crop, Ring: cfg.ring, Consumers: cfg.consumers}
	err := l.run(ctx)
	code := 0
	if err != nil {
		l.rep.Error = err.Error()
		if l.rep.End == "" {
			l.rep.End = "error"
		}
		code = 1
		fmt.Fprintf(stderr, "loader: %v\n", err)
	}
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		l.rep.CPUUserS = round3(tv(ru.Utime))
		l.rep.CPUSysS = round3(tv(ru.Stime))
		l.rep.CPUS = round3(tv(ru.Utime) + tv(ru.Stime))
	}
	b, _ := json.Marshal(&l.rep)
	fmt.Fprintf(stdout, "%s\n", b)
	return code
}

func tv(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }

func cpuNow() float64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return tv(ru.Utime) + tv(ru.Stime)
}

func round3(f float64) float64 { return float64(int64(f*1000+0.5)) / 1000 }

type loader struct {
	cfg    config
	rep    Report
	stderr io.Writer

	endMu  sync.Mutex
	endWhy string // the first reason the run ended
}

func (l *loader) setEnd(why string) {
	l.endMu.Lock()
	defer l.endMu.Unlock()
	if l.endWhy == "" {
		l.endWhy = why
	}
}

// device opens the driver, the device and its primary context.
func openContext(backend string, ordinal int) (*driver.Driver, *driver.Context, error) {
	d, err := driver.Open(driver.Config{Backend: backend})
	if err != nil {
		return nil, nil, err
	}
	dev, err := d.Device(ordinal)
	if err != nil {
		return nil, nil, err
	}
	dctx, err := dev.RetainPrimaryContext()
	if err != nil {
		return nil, nil, err
	}
	return d, dctx, nil
}

// sink is where a batch goes: a ring buffer to offer, or with no consumer
// one of a few buffers reused in turn.
type sink interface {
	take(ctx context.Context) (driver.DevicePtr, error)
	give(ctx context.Context, meta []byte) error
	drop() // the buffer taken will not be given
}

func (l *loader) run(ctx context.Context) error {
	cfg := l.cfg
	idx, err := dataset.LoadIndex(cfg.data)
	if err != nil {
		return err
	}
	d, dctx, err := openContext(cfg.driver, cfg.device)
	if err != nil {
		return err
	}
	defer dctx.Close()
	l.rep.Driver = d.Backend()
	stream, err := dctx.NewStream(true)
	if err != nil {
		return err
	}
	defer stream.Close()

	// Where to decode.
	var gpu []*gpudecode.Decoder // one per lane
	streams := []*driver.Stream{stream}
	switch {
	case cfg.decode == "cpu":
		l.rep.DecodeWhy = "-decode cpu"
	case cfg.decode != "gpu" && cfg.decode != "auto":
		return fmt.Errorf("-decode %q: gpu, cpu or auto", cfg.decode)
	case d.Backend() != "cuda":
		if cfg.decode == "gpu" {
			return fmt.Errorf("-decode gpu needs the CUDA driver, not %s", d.Backend())
		}
		l.rep.DecodeWhy = "the " + d.Backend() + " driver: no GPU to decode on"
	default:
		backends, err := gpudecode.ParseBackends(cfg.backend)
		if err != nil {
			return err
		}
		place, err := gpudecode.ParsePlace(cfg.place)
		if err != nil {
			return err
		}
		for i := 0; i < cfg.lanes; i++ {
			if i > 0 {
				s, err := dctx.NewStream(true)
				if err != nil {
					return err
				}
				defer s.Close()
				streams = append(streams, s)
			}
			dec, err := gpudecode.Open(dctx, streams[i], gpudecode.Config{Library: cfg.nvjpeg, Backends: backends, Crop: cfg.crop, Place: place})
			if err != nil {
				if cfg.decode == "gpu" || i > 0 {
					return err
				}
				l.rep.DecodeWhy = err.Error()
				break
			}
			defer dec.Close()
			gpu = append(gpu, dec)
		}
	}
	if gpu != nil {
		l.rep.Decode = "gpu"
		l.rep.Nvjpeg = gpu[0].Library()
		l.rep.Lanes = len(gpu)
	} else {
		l.rep.Decode = "cpu"
		l.rep.Workers = cfg.workers
	}
	lanes := len(streams)

	size := uint64(cfg.batch) * 3 * uint64(cfg.crop) * uint64(cfg.crop)
	outs := make([]sink, lanes) // one per lane, on the lane's stream
	var exp *share.Exporter
	if cfg.consumers > 0 {
		sharing, err := share.ParseSharing(cfg.sharing)
		if err != nil {
			return err
		}
		exp, err = share.NewExporter(ctx, dctx, cfg.socket, share.ExporterConfig{Sharing: sharing})
		if err != nil {
			return err
		}
		sh, _ := exp.Sharing()
		l.rep.Sharing = sh.String()
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if err := exp.Shutdown(sctx); err != nil {
				fmt.Fprintf(l.stderr, "loader: shutdown: %v\n", err)
			}
		}()
		ring, err := exp.NewRing(cfg.ring, size)
		if err != nil {
			return fmt.Errorf("a ring of %d batches of %d bytes: %w", cfg.ring, size, err)
		}
		for i := range outs {
			outs[i] = &ringSink{exp: exp, ring: ring, stream: streams[i]}
		}
	} else {
		// Each lane cycles through buffers of its own: its stream's order
		// is all a buffer needs before the lane writes it again.
		per := max(1, (cfg.ring+lanes-1)/lanes)
		for i := range outs {
			ls := &localSink{}
			for j := 0; j < per; j++ {
				p, err := dctx.Alloc(size)
				if err != nil {
					return err
				}
				defer dctx.Free(p)
				ls.bufs = append(ls.bufs, p)
			}
			outs[i] = ls
		}
	}

	g, gctx := errgroup.WithContext(ctx)
	runCtx, cancelRun := context.WithCancel(gctx)
	defer cancelRun()
	batches := make(chan []item, 4)
	g.Go(func() error { return source(runCtx, cfg.data, idx, cfg.seed, cfg.batch, cfg.crop, batches) })
	var cpu *cpuDecoder
	var hostBatches chan *hostBatch
	out := outs[0]
	if gpu == nil {
		cpu = newCPUDecoder(cfg.crop, cfg.depth)
		hostBatches = make(chan *hostBatch, cfg.depth)
		g.Go(func() error { cpu.run(runCtx, cfg.workers, cfg.depth, batches, hostBatches); return nil })
	}

	if exp != nil {
		wctx, cancel := context.WithTimeout(ctx, cfg.wait)
		err := exp.WaitConsumers(wctx, cfg.consumers)
		cancel()
		if err != nil {
			cancelRun()
			g.Wait()
			return fmt.Errorf("%d of %d consumer(s) connected to %s within -wait %v: %w", exp.Consumers(), cfg.consumers, cfg.socket, cfg.wait, err)
		}
		// The run ends when every consumer has left.
		g.Go(func() error {
			t := time.NewTicker(50 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-runCtx.Done():
					return nil
				case <-t.C:
					if exp.Consumers() == 0 {
						l.setEnd("consumers left")
						cancelRun()
						return nil
					}
				}
			}
		})
	}
	if cfg.duration > 0 {
		t := time.AfterFunc(cfg.duration, func() {
			l.setEnd("duration")
			cancelRun()
		})
		defer t.Stop()
	}

	t0, cpu0 := time.Now(), cpuNow()
	end := t0
	var loopErr error
	epochs := 0
	if gpu != nil {
		decs := make([]cropDecoder, len(gpu))
		for i, dec := range gpu {
			decs[i] = dec
		}
		end, epochs, loopErr = l.lanes(runCtx, decs, outs, batches, t0)
	}
	for n := uint64(0); gpu == nil && (cfg.batches == 0 || n < cfg.batches); n++ {
		var items []item
		var hb *hostBatch
		var ok bool
		select {
		case hb, ok = <-hostBatches:
		case <-runCtx.Done():
		}
		if ok {
			hb.wg.Wait()
			if hb.err != nil {
				loopErr = hb.err
				break
			}
			items = hb.items
		}
		if !ok {
			break
		}
		dst, err := out.take(runCtx)
		if err != nil {
			if runCtx.Err() == nil {
				loopErr = err
			}
			break
		}
		err = dctx.CopyHtoDAsync(dst, hb.pix, stream)
		cpu.done(hb)
		var meta []byte
		if err == nil {
			meta, err = batchMeta(n, items, cfg.crop)
		}
		if err != nil {
			out.drop()
			loopErr = err
			break
		}
		if err := out.give(runCtx, meta); err != nil {
			if runCtx.Err() == nil {
				loopErr = err
			}
			break
		}
		l.rep.Batches++
		l.rep.Images += uint64(len(items))
		epochs = max(epochs, items[len(items)-1].Epoch+1)
		end = time.Now()
	}
	switch {
	case ctx.Err() != nil:
		l.setEnd("signal")
	case loopErr != nil:
		l.setEnd("error")
	default:
		l.setEnd("batches")
	}
	cancelRun()
	l.endMu.Lock()
	l.rep.End = l.endWhy
	l.endMu.Unlock()
	for _, st := range streams {
		if err := st.Synchronize(); err != nil && loopErr == nil {
			loopErr = err
		}
	}
	if exp == nil {
		end = time.Now() // the decode rate counts the GPU's work too
	}
	srcErr := g.Wait()
	l.rep.Epochs = epochs
	if s := end.Sub(t0).Seconds(); s > 0 {
		l.rep.Seconds = round3(s)
		l.rep.ImagesPerS = float64(int64(float64(l.rep.Images)/s*10)) / 10
	}
	l.rep.CPUWindowS = round3(cpuNow() - cpu0)
	if gpu != nil {
		var dt time.Duration
		for _, dec := range gpu {
			t, _, _ := dec.DecodeTime()
			dt += t
		}
		l.rep.DecodeS = round3(dt.Seconds())
		b, why := gpu[0].Backend()
		l.rep.Backend, l.rep.BackendWhy = b.String(), why
		p, pwhy := gpu[0].Place()
		l.rep.Place, l.rep.PlaceWhy = p.String(), pwhy
	} else {
		l.rep.DecodeS = round3(time.Duration(cpu.decodeN.Load()).Seconds())
	}
	if loopErr != nil {
		return loopErr
	}
	if srcErr != nil && !errors.Is(srcErr, context.Canceled) {
		return srcErr
	}
	return nil
}

// batchMeta is the offer's metadata: dtype and shape (PROTOCOL.md 4.2),
// and per image its label, its key in the data set and its crop offset
// (crops: x0, y0, x1, y1, ...), so that a consumer can check every batch.
func batchMeta(n uint64, items []item, crop int) ([]byte, error) {
	labels := make([]int, len(items))
	keys := make([]int, len(items))
	crops := make([]int, 0, 2*len(items))
	for i, it := range items {
		labels[i], keys[i] = it.Label, it.Key
		crops = append(crops, it.X, it.Y)
	}
	return share.EncodeMeta(share.ViewMeta{
		DType: "uint8",
		Shape: []uint64{uint64(len(items)), 3, uint64(crop), uint64(crop)},
		Extra: map[string]any{"batch": n, "epoch": items[0].Epoch, "labels": labels, "keys": keys, "crops": crops},
	})
}

// ringSink offers each batch from a ring, stream-ordered.
type ringSink struct {
	exp    *share.Exporter
	ring   *share.Ring
	stream *driver.Stream
	cur    *share.Buffer
}

func (r *ringSink) take(ctx context.Context) (driver.DevicePtr, error) {
	b, err := r.ring.AcquireOn(ctx, r.stream)
	if err != nil {
		return 0, err
	}
	r.cur = b
	return b.Ptr(), nil
}

func (r *ringSink) give(ctx context.Context, meta []byte) error {
	b := r.cur
	r.cur = nil
	err := r.exp.Offer(ctx, b, share.OfferOptions{Meta: meta, Stream: r.stream})
	if err != nil {
		b.Free() // not offered: back to the ring
	}
	return err
}

func (r *ringSink) drop() {
	if r.cur != nil {
		r.cur.Free()
		r.cur = nil
	}
}

// localSink cycles through buffers of its own on one stream: with no
// consumer, the stream's order is all a buffer needs before it is written
// again.
type localSink struct {
	bufs []driver.DevicePtr
	i    int
}

func (l *localSink) take(context.Context) (driver.DevicePtr, error) {
	p := l.bufs[l.i%len(l.bufs)]
	l.i++
	return p, nil
}

func (l *localSink) give(context.Context, []byte) error { return nil }

func (l *localSink) drop() {}
