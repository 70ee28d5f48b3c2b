package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/metrics"
	"github.com/seed743c36cf/cudashare/pool"
	"github.com/seed743c36cf/cudashare/share"
)

const consumerSummary = `Connects to a producer and uses its GPU buffers in place, with no copy.

A pool of workers takes each batch as it arrives, checks its content on the
GPU side (a few bytes copied back from the shared buffer, compared with the
byte the producer derived from the batch number), and releases it. At the end
it prints handoffs per second, the handoff latency (from the producer's offer
to this process's receipt, on the host's monotonic clock), bytes and errors;
a live progress line when the output is a terminal.

With -read-test SIZE it measures instead how fast the GPU reads a shared
buffer against a local one of the same size: start the producer with
-size SIZE -ring 1 -count 1.
`

type consumerConfig struct {
	backend         string
	device          int
	socket          string
	workers         int
	credits         int
	verify          verifyMode
	count           uint64
	duration        time.Duration
	wait            time.Duration
	reconnect       time.Duration
	work            time.Duration
	readTest        uint64
	readReps        int
	shutdownTimeout time.Duration
	writeTimeout    time.Duration
	shm             bool
	spin            time.Duration
	json            bool
	progress        string
	reportEvery     time.Duration
	verbose         bool
	metrics         string // -metrics: where /metrics is served
}

// verifyMode is what -verify checks of a batch.
type verifyMode struct {
	name  string // every, byte, sample:N, none
	bytes int    // bytes copied back from each end (byte: one, from the start only)
	ends  int    // 2: the first and the last bytes; 1: the first only
	every uint64 // check batches whose number is a multiple of this; 0: none
	async bool   // -verify async: GPU work per batch, stream-ordered release
}

func parseVerify(s string) (verifyMode, error) {
	switch {
	case s == "every":
		return verifyMode{name: s, bytes: 16, ends: 2, every: 1}, nil
	case s == "byte":
		return verifyMode{name: s, bytes: 1, ends: 1, every: 1}, nil
	case s == "none":
		return verifyMode{name: s}, nil
	case s == "async":
		return verifyMode{name: s, async: true}, nil
	case strings.HasPrefix(s, "sample:"):
		n, err := strconv.ParseUint(strings.TrimPrefix(s, "sample:"), 10, 64)
		if err == nil && n > 0 {
			return verifyMode{name: s, bytes: 16, ends: 2, every: n}, nil
		}
	}
	return verifyMode{}, fmt.Errorf("-verify %q: want every, byte, sample:N (N >= 1), async or none", s)
}

func (v verifyMode) String() string { return v.name }

func (v *verifyMode) Set(s string) error {
	m, err := parseVerify(s)
	if err == nil {
		*v = m
	}
	return err
}

