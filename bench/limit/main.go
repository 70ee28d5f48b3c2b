// Command limit measures the GPU work of a handoff with no handoff: one
// process, two streams, events, no IPC and no host wait per batch. It is
// the limit a handoff between processes could reach for that GPU work.
//
// A ring of -ring buffers of -size bytes lives on GPU -device. For each batch
// (buffer i = batch mod ring):
//
//	stream P: wait "consumed" event i (from the batch that last used buffer
//	          i), memset buffer i with a byte derived from the batch number,
//	          record "filled" event i;
//	stream C: wait "filled" event i, with -copy copy buffer i device to
//	          device into a local scratch buffer, record "consumed" event i.
//
// Stream C lives on GPU -consumer-device: another GPU reads the ring
// through peer access. The host only queues work; the driver blocks it when
// its queue is full. The measured run ends with both streams synchronized,
// so every batch counted has completed. At the end the scratch buffer (or
// the last buffer filled) is read back and checked.
//
// It prints one JSON line: batches per second (handoffs_per_s, the key of
// the benchmark's other rows), issue_seconds (how long the host took to
// queue them) and drain_ms (how long the GPU took to finish after the last
// was queued). The host blocks in the driver when the GPU's queue is full,
// so a GPU-bound run ends with a full queue to drain (a millisecond or
// more); a host-bound one with next to nothing (the time of a batch or two).
//
//	limit -ring 8 -size 1MiB -seconds 4 -json
//	limit -device 0 -consumer-device 1 -copy=false -json
//
// Without a GPU (or with CUDASHARE_DRIVER=sim) it runs on the simulated
// driver, where work is a CPU memset: the plumbing, not a GPU.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
)

type result struct {
	Impl           string  `json:"impl"`
	Driver         string  `json:"driver,omitempty"`
	DriverReason   string  `json:"driver_reason,omitempty"`
	Mode           string  `json:"mode"`
	Ring           int     `json:"ring"`
	Size           uint64  `json:"size"`
	Device         int     `json:"device"`
	ConsumerDevice int     `json:"consumer_device"`
	Work           string  `json:"gpu_work"`
	Interprocess   bool    `json:"interprocess,omitempty"`
	Batches        uint64  `json:"handoffs"`
	Seconds        float64 `json:"seconds"`
	IssueSeconds   float64 `json:"issue_seconds"`
	DrainMS        float64 `json:"drain_ms"`
	PerS           float64 `json:"handoffs_per_s"`
	Checked        bool    `json:"checked"`
	Error          string  `json:"error,omitempty"`
	Exit           int     `json:"-"`
}

func main() {
	backend := flag.String("driver", driver.BackendAuto, "driver: auto, cuda or sim; CUDASHARE_DRIVER overrides it")
	dev := flag.Int("device", 0, "GPU of the ring and of stream P")
	cdev := flag.Int("consumer-device", -1, "GPU of stream C and its scratch buffer (default: -device)")
	ring := flag.Int("ring", 8, "buffers in the ring")
	sizeS := flag.String("size", "1MiB", "bytes per buffer: 1048576, 1MiB, 64MiB, ...")
	cp := flag.Bool("copy", true, "stream C copies each buffer into its scratch buffer; -copy=false: it only waits and records")
	ipcEv := flag.Bool("interprocess", false, "make the events interprocess ones (CU_EVENT_INTERPROCESS), as cudashare's are, to tell their cost from the rest of a handoff")
	secs := flag.Float64("seconds", 4, "length of the measured run")
	warmup := flag.Float64("warmup", 0.2, "seconds of batches before the measured run")
	asJSON := flag.Bool("json", false, "print one JSON line")
	flag.Parse()
	size, err := parseSize(*sizeS)
	if err != nil || *ring < 1 || *secs <= 0 || *warmup < 0 {
		fmt.Fprintln(os.Stderr, "limit: want -ring >= 1, -seconds > 0, -warmup >= 0, -size like 1MiB:", err)
		os.Exit(2)
	}
	if *cdev < 0 {
		*cdev = *dev
	}
	if *ipcEv && *cdev != *dev {
		// Measured on two H200s, driver 580.159.04 (2026-11-23): a stream on
		// one device waiting on an interprocess event that another device's
		// context of the same process recorded crashed inside the driver
		// (SIGSEGV in cuStreamWaitEvent). cudashare never does that: a peer
		// opens the other process's events from their IPC handles, in its
		// own context.
		fmt.Fprintln(os.Stderr, "limit: -interprocess needs -consumer-device equal to -device: across devices, in one process, the driver crashed waiting on an interprocess event of the other device's context (two H200s, driver 580)")
		os.Exit(2)
	}
	r := result{Impl: "limit", Mode: "ring", Ring: *ring, Size: size, Device: *dev, ConsumerDevice: *cdev, Work: "fill", Interprocess: *ipcEv}
	if *cp {
		r.Work = "fill+copy"
	}
	if err := run(&r, *backend, *cp, dur(*secs), dur(*warmup)); err != nil {
		r.Error = err.Error()
		if r.Exit == 0 {
			r.Exit = 1
		}
	}
	if *asJSON {
		b, _ := json.Marshal(&r)
		fmt.Println(string(b))
	} else if r.Error == "" {
		fmt.Printf("limit: %s driver, ring of %d x %d B, GPU %d -> %d, %s: %d batches in %.3fs (queued in %.3fs): %.0f/s\n",
			r.Driver, r.Ring, r.Size, r.Device, r.ConsumerDevice, r.Work, r.Batches, r.Seconds, r.IssueSeconds, r.PerS)
	}
	if r.Error != "" {
		fmt.Fprintln(os.Stderr, "limit:", r.Error)
	}
	os.Exit(r.Exit)
}