// RunConsumer runs the example consumer with command-line args (without
// the program name) and returns its exit code. ctx ending (SIGINT, SIGTERM)
// stops it gracefully: it releases what it holds and says goodbye.
func RunConsumer(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg := consumerConfig{}
	cfg.verify, _ = parseVerify("every")
	fs := newFlagSet("consumer", consumerSummary, stderr)
	fs.StringVar(&cfg.backend, "driver", driver.BackendAuto, "driver: auto (a GPU if there is one, else the simulator), cuda or sim; CUDASHARE_DRIVER overrides it")
	fs.IntVar(&cfg.device, "device", 0, "GPU to map the buffers on, as this process numbers them; another GPU than the producer's needs peer access")
	fs.StringVar(&cfg.socket, "socket", DefaultSocket(), "the producer's Unix socket")
	fs.IntVar(&cfg.workers, "workers", 2, "workers handling batches concurrently")
	fs.IntVar(&cfg.credits, "credits", 8, "most batches held at once, queued or in work: the producer never offers more")
	fs.Var(&cfg.verify, "verify", "check each batch's content: every (16 bytes at each end), byte (one byte, as the torch benchmark does), sample:N (every Nth batch), none; async: copy each batch into a local buffer on the worker's own stream, release it stream-ordered with no host wait, and check 16-byte samples in groups of 64 once an event query says their copy back is done (no host wait unless the GPU falls 192 batches behind; the report's async_waits counts those); with a producer in a PID namespace this one cannot see (another container), or one that does not take release events, interprocess events cannot be used and each release waits on the host for the copy")
	fs.Uint64Var(&cfg.count, "count", 0, "stop after this many batches (0: until the producer ends)")
	fs.DurationVar(&cfg.duration, "duration", 0, "stop after this long (0: until the producer ends)")
	fs.DurationVar(&cfg.wait, "wait", 0, "wait this long for the producer's socket to appear (0: fail at once if it is not there)")
	fs.DurationVar(&cfg.reconnect, "reconnect", 0, "keep going through a producer's restart: when the producer vanishes (killed, crashed) or restarts (SIGHUP), wait up to this long for a producer to listen at -socket again and go on with its batches; also wait this long for a first producer (0: off: end with exit code 5, or 9 at a restart)")
	fs.DurationVar(&cfg.work, "work", 0, "pretend each batch takes this long to process (holding its buffer)")
	fs.Var(sizeFlag{&cfg.readTest}, "read-test", "instead of consuming batches, time reading one shared buffer of this size against a local one (e.g. 1GiB)")
	fs.IntVar(&cfg.readReps, "read-reps", 21, "repeats of each read in -read-test; the median counts")
	fs.DurationVar(&cfg.shutdownTimeout, "shutdown-timeout", 10*time.Second, "at the end, how long to wait for the workers to release their batches")
	fs.DurationVar(&cfg.writeTimeout, "write-timeout", 0, "give up on a producer that leaves this consumer's messages unread this long (0: the transport's default, 10s)")
	fs.BoolVar(&cfg.shm, "shm", true, "carry the messages through the shm channel, memory shared with the producer, if it allows them, instead of on the socket (no system call per message while both sides are busy); the report's shm says which was used")
	fs.DurationVar(&cfg.spin, "spin", 0, "with -shm, how long a receive polls its shm lane before it sleeps on the socket, while messages come about that often (0: the transport's default, 50µs; negative: never)")
	fs.BoolVar(&cfg.json, "json", false, "print one JSON line of results instead of the summary")
	fs.StringVar(&cfg.progress, "progress", "auto", "live progress line: auto (when stdout is a terminal), on, off")
	fs.DurationVar(&cfg.reportEvery, "report-every", 0, "print a JSON progress line (ConsumerProgress) to stdout this often while consuming, for scripts and tests watching a long run (0: none)")
	fs.BoolVar(&cfg.verbose, "v", false, "log more")
	fs.StringVar(&cfg.metrics, "metrics", "", "serve Prometheus metrics at http://ADDR/metrics (host:port; empty: none)")
	cpuprofile := cpuProfileFlag(fs)
	if code, done := parseFlags(fs, args, stdout); done {
		return code
	}
	switch {
	case cfg.workers < 1:
		fmt.Fprintln(stderr, "consumer: -workers must be at least 1")
		return ExitUsage
	case cfg.credits < 1 || cfg.credits > share.MaxCredits:
		fmt.Fprintf(stderr, "consumer: -credits must be 1 to %d\n", share.MaxCredits)
		return ExitUsage
	case cfg.writeTimeout < 0:
		fmt.Fprintln(stderr, "consumer: -write-timeout must not be negative")
		return ExitUsage
	case cfg.reconnect < 0:
		fmt.Fprintln(stderr, "consumer: -reconnect must not be negative")
		return ExitUsage
	case cfg.reportEvery < 0:
		fmt.Fprintln(stderr, "consumer: -report-every must not be negative")
		return ExitUsage
	case cfg.readReps < 1:
		fmt.Fprintln(stderr, "consumer: -read-reps must be at least 1")
		return ExitUsage
	case cfg.progress != "auto" && cfg.progress != "on" && cfg.progress != "off":
		fmt.Fprintln(stderr, "consumer: -progress must be auto, on or off")
		return ExitUsage
	}

	c := &consumer{cfg: cfg, log: newLogger(stderr, "consumer", cfg.verbose), seen: make(map[driver.DevicePtr]struct{})}
	c.rep = ConsumerReport{
		Role: "consumer", Impl: "cudashare", Device: cfg.device, Socket: cfg.socket,
		Workers: cfg.workers, Credits: cfg.credits, Verify: cfg.verify.name,
	}
	c.bufs.New = func() any { b := make([]byte, 16); return &b }
	showProgress := !cfg.json && (cfg.progress == "on" || cfg.progress == "auto" && isTerminal(stdout))
	stopProfile, ok := startCPUProfile("consumer", *cpuprofile, stderr)
	if !ok {
		return ExitUsage
	}
	defer stopProfile()
	err := c.run(ctx, stdout, showProgress)
	c.finishReport(err)
	if cfg.json {
		writeJSON(stdout, &c.rep)
	} else {
		c.summary(stdout)
	}
	if c.rep.Error != "" {
		fmt.Fprintf(stderr, "consumer: %s\n", c.rep.Error)
	}
	return c.rep.Exit
}

type consumer struct {
	cfg consumerConfig
	log *slog.Logger
	rep ConsumerReport
	dev *device

	handoffs     atomic.Uint64
	verified     atomic.Uint64
	verifyErrors atomic.Uint64
	errs         atomic.Uint64
	bytes        atomic.Uint64
	lastSize     atomic.Uint64
	firstNS      atomic.Int64
	cpu0         atomic.Int64 // cpuNow at the first receipt
	lastNS       atomic.Int64
	hist         histogram
	bufs         sync.Pool // *[]byte of 16, for the bytes copied back
	async        asyncState

	imp      atomic.Pointer[share.Importer] // for the progress lines
	mu       sync.Mutex
	seen     map[driver.DevicePtr]struct{}
	stopWhy  string
	mappings uint64
}

func (c *consumer) run(ctx context.Context, stdout io.Writer, showProgress bool) error {
	dev, err := openDevice(c.cfg.backend, c.cfg.device)
	if err != nil {
		return fail(ExitNoDriver, nil, "%v", err)
	}
	defer dev.close()
	c.dev = dev
	c.rep.Driver, c.rep.DriverReason, c.rep.DeviceUUID = dev.d.Backend(), dev.d.Reason(), dev.dev.UUID().String()

	// The importer makes this stream wait on each batch's event from the
	// producer. It is a blocking stream, so the synchronous copies that
	// verify a batch (on the legacy NULL stream) are ordered after that wait
	// and see the producer's writes, with no host synchronization here.
	stream, err := dev.ctx.NewStream(false)
	if err != nil {
		return fmt.Errorf("create a stream: %w", err)
	}
	defer stream.Close()

	imp, err := c.dial(ctx, dev.ctx, stream)
	if err != nil {
		return err
	}
	c.imp.Store(imp)
	c.rep.ProducerDevice = producerDevice(imp)
	c.rep.SameDevice = c.rep.ProducerDevice == c.rep.DeviceUUID
	c.rep.SHM = imp.Shm()
	if peer := imp.Producer(); peer.PID == 0 {
		// SO_PEERCRED: the producer's PID namespace is above this one or
		// beside it (another container). No events travel either way.
		c.log.Info("connected; the producer runs in another PID namespace (its pid reads 0 here): the host waits for its writes and for this consumer's releases, no interprocess event is used", "producer", peer.String())
	} else {
		c.log.Debug("connected", "producer", peer.String())
	}
	if err := c.checkPeerAccess(imp); err != nil {
		imp.Close()
		return err
	}

	var runErr error
	if c.cfg.readTest > 0 {
		runErr = c.readTest(ctx, imp, stream)
	} else {
		runErr = c.consume(ctx, imp, stdout, showProgress)
	}

	// Graceful end: release what is queued, close every mapping, then say
	// goodbye, so that the producer may free its memory at once. (The pool
	// has done it already when it ran; Shutdown again is a no-op.)
	sctx, cancel := context.WithTimeout(context.Background(), c.cfg.shutdownTimeout)
	serr := imp.Shutdown(sctx)
	cancel()
	c.mappings = imp.Registry().Stats().Opens
	st := imp.Stats()
	c.rep.Reconnects, c.rep.ReleasesDropped = st.Reconnects, st.ReleasesDropped
	if runErr == nil && serr != nil {
		runErr = fmt.Errorf("shut down the importer: %w", serr)
	}
	return runErr
}