func dur(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

func parseSize(s string) (uint64, error) {
	m := regexp.MustCompile(`^(\d+)\s*([KMGkmg]?)(i?[Bb]?)$`).FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return 0, fmt.Errorf("size %q", s)
	}
	n, err := strconv.ParseUint(m[1], 10, 64)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("size %q", s)
	}
	return n << map[string]uint{"": 0, "k": 10, "m": 20, "g": 30}[strings.ToLower(m[2])], nil
}

// pattern is batch seq's fill byte.
func pattern(seq uint64) byte { return byte(seq%251) + 1 }

// cleanup runs deferred releases in reverse order and keeps the first error.
type cleanup []func() error

func (c *cleanup) add(f func() error) { *c = append(*c, f) }

func (c *cleanup) run() error {
	var first error
	for i := len(*c) - 1; i >= 0; i-- {
		if err := (*c)[i](); err != nil && first == nil {
			first = err
		}
	}
	return first
}

func run(r *result, backend string, doCopy bool, length, warmup time.Duration) (err error) {
	d, err := driver.Open(driver.Config{Backend: backend})
	if err != nil {
		r.Exit = 3
		return err
	}
	r.Driver, r.DriverReason = d.Backend(), d.Reason()
	n, err := d.DeviceCount()
	if err != nil {
		return err
	}
	if r.Device >= n || r.ConsumerDevice >= n || r.Device < 0 {
		r.Exit = 3
		return fmt.Errorf("GPU %d -> %d: this process sees %d GPU(s)", r.Device, r.ConsumerDevice, n)
	}
	var cl cleanup
	defer func() {
		if cerr := cl.run(); cerr != nil && err == nil {
			err = fmt.Errorf("release: %w", cerr)
		}
	}()

	devP, err := d.Device(r.Device)
	if err != nil {
		return err
	}
	ctxP, err := devP.RetainPrimaryContext()
	if err != nil {
		return err
	}
	cl.add(ctxP.Close)
	ctxC := ctxP
	if r.ConsumerDevice != r.Device {
		devC, err := d.Device(r.ConsumerDevice)
		if err != nil {
			return err
		}
		ok, err := devC.CanAccessPeer(devP)
		if err != nil {
			return err
		}
		if !ok {
			r.Exit = 6
			return fmt.Errorf("GPU %d has no peer access to GPU %d", r.ConsumerDevice, r.Device)
		}
		if ctxC, err = devC.RetainPrimaryContext(); err != nil {
			return err
		}
		cl.add(ctxC.Close)
		if err := ctxC.EnablePeerAccess(ctxP); err != nil && !errors.Is(err, driver.ErrPeerAccessAlreadyEnabled) {
			return fmt.Errorf("enable peer access %d -> %d: %w", r.ConsumerDevice, r.Device, err)
		}
	}

	evFlags := driver.EventDisableTiming
	if r.Interprocess {
		evFlags |= driver.EventInterprocess
	}
	bufs := make([]driver.DevicePtr, r.Ring)
	filled := make([]*driver.Event, r.Ring)
	consumed := make([]*driver.Event, r.Ring)
	for i := range bufs {
		if bufs[i], err = ctxP.Alloc(r.Size); err != nil {
			return fmt.Errorf("allocate the ring: %w", err)
		}
		p := bufs[i]
		cl.add(func() error { return ctxP.Free(p) })
		if filled[i], err = ctxP.NewEvent(evFlags); err != nil {
			return err
		}
		cl.add(filled[i].Close)
		if consumed[i], err = ctxC.NewEvent(evFlags); err != nil {
			return err
		}
		cl.add(consumed[i].Close)
	}
	scratch, err := ctxC.Alloc(r.Size)
	if err != nil {
		return fmt.Errorf("allocate the scratch buffer: %w", err)
	}
	cl.add(func() error { return ctxC.Free(scratch) })
	if err := ctxC.Memset(scratch, 0, r.Size); err != nil {
		return err
	}
	sP, err := ctxP.NewStream(true)
	if err != nil {
		return err
	}
	cl.add(sP.Close)
	sC, err := ctxC.NewStream(true)
	if err != nil {
		return err
	}
	cl.add(sC.Close)

	var seq uint64
	batch := func() error {
		i := seq % uint64(r.Ring)
		if seq >= uint64(r.Ring) {
			if err := sP.WaitEvent(consumed[i]); err != nil {
				return err
			}
		}
		if err := ctxP.MemsetAsync(bufs[i], pattern(seq), r.Size, sP); err != nil {
			return err
		}
		if err := filled[i].Record(sP); err != nil {
			return err
		}
		if err := sC.WaitEvent(filled[i]); err != nil {
			return err
		}
		if doCopy {
			if err := ctxC.CopyDtoDAsync(scratch, bufs[i], r.Size, sC); err != nil {
				return err
			}
		}
		if err := consumed[i].Record(sC); err != nil {
			return err
		}
		seq++
		return nil
	}
	syncBoth := func() error {
		if err := sC.Synchronize(); err != nil {
			return err
		}
		return sP.Synchronize()
	}

	// Warm up, drain, then the measured run: queue batches for length,
	// and count the time until the last has completed.
	for t := time.Now(); time.Since(t) < warmup || seq < uint64(r.Ring); {
		if err := batch(); err != nil {
			return fmt.Errorf("batch %d: %w", seq, err)
		}
	}
	if err := syncBoth(); err != nil {
		return err
	}
	first := seq
	t0 := time.Now()
	for time.Since(t0) < length {
		if err := batch(); err != nil {
			return fmt.Errorf("batch %d: %w", seq, err)
		}
	}
	issued := time.Since(t0)
	if err := syncBoth(); err != nil {
		return err
	}
	elapsed := time.Since(t0)
	r.Batches = seq - first
	r.Seconds = float64(elapsed.Microseconds()) / 1e6
	r.IssueSeconds = float64(issued.Microseconds()) / 1e6
	r.DrainMS = float64((elapsed - issued).Microseconds()) / 1e3
	r.PerS = float64(int64(float64(r.Batches)/elapsed.Seconds()*10)) / 10

	// Check: the last batch's byte, at both ends of what stream C last saw.
	last := seq - 1
	src, rctx := scratch, ctxC
	if !doCopy {
		src, rctx = bufs[last%uint64(r.Ring)], ctxP
	}
	b := make([]byte, 1)
	for _, off := range []uint64{0, r.Size - 1} {
		if err := rctx.CopyDtoH(b, src+driver.DevicePtr(off)); err != nil {
			return fmt.Errorf("read back: %w", err)
		}
		if b[0] != pattern(last) {
			return fmt.Errorf("read back byte %d of batch %d: %d, want %d", off, last, b[0], pattern(last))
		}
	}
	r.Checked = true
	return nil
}