// dial connects to the producer, waiting up to -wait for it to appear
// (share.ImporterConfig.DialWait).
func (c *consumer) dial(ctx context.Context, dctx *driver.Context, stream *driver.Stream) (*share.Importer, error) {
	icfg := share.ImporterConfig{
		Credits: uint32(c.cfg.credits), Stream: stream, Logger: c.log, WriteTimeout: c.cfg.writeTimeout,
		DisableShm: !c.cfg.shm, ShmSpin: c.cfg.spin,
		DialWait: c.cfg.wait,
	}
	if c.cfg.reconnect > 0 {
		icfg.Reconnect = &share.ReconnectPolicy{Deadline: c.cfg.reconnect}
	}
	imp, err := share.Dial(ctx, c.cfg.socket, dctx, icfg)
	if err == nil {
		if c.cfg.metrics != "" {
			stop, err := serveMetrics(c.cfg.metrics, metrics.NewImporterCollector(imp), c.log)
			if err != nil {
				imp.Close()
				return nil, err
			}
			context.AfterFunc(ctx, stop)
		}
		return imp, nil
	}
	if ctx.Err() != nil {
		return nil, fail(ExitFailure, ctx.Err(), "interrupted while connecting to %s", c.cfg.socket)
	}
	return nil, explainDial(c.cfg.socket, err)
}

func producerDevice(imp *share.Importer) string {
	if devs := imp.Producer().Devices; len(devs) > 0 {
		return devs[0].String()
	}
	return ""
}

// checkPeerAccess fails early when this GPU cannot map the producer's. If
// the producer's GPU is hidden from this process (CUDA_VISIBLE_DEVICES),
// nothing can be asked: its handles still open (the driver maps memory of
// devices a process cannot see), and the first batch tells.
func (c *consumer) checkPeerAccess(imp *share.Importer) error {
	devs := imp.Producer().Devices
	if len(devs) == 0 || devs[0] == c.dev.dev.UUID() {
		return nil
	}
	pdev, err := c.dev.d.DeviceByUUID(devs[0])
	if err != nil {
		c.log.Debug("the producer's GPU is not visible here; its buffers should still open", "producer_device", devs[0])
		return nil
	}
	ok, err := c.dev.dev.CanAccessPeer(pdev)
	if err == nil && !ok {
		return c.noPeerAccess(nil, devs[0].String())
	}
	return nil
}

func (c *consumer) noPeerAccess(err error, producerDev string) error {
	return fail(ExitNoPeerAccess, err, "this consumer's GPU %d (%s) cannot map memory of the producer's GPU (%s): the two have no peer access; run the consumer on the producer's GPU (-device), or on one with peer access to it (`cudashare devices` lists the links)",
		c.cfg.device, c.dev.dev.UUID(), producerDev)
}

// consume runs the workers until the producer says goodbye, -count,
// -duration or ctx.
func (c *consumer) consume(ctx context.Context, imp *share.Importer, stdout io.Writer, showProgress bool) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := func(why string) {
		c.mu.Lock()
		if c.stopWhy == "" {
			c.stopWhy = why
		}
		c.mu.Unlock()
		cancel()
	}
	if c.cfg.duration > 0 {
		t := time.AfterFunc(c.cfg.duration, func() { stop("duration") })
		defer t.Stop()
	}
	if showProgress {
		// The line is erased before the summary is printed.
		defer runLoop(func(done <-chan struct{}) { c.progressLoop(stdout, done) })()
	}
	if c.cfg.reportEvery > 0 {
		// No progress line may follow the final report.
		defer runLoop(func(done <-chan struct{}) { c.reportLoop(stdout, done) })()
	}

	// The pool takes each lease as it arrives, runs the handler on it
	// and releases it; it ends on the producer's goodbye (nil), on wctx,
	// or on the first error, and then shuts the importer down.
	pcfg := pool.Config{Workers: c.cfg.workers}
	if c.cfg.verify.async {
		// Each worker's own stream; leases go back after the work queued
		// there, with no host wait.
		pcfg.Context, pcfg.ReleaseAfter = c.dev.ctx, true
	}
	var herr error
	var herrOnce sync.Once
	err := pool.RunWith(wctx, imp, pcfg, func(ctx context.Context, l *share.Lease) error {
		done, err := c.handle(ctx, l)
		if err != nil {
			herrOnce.Do(func() { herr = err })
			return err
		}
		if done {
			stop("count")
		}
		return nil
	})
	if c.cfg.verify.async {
		c.finishAsync()
	}
	if herr != nil {
		c.rep.End = "error"
		return fail(ExitFailure, herr, "-verify async: the GPU work on a batch failed")
	}

	c.mu.Lock()
	why := c.stopWhy
	c.mu.Unlock()
	switch {
	case why != "":
		c.rep.End = why
		return nil
	case ctx.Err() != nil:
		c.rep.End = "signal"
		return nil
	case errors.Is(err, share.ErrPeerAccessUnsupported), errors.Is(err, driver.ErrPeerAccessUnsupported):
		c.rep.End = "error"
		return c.noPeerAccess(err, c.rep.ProducerDevice)
	}
	end, err := explainEnd(c.cfg.socket, err, c.handoffs.Load())
	c.rep.End = end
	return err
}

// handle is one batch: note its latency, check its content, release it
// (with -verify async, queue its work and leave the release to the pool).
// It reports whether -count is reached.
func (c *consumer) handle(ctx context.Context, l *share.Lease) (bool, error) {
	recv := monoNow()
	if c.firstNS.CompareAndSwap(0, recv) {
		c.cpu0.Store(int64(cpuNow()))
	}
	seq, sent, ok := parseMeta(l.Meta())
	if ok {
		c.hist.record(recv - sent)
	} else {
		c.verifyErrors.Add(1)
		c.log.Error("a batch without this producer's metadata: cannot tell what it should hold", "seq", l.Seq(), "meta_bytes", len(l.Meta()))
	}
	c.bytes.Add(l.Size())
	c.lastSize.Store(l.Size())
	c.mu.Lock()
	if len(c.seen) < 1<<12 {
		c.seen[l.Ptr()] = struct{}{}
	}
	c.mu.Unlock()

	if c.cfg.verify.async {
		if err := c.handleAsync(l, seq, ok); err != nil {
			return false, err
		}
	} else if ok && c.cfg.verify.every > 0 && seq%c.cfg.verify.every == 0 {
		c.check(l, seq)
	}
	if c.cfg.work > 0 {
		// The pretended work ends with the pool: on a signal, or once
		// the producer has dropped this consumer, the process ends within
		// -shutdown-timeout, not after the work.
		t := time.NewTimer(c.cfg.work)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		if ok && !c.cfg.verify.async && c.cfg.verify.every > 0 && seq%c.cfg.verify.every == 0 {
			// Still the batch's bytes after the work: a lease outlives
			// anything its producer does meanwhile (killed, with VMM
			// sharing: this process's mapping keeps the memory; with
			// -reconnect, a new producer at the socket).
			c.recheck(l, seq)
		}
	}
	if !c.cfg.verify.async {
		// Release as soon as nothing reads the buffer any more (the checks
		// above were synchronous copies). The pool would release it after
		// the handler returns anyway; Release is idempotent.
		l.Release()
	}
	c.lastNS.Store(monoNow())
	n := c.handoffs.Add(1)
	return c.cfg.count > 0 && n >= c.cfg.count, nil
}

// recheck is check once more, counting only what is wrong: a lease that
// its producer's death voided (legacy IPC) is not wrong, it is gone.
func (c *consumer) recheck(l *share.Lease, seq uint64) {
	if errors.Is(l.Err(), share.ErrProducerGone) {
		return
	}
	c.compare(l, seq) // counted verified once, by the first check
}

// check copies a few bytes of the batch back from the GPU and compares
// them with the byte the producer filled it with.
func (c *consumer) check(l *share.Lease, seq uint64) {
	if c.compare(l, seq) {
		c.verified.Add(1)
	}
}

// compare reports whether the batch holds its bytes, counting what is
// wrong or unreadable.
func (c *consumer) compare(l *share.Lease, seq uint64) bool {
	want := patternByte(seq)
	bp := c.bufs.Get().(*[]byte)
	defer c.bufs.Put(bp)
	n := uint64(c.cfg.verify.bytes)
	n = min(n, l.Size())
	buf := (*bp)[:n]
	at := []driver.DevicePtr{l.Ptr(), l.Ptr() + driver.DevicePtr(l.Size()-n)}[:c.cfg.verify.ends]
	for _, p := range at {
		if err := c.dev.ctx.CopyDtoH(buf, p); err != nil {
			c.errs.Add(1)
			c.log.Error("cannot read a batch back from the GPU", "seq", seq, "ptr", fmt.Sprintf("%#x", uint64(p)), "err", err)
			return false
		}
		for i, b := range buf {
			if b != want {
				if c.verifyErrors.Add(1) <= 10 {
					c.log.Error("wrong batch content", "seq", seq, "offset", uint64(p-l.Ptr())+uint64(i), "got", b, "want", want)
				}
				return false
			}
		}
	}
	return true
}

func (c *consumer) progressLoop(w io.Writer, done <-chan struct{}) {
	const every = 250 * time.Millisecond
	t := time.NewTicker(every)
	defer t.Stop()
	var last uint64
	for {
		select {
		case <-done:
			fmt.Fprint(w, "\r\033[K")
			return
		case <-t.C:
			n := c.handoffs.Load()
			fmt.Fprintf(w, "\r\033[K  %d handoffs  %.0f/s now  %s offered  p50 %.0f µs  errors %d",
				n, float64(n-last)/every.Seconds(), humanBytes(c.bytes.Load()),
				float64(c.hist.quantile(0.5))/1e3, c.verifyErrors.Load()+c.errs.Load())
			last = n
		}
	}
}

// reportLoop prints a ConsumerProgress line every -report-every until done:
// how a script (or the soak test) sees that a long-running consumer is
// still being served, without waiting for its final report.
func (c *consumer) reportLoop(w io.Writer, done <-chan struct{}) {
	start := time.Now()
	t := time.NewTicker(c.cfg.reportEvery)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			p := ConsumerProgress{
				Role: "consumer-progress", Handoffs: c.handoffs.Load(), Bytes: c.bytes.Load(),
				VerifyErrors: c.verifyErrors.Load(), Errors: c.errs.Load(), Seconds: seconds(time.Since(start)),
				Goroutines: runtime.NumGoroutine(),
			}
			if imp := c.imp.Load(); imp != nil {
				p.Reconnects = imp.Stats().Reconnects
			}
			writeJSON(w, &p)
		}
	}
}

// readTest times reading a whole shared buffer against a local one of the
// same size on this GPU: device-to-device copies of each into a scratch
// buffer, synchronized, alternating, median of -read-reps samples.
func (c *consumer) readTest(ctx context.Context, imp *share.Importer, stream *driver.Stream) error {
	size := c.cfg.readTest
	l, err := imp.Next(ctx)
	if err != nil {
		if errors.Is(err, share.ErrPeerAccessUnsupported) {
			return c.noPeerAccess(err, c.rep.ProducerDevice)
		}
		return fail(ExitFailure, err, "no buffer from the producer for the read test")
	}
	defer l.Release()
	c.handle1(l)
	if l.Size() < size {
		return fail(ExitUsage, nil, "the producer's buffers are %s, smaller than -read-test %s: start the producer with -size %s -ring 1 -count 1",
			FormatSize(l.Size()), FormatSize(size), FormatSize(size))
	}
	// The producer's fill must be complete before anything is timed.
	if err := stream.Synchronize(); err != nil {
		return err
	}
	dctx := c.dev.ctx
	local, err := dctx.Alloc(size)
	if err != nil {
		return fail(ExitFailure, err, "cannot allocate the local %s buffer for the read test", FormatSize(size))
	}
	defer dctx.Free(local)
	scratch, err := dctx.Alloc(size)
	if err != nil {
		return fail(ExitFailure, err, "cannot allocate the %s scratch buffer for the read test", FormatSize(size))
	}
	defer dctx.Free(scratch)
	if err := dctx.Memset(local, 0x5a, size); err != nil {
		return err
	}
	s, err := dctx.NewStream(true)
	if err != nil {
		return err
	}
	defer s.Close()
	// copies times k copies of the whole buffer queued back to back, then
	// one synchronization, per copy: host timing costs a few microseconds,
	// which k copies make small against the copies themselves.
	copies := func(src driver.DevicePtr, k int) (time.Duration, error) {
		t0 := time.Now()
		for range k {
			if err := dctx.CopyDtoDAsync(scratch, src, size, s); err != nil {
				return 0, err
			}
		}
		err := s.Synchronize()
		return time.Since(t0) / time.Duration(k), err
	}
	// Warm both paths (the first use of a mapping may set up page
	// tables), then find k for samples of about 5 ms.
	k := 64
	for round := range 2 {
		for _, src := range []driver.DevicePtr{local, l.Ptr()} {
			d, err := copies(src, 1)
			if err != nil {
				return fmt.Errorf("read test: %w", err)
			}
			if round == 1 {
				k = max(1, min(k, int(5*time.Millisecond/max(d, 1))))
			}
		}
	}
	var lt, st []time.Duration
	for range c.cfg.readReps {
		// Alternate, so that a drift in clocks or load hits both alike.
		d, err := copies(local, k)
		if err != nil {
			return fmt.Errorf("read test: %w", err)
		}
		lt = append(lt, d)
		if d, err = copies(l.Ptr(), k); err != nil {
			return fmt.Errorf("read test: %w", err)
		}
		st = append(st, d)
	}
	lm, sm := median(lt), median(st)
	rt := &ReadTest{
		Size: size, Reps: c.cfg.readReps, CopiesPerRep: k,
		LocalMS:  float64(lm.Nanoseconds()/100) / 1e4,
		SharedMS: float64(sm.Nanoseconds()/100) / 1e4,
	}
	if lm > 0 && sm > 0 {
		rt.Ratio = float64(int(float64(sm)/float64(lm)*1000+0.5)) / 1000
		// A copy reads and writes size bytes each.
		rt.LocalGBs = round1(2 * float64(size) / lm.Seconds() / 1e9)
		rt.SharedGBs = round1(2 * float64(size) / sm.Seconds() / 1e9)
	}
	c.rep.ReadTest = rt
	c.rep.End = "read test done"
	return nil
}

// handle1 accounts for the read test's one batch and checks it.
func (c *consumer) handle1(l *share.Lease) {
	recv := monoNow()
	c.firstNS.Store(recv)
	c.lastNS.Store(recv)
	c.handoffs.Store(1)
	c.bytes.Store(l.Size())
	c.lastSize.Store(l.Size())
	c.seen[l.Ptr()] = struct{}{}
	if seq, sent, ok := parseMeta(l.Meta()); ok {
		c.hist.record(recv - sent)
		if c.cfg.verify.every > 0 {
			c.check(l, seq)
		}
	}
}

func median(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
	return s[len(s)/2]
}

func (c *consumer) finishReport(err error) {
	r := &c.rep
	r.Handoffs = c.handoffs.Load()
	r.Verified, r.VerifyErrors, r.Errors = c.verified.Load(), c.verifyErrors.Load(), c.errs.Load()
	r.Bytes, r.Size = c.bytes.Load(), c.lastSize.Load()
	r.BuffersSeen = len(c.seen)
	r.Mappings = c.mappings
	if first, last := c.firstNS.Load(), c.lastNS.Load(); first > 0 && last > first {
		d := time.Duration(last - first)
		r.Seconds = seconds(d)
		if r.Handoffs > 1 {
			// n handoffs span n-1 intervals between the first receipt and
			// the last release, roughly: count them all over the span.
			r.HandoffsPerS = round1(float64(r.Handoffs) / d.Seconds())
		}
	}
	r.P50us = round1(float64(c.hist.quantile(0.50)) / 1e3)
	r.P99us = round1(float64(c.hist.quantile(0.99)) / 1e3)
	r.MaxUS = round1(float64(c.hist.max.Load()) / 1e3)
	r.CPUusPerHandoff = cpuPer(time.Duration(c.cpu0.Load()), r.Handoffs)
	if err == nil && (r.VerifyErrors > 0 || r.Errors > 0) {
		err = fail(ExitFailure, nil, "%d batch(es) failed verification and %d could not be read back, of %d", r.VerifyErrors, r.Errors, r.Handoffs)
	}
	if err != nil {
		r.Error = err.Error()
		r.Exit = exitCode(err)
		if r.End == "" {
			r.End = "error"
		}
	}
}

func (c *consumer) summary(w io.Writer) {
	r := &c.rep
	if r.Driver == "" {
		return
	}
	where := "on the same GPU"
	if !r.SameDevice {
		where = "on GPU " + r.ProducerDevice
	}
	fmt.Fprintf(w, "consumer: %s driver, GPU %d (%s), producer's memory %s\n", r.Driver, r.Device, r.DeviceUUID, where)
	if r.ReadTest != nil {
		t := r.ReadTest
		fmt.Fprintf(w, "consumer: reading %s: local %.3f ms (%.0f GB/s), shared %.3f ms (%.0f GB/s), shared/local %.3f (median of %d samples of %d copies)\n",
			FormatSize(t.Size), t.LocalMS, t.LocalGBs, t.SharedMS, t.SharedGBs, t.Ratio, t.Reps, t.CopiesPerRep)
		return
	}
	fmt.Fprintf(w, "consumer: %d handoffs in %.2fs: %.0f/s, latency p50 %.1f µs, p99 %.1f µs (offer to receipt), %s offered, none copied\n",
		r.Handoffs, r.Seconds, r.HandoffsPerS, r.P50us, r.P99us, humanBytes(r.Bytes))
	fmt.Fprintf(w, "consumer: verify %s: %d verified, %d wrong, %d unreadable; %d buffer(s), %d mapping(s); ended: %s\n",
		r.Verify, r.Verified, r.VerifyErrors, r.Errors, r.BuffersSeen, r.Mappings, r.End)
	if r.Reconnects > 0 {
		fmt.Fprintf(w, "consumer: %d reconnection(s) to a producer that took the last one's place; %d release(s) of batches whose producer was gone went nowhere\n",
			r.Reconnects, r.ReleasesDropped)
	}
}
