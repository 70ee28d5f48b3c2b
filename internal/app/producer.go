package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/share"
)

const producerSummary = `Offers GPU buffers to consumer processes over a Unix socket, with no copy.

Each batch: take a buffer (one of a ring of reused buffers, or with -fresh a
new one from an arena), fill it on the GPU with a byte derived from the batch
number, record an interprocess event after the fill, and offer it. The buffer
comes back by itself once the consumer releases it. At the end (-count,
-duration, SIGINT or SIGTERM) the producer retires every buffer and frees it
only after every consumer has closed its mapping.

SIGHUP restarts it on purpose, in this process: the producer shuts down as at
the end, but its goodbye tells the consumers that it comes back (a consumer
with -reconnect waits for it, one without exits with code 9); then it opens a
new exporter at the same socket, a new session whose buffers are new, and
goes on with the batches (numbered from 0 again).
`

type producerConfig struct {
	backend         string
	device          int
	socket          string
	ring            int
	group           int
	size            uint64
	fresh           bool
	count           uint64
	duration        time.Duration
	consumers       int
	wait            time.Duration
	broadcast       bool
	event           bool
	fill            bool
	shutdownTimeout time.Duration
	leaseTimeout    time.Duration
	maxLeases       int
	writeTimeout    time.Duration
	shm             bool
	spin            time.Duration
	sharing         string
	reportEvery     time.Duration
	json            bool
	verbose         bool
	metrics         string // -metrics: where /metrics is served
}

// RunProducer runs the example producer with command-line args (without
// the program name) and returns its exit code. ctx ending (SIGINT, SIGTERM)
// stops the batches and shuts down gracefully.
func RunProducer(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg := producerConfig{size: 1 << 20}
	fs := newFlagSet("producer", producerSummary, stderr)
	fs.StringVar(&cfg.backend, "driver", driver.BackendAuto, "driver: auto (a GPU if there is one, else the simulator), cuda or sim; CUDASHARE_DRIVER overrides it")
	fs.IntVar(&cfg.device, "device", 0, "GPU to allocate on, as this process numbers them (CUDA_VISIBLE_DEVICES applies)")
	fs.StringVar(&cfg.socket, "socket", DefaultSocket(), "Unix socket to listen on; its directory is created with mode 0700")
	fs.IntVar(&cfg.ring, "ring", 8, "buffers in the ring; with -fresh, how many buffers fit in the arena at once")
	fs.IntVar(&cfg.group, "group", 1, "take, fill and offer batches this many at a time (at most -ring): on one GPU without MPS, the GPU then switches between this process's work and a consumer's once per group instead of once per batch")
	fs.Var(sizeFlag{&cfg.size}, "size", "bytes per buffer: 1MiB, 64MiB, 1GiB, ...")
	fs.BoolVar(&cfg.fresh, "fresh", false, "a fresh buffer per batch, sub-allocated from one arena of -ring buffers (no driver call per buffer; the consumer maps the arena once)")
	fs.Uint64Var(&cfg.count, "count", 0, "stop after this many batches (0: no limit)")
	fs.DurationVar(&cfg.duration, "duration", 0, "stop after this long, counted from when -consumers are connected (0: no limit)")
	fs.IntVar(&cfg.consumers, "consumers", 1, "wait for this many consumers before the first batch")
	fs.DurationVar(&cfg.wait, "wait", 0, "fail if -consumers have not connected within this long (0: wait until interrupted)")
	fs.BoolVar(&cfg.broadcast, "broadcast", false, "offer every batch to every connected consumer, instead of each batch to one")
	fs.BoolVar(&cfg.fill, "fill", true, "write each batch's pattern on the GPU; -fill=false offers buffers unwritten, with no GPU work and no event, to measure the handoff alone (pair it with the consumer's -verify none)")
	fs.BoolVar(&cfg.event, "event", true, "record an interprocess event after the fill, which the consumer's stream waits on; -event=false synchronizes on the host before each offer instead")
	fs.DurationVar(&cfg.shutdownTimeout, "shutdown-timeout", 30*time.Second, "at the end, how long to wait for consumers to release and unmap the buffers")
	fs.DurationVar(&cfg.leaseTimeout, "lease-timeout", share.DefaultLeaseTimeout, "drop a consumer that holds one batch longer than this (stopped or stuck), so that it cannot keep buffers from the others; negative: never")
	fs.IntVar(&cfg.maxLeases, "max-leases", 0, "most batches one consumer holds at once, below the credits it asks for, so that a slow consumer cannot take the whole ring (0: only its credits)")
	fs.DurationVar(&cfg.reportEvery, "report-every", 0, "print a JSON progress line (ProducerProgress: batches, consumers, leases, goroutines) to stdout this often, for scripts and tests watching a long run (0: none)")
	fs.DurationVar(&cfg.writeTimeout, "write-timeout", 0, "drop a consumer that leaves the producer's messages unread this long (0: the transport's default, 10s)")
	fs.StringVar(&cfg.sharing, "sharing", envOr("CUDASHARE_SHARING", "auto"), "how the buffers are shared: vmm (VMM allocations sent as file descriptors: work across containers, outlive the producer, never pinned by a lost consumer), ipc (legacy CUDA IPC handles), or auto (vmm where the device supports it); CUDASHARE_SHARING sets the default")
	fs.BoolVar(&cfg.shm, "shm", true, "carry each consumer's messages through the shm channel, memory shared with it, if it allows them, instead of on its socket (no system call per message while both sides are busy)")
	fs.DurationVar(&cfg.spin, "spin", 0, "with -shm, how long a receive polls a consumer's shm lane before it sleeps on the socket, while messages come about that often (0: the transport's default, 50µs; negative: never)")
	fs.BoolVar(&cfg.json, "json", false, "print one JSON line of results instead of the summary")
	fs.BoolVar(&cfg.verbose, "v", false, "log consumers arriving and leaving")
	fs.StringVar(&cfg.metrics, "metrics", "", "serve Prometheus metrics at http://ADDR/metrics (host:port; empty: none)")
	cpuprofile := cpuProfileFlag(fs)
	if code, done := parseFlags(fs, args, stdout); done {
		return code
	}
	switch {
	case cfg.ring < 1:
		fmt.Fprintln(stderr, "producer: -ring must be at least 1")
		return ExitUsage
	case cfg.group < 1 || cfg.group > cfg.ring:
		fmt.Fprintln(stderr, "producer: -group must be between 1 and -ring")
		return ExitUsage
	case cfg.size == 0:
		fmt.Fprintln(stderr, "producer: -size must be at least 1 byte")
		return ExitUsage
	case cfg.consumers < 0:
		fmt.Fprintln(stderr, "producer: -consumers must not be negative")
		return ExitUsage
	case cfg.leaseTimeout == 0:
		// 0 would mean the library's default, which is not what someone
		// who typed 0 meant.
		fmt.Fprintln(stderr, "producer: -lease-timeout must not be 0 (a negative value means no deadline)")
		return ExitUsage
	case cfg.maxLeases < 0:
		fmt.Fprintln(stderr, "producer: -max-leases must not be negative")
		return ExitUsage
	case cfg.reportEvery < 0:
		fmt.Fprintln(stderr, "producer: -report-every must not be negative")
		return ExitUsage
	case cfg.writeTimeout < 0:
		fmt.Fprintln(stderr, "producer: -write-timeout must not be negative")
		return ExitUsage
	}

	p := &producer{stdout: stdout, cfg: cfg, log: newLogger(stderr, "producer", cfg.verbose)}
	p.rep = ProducerReport{
		Role: "producer", Device: cfg.device, Socket: cfg.socket, Mode: "ring", Broadcast: cfg.broadcast,
		Event: cfg.event, Fill: cfg.fill, Size: cfg.size, Ring: cfg.ring, Group: cfg.group, MemUsedBefore: -1, MemUsedAfter: -1,
	}
	if cfg.fresh {
		p.rep.Mode = "fresh"
	}
	stopProfile, ok := startCPUProfile("producer", *cpuprofile, stderr)
	if !ok {
		return ExitUsage
	}
	defer stopProfile()
	err := p.run(ctx)
	if err != nil {
		p.rep.Error = err.Error()
		p.rep.Exit = exitCode(err)
		if p.rep.End == "" {
			p.rep.End = "error"
		}
	}
	if cfg.json {
		writeJSON(stdout, &p.rep)
	} else {
		p.summary(stdout)
		writeConsumerTable(stdout, p.rep.Consumers)
	}
	if err != nil {
		fmt.Fprintf(stderr, "producer: %v\n", err)
	}
	return p.rep.Exit
}

type producer struct {
	stdout io.Writer
	cfg    producerConfig
	log    *slog.Logger
	rep    ProducerReport
}

func (p *producer) run(ctx context.Context) error {
	dev, err := openDevice(p.cfg.backend, p.cfg.device)
	if err != nil {
		return fail(ExitNoDriver, nil, "%v", err)
	}
	// Releasing the primary context destroys it, and with it every
	// allocation in it, mapped by a consumer or not. After a Shutdown that
	// could not free everything, a consumer may still map what is left:
	// the context is then left to the process's exit (see below).
	keepContext := false
	defer func() {
		if !keepContext {
			dev.close()
		}
	}()
	p.rep.Driver, p.rep.DriverReason = dev.d.Backend(), dev.d.Reason()
	p.rep.DeviceUUID, p.rep.DeviceName = dev.dev.UUID().String(), dev.name
	p.rep.MemUsedBefore = memUsed(dev.ctx)

	// The fills go on a stream of their own; the offer records the
	// buffer's event on it, so the producer never waits for the GPU.
	stream, err := dev.ctx.NewStream(true)
	if err != nil {
		return fmt.Errorf("create a stream: %w", err)
	}
	defer stream.Close()

	sharing, err := share.ParseSharing(p.cfg.sharing)
	if err != nil {
		return err
	}
	// SIGHUP restarts the exporter on purpose (see producerSummary).
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	var cur atomic.Pointer[share.Exporter]
	if p.cfg.metrics != "" {
		// Scrapes follow the exporter of the moment (a SIGHUP makes a new one).
		stop, err := serveMetrics(p.cfg.metrics, currentExporter{&cur}, p.log)
		if err != nil {
			return err
		}
		defer stop()
	}
	if p.cfg.reportEvery > 0 {
		// No progress line may follow the final report.
		defer runLoop(func(done <-chan struct{}) { p.reportLoop(&cur, done) })()
	}
	var before share.ExporterStats // of the exporters before a restart
	var exp *share.Exporter
	var runErr, shutErr error
	var took time.Duration
	for {
		exp, err = share.NewExporter(ctx, dev.ctx, p.cfg.socket, share.ExporterConfig{
			Sharing:              sharing,
			Logger:               p.log,
			LeaseTimeout:         p.cfg.leaseTimeout,
			MaxLeasesPerConsumer: p.cfg.maxLeases,
			WriteTimeout:         p.cfg.writeTimeout,
			DisableShm:           !p.cfg.shm,
			ShmSpin:              p.cfg.spin,
		})
		if err != nil {
			return explainListen(p.cfg.socket, err)
		}
		cur.Store(exp)
		sh, why := exp.Sharing()
		p.rep.Sharing, p.rep.SharingWhy = sh.String(), why
		p.log.Info("listening", "socket", exp.Addr(), "driver", dev.d.Backend(), "device", p.cfg.device, "uuid", dev.dev.UUID(),
			"sharing", p.rep.Sharing, "why", p.rep.SharingWhy, "session", fmt.Sprintf("%#x", exp.Session()))

		// From here every path ends in Shutdown (or Restart): nothing is
		// freed while a consumer may still map it, and everything is freed
		// once none does.
		serveCtx, stopServe := context.WithCancel(ctx)
		var restart atomic.Bool
		go func() {
			select {
			case <-hup:
				restart.Store(true)
				stopServe()
			case <-serveCtx.Done():
			}
		}()
		runErr = p.serve(serveCtx, exp, dev.ctx, stream)
		stopServe()
		// Who held what at the end of serving, before the goodbyes.
		p.rep.Consumers = exp.Snapshot().Consumers
		if err := stream.Synchronize(); err != nil && runErr == nil {
			runErr = fmt.Errorf("synchronize the fill stream: %w", err)
		}
		restarting := restart.Load() && runErr == nil && ctx.Err() == nil
		sctx, cancel := context.WithTimeout(context.Background(), p.cfg.shutdownTimeout)
		t0 := time.Now()
		if restarting {
			shutErr = exp.Restart(sctx)
		} else {
			shutErr = exp.Shutdown(sctx)
		}
		cancel()
		took = time.Since(t0)
		if !restarting || shutErr != nil || exp.Stats().Allocations > 0 {
			break
		}
		before = addStats(before, exp.Stats())
		p.rep.Restarts++
		p.log.Info("restarting on SIGHUP: the consumers were told to come back; a new exporter takes the socket", "restarts", p.rep.Restarts)
	}
	p.rep.ShutdownSeconds = seconds(took)

	st := addStats(before, exp.Stats())
	p.rep.Offers, p.rep.Releases, p.rep.BytesOffered = st.Offers, st.Releases, st.BytesOffered
	p.rep.ConsumersLost, p.rep.Retired = st.ConsumersLost, st.Retired
	p.rep.ConsumersDropped, p.rep.BroadcastMissed = st.ConsumersDropped, st.BroadcastMissed
	p.rep.ConsumersFailed = st.ConsumersFailed
	p.rep.OrderedReleases = st.OrderedReleases
	p.rep.Abandoned, p.rep.Replaced = st.Abandoned, st.Replaced
	p.rep.AllocationsLeft, p.rep.LeasesLeft = st.Allocations, st.Leases
	p.rep.MemUsedAfter = memUsed(dev.ctx)
	keepContext = st.Allocations > 0

	var shutMsg error
	switch {
	case st.Allocations > 0:
		// The exporter never frees memory a consumer may still map; this
		// process does not destroy its context over it either. The driver
		// frees it once this process has exited and no process maps it.
		cause := fmt.Sprintf("shutdown failed after %.2fs", took.Seconds())
		if errors.Is(shutErr, context.DeadlineExceeded) {
			cause = fmt.Sprintf("consumers did not release and unmap the buffers within -shutdown-timeout %v", p.cfg.shutdownTimeout)
		}
		shutMsg = fail(ExitFailure, shutErr, "shutdown: %s; %d allocation(s) that a consumer may still map were not freed (%d lease(s) outstanding): this process exits without destroying its CUDA context, and the driver frees them once this process and every consumer that maps them have exited",
			cause, st.Allocations, st.Leases)
	case shutErr != nil:
		shutMsg = fail(ExitFailure, shutErr, "shutdown failed after %.2fs, although every allocation was freed", took.Seconds())
	}
	if runErr != nil {
		if shutMsg != nil {
			p.log.Error("after the failure, the shutdown failed too", "err", shutMsg)
		}
		return runErr
	}
	return shutMsg
}

// serve waits for the consumers and runs the batches until -count,
// -duration or ctx ends them.
func (p *producer) serve(ctx context.Context, exp *share.Exporter, dctx *driver.Context, stream *driver.Stream) error {
	// Allocate first, so that a GPU without room fails before anyone waits.
	var take func(context.Context) (*share.Buffer, error)
	betweenGroups := func(context.Context) {}
	if p.cfg.fresh {
		stride := (p.cfg.size + 255) &^ 255 // the arena aligns buffers to 256 bytes, as cuMemAlloc does
		arena, err := exp.NewArena(stride * uint64(p.cfg.ring))
		if err != nil {
			return p.allocFailed(err)
		}
		var retiring []*share.Arena
		take = func(ctx context.Context) (*share.Buffer, error) {
			b, err := arena.Alloc(ctx, p.cfg.size)
			if !errors.Is(err, share.ErrAbandoned) {
				return b, err
			}
			// Lost consumers may still read so much of the arena (VMM)
			// that a batch can never fit there again: a new arena takes
			// its place, and the old one is retired (its memory lives on
			// in those consumers until they exit).
			p.log.Warn("the arena is given up to lost consumers; a new one takes its place", "err", err)
			next, nerr := exp.NewArena(stride * uint64(p.cfg.ring))
			if nerr != nil {
				return nil, errors.Join(err, nerr)
			}
			// Retired once the batches of this group taken from it
			// are offered (betweenGroups).
			retiring = append(retiring, arena)
			arena = next
			p.rep.ArenasReplaced++
			return arena.Alloc(ctx, p.cfg.size)
		}
		betweenGroups = func(ctx context.Context) {
			for _, a := range retiring {
				if err := a.Retire(ctx); err != nil && ctx.Err() == nil {
					p.log.Warn("retiring an arena given up to lost consumers", "err", err)
				}
			}
			retiring = retiring[:0]
		}
	} else {
		ring, err := exp.NewRing(p.cfg.ring, p.cfg.size)
		if err != nil {
			return p.allocFailed(err)
		}
		// The fill goes on stream: a consumer's stream-ordered release is
		// waited for there, on the GPU, not on the host. Without a fill
		// nothing writes the buffer, and any wait is on the host.
		var fillOn *driver.Stream
		if p.cfg.fill {
			fillOn = stream
		}
		take = func(ctx context.Context) (*share.Buffer, error) { return ring.AcquireOn(ctx, fillOn) }
	}

	if n := p.cfg.consumers; n > 0 {
		wctx, cancel := ctx, context.CancelFunc(func() {})
		if p.cfg.wait > 0 {
			wctx, cancel = context.WithTimeout(ctx, p.cfg.wait)
		}
		err := exp.WaitConsumers(wctx, n)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				p.rep.End = "signal"
				return nil
			}
			return fail(ExitFailure, err, "only %d of %d consumer(s) connected to %s within -wait %v", exp.Consumers(), n, p.cfg.socket, p.cfg.wait)
		}
	}

	runCtx, cancel := ctx, context.CancelFunc(func() {})
	if p.cfg.duration > 0 {
		runCtx, cancel = context.WithTimeout(ctx, p.cfg.duration)
	}
	defer cancel()

	meta := make([]byte, 0, 64)
	group := make([]*share.Buffer, 0, p.cfg.group)
	// One clock reading per batch: the offer's, which its metadata carries
	// and which also marks the run's end (a second time.Now per batch was
	// 5% of this loop's CPU on the ring of 64).
	start, cpu0 := monoNow(), cpuNow()
	end := start
	p.rep.End = "count"
	for seq := uint64(0); p.cfg.count == 0 || seq < p.cfg.count; {
		// Take and Offer return at once when a buffer and a credit are
		// free, whatever the context: look at it before each group.
		if runCtx.Err() != nil {
			break
		}
		n := uint64(p.cfg.group)
		if p.cfg.count > 0 {
			n = min(n, p.cfg.count-seq)
		}
		betweenGroups(runCtx)
		group = group[:0]
		var err error
		for uint64(len(group)) < n && err == nil {
			var b *share.Buffer
			if b, err = take(runCtx); err == nil {
				group = append(group, b)
			} else {
				err = fmt.Errorf("take a buffer for batch %d: %w", seq+uint64(len(group)), err)
			}
		}
		if err == nil {
			if ferr := p.fillGroup(dctx, stream, group, seq); ferr != nil {
				// A driver failure, whatever the context says.
				for _, b := range group {
					b.Free()
				}
				return ferr
			}
		}
		for i, b := range group {
			if err == nil {
				now := monoNow()
				opts := share.OfferOptions{Meta: appendMeta(meta[:0], seq, now, b.Size())}
				if p.cfg.fill && p.cfg.event {
					opts.Stream = stream
				}
				if err = p.offer(runCtx, exp, b, opts); err == nil {
					p.rep.Batches++
					seq++
					end = now
				} else {
					err = fmt.Errorf("offer batch %d: %w", seq, err)
				}
			}
			// An arena buffer goes back to the arena once its consumers
			// release it, so it can be freed right after its offer. A ring
			// buffer comes back by itself; only one that was not offered
			// is handed back.
			if p.cfg.fresh || err != nil {
				b.Free()
			}
			group[i] = nil
		}
		if err != nil {
			if runCtx.Err() != nil {
				break
			}
			return err
		}
	}
	switch {
	case ctx.Err() != nil:
		p.rep.End = "signal"
	case runCtx.Err() != nil:
		p.rep.End = "duration"
	}
	if d := time.Duration(end - start); d > 0 {
		p.rep.Seconds = seconds(d)
		p.rep.BatchesPerS = round1(float64(p.rep.Batches) / d.Seconds())
	}
	p.rep.CPUusPerBatch = cpuPer(cpu0, p.rep.Batches)
	return nil
}

func (p *producer) allocFailed(err error) error {
	what := fmt.Sprintf("a ring of %d x %s", p.cfg.ring, FormatSize(p.cfg.size))
	if p.cfg.fresh {
		what = fmt.Sprintf("an arena for %d x %s", p.cfg.ring, FormatSize(p.cfg.size))
	}
	if errors.Is(err, driver.ErrOutOfMemory) {
		return fail(ExitFailure, err, "not enough free memory on GPU %d for %s: use a smaller -ring or -size", p.cfg.device, what)
	}
	return fail(ExitFailure, err, "cannot allocate %s on GPU %d", what, p.cfg.device)
}

// fillGroup fills the group's buffers with batches seq, seq+1, ... (see
// fill). It fills all of them before any is offered: the GPU then runs the
// group's fills together, and the consumers' work on them together.
func (p *producer) fillGroup(dctx *driver.Context, stream *driver.Stream, group []*share.Buffer, seq uint64) error {
	if !p.cfg.fill {
		return nil
	}
	for i, b := range group {
		if err := p.fill(dctx, stream, b, seq+uint64(i)); err != nil {
			return err
		}
	}
	return nil
}

// fill writes batch seq's pattern into b on the stream. Without -event the
// consumer gets no event to wait on, so the producer waits for the fill on
// the host before offering (what torch.multiprocessing users do with
// torch.cuda.synchronize()).
func (p *producer) fill(dctx *driver.Context, stream *driver.Stream, b *share.Buffer, seq uint64) error {
	if err := dctx.MemsetAsync(b.Ptr(), patternByte(seq), b.Size(), stream); err != nil {
		return fmt.Errorf("fill batch %d: %w", seq, err)
	}
	if !p.cfg.event {
		if err := stream.Synchronize(); err != nil {
			return fmt.Errorf("fill batch %d: %w", seq, err)
		}
	}
	return nil
}

// offer offers b to one consumer (or to all with -broadcast). A consumer can
// vanish between being picked and being sent the offer: the offer is then
// not made, and b goes to another consumer.
func (p *producer) offer(ctx context.Context, exp *share.Exporter, b *share.Buffer, opts share.OfferOptions) error {
	for {
		var err error
		if p.cfg.broadcast {
			var n int
			if n, err = exp.Broadcast(ctx, b, opts); err == nil && n > 0 {
				return nil
			}
		} else if err = exp.Offer(ctx, b, opts); err == nil {
			return nil
		}
		if err != nil && !consumerGone(err) {
			return err
		}
		p.log.Debug("the consumer went away before the offer; offering again", "err", err)
	}
}

// reportLoop prints a ProducerProgress line every -report-every until
// done: how a script (or the soak test) watches a long-running producer's
// consumers and whether anything grows that should not.
func (p *producer) reportLoop(cur *atomic.Pointer[share.Exporter], done <-chan struct{}) {
	start := time.Now()
	t := time.NewTicker(p.cfg.reportEvery)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			exp := cur.Load()
			if exp == nil {
				continue // not listening yet
			}
			st := exp.Stats()
			writeJSON(p.stdout, &ProducerProgress{
				Role: "producer-progress", Offers: st.Offers, Consumers: st.Consumers, Leases: st.Leases,
				ConsumersLost: st.ConsumersLost, ConsumersDropped: st.ConsumersDropped,
				Goroutines: runtime.NumGoroutine(), Seconds: seconds(time.Since(start)),
			})
		}
	}
}

func (p *producer) summary(w io.Writer) {
	r := &p.rep
	if r.Driver == "" {
		return
	}
	what := fmt.Sprintf("ring of %d", r.Ring)
	if r.Mode == "fresh" {
		what = "fresh from an arena"
	}
	if r.Broadcast {
		what += ", broadcast"
	}
	fmt.Fprintf(w, "producer: %s driver, GPU %d (%s)\n", r.Driver, r.Device, r.DeviceUUID)
	fmt.Fprintf(w, "producer: sharing %s: %s\n", r.Sharing, r.SharingWhy)
	fmt.Fprintf(w, "producer: %d batches of %s (%s) in %.2fs: %.0f batches/s, %s offered in %d offers; ended by %s\n",
		r.Batches, FormatSize(r.Size), what, r.Seconds, r.BatchesPerS, humanBytes(r.BytesOffered), r.Offers, r.End)
	fmt.Fprintf(w, "producer: consumers: %d lost (gone without a goodbye), %d dropped (stuck past a timeout, or a protocol error), %d failed (left with an error of their own, logged); %d broadcast offer(s) missed by a full backlog\n",
		r.ConsumersLost, r.ConsumersDropped, r.ConsumersFailed, r.BroadcastMissed)
	left := "none left"
	if r.AllocationsLeft > 0 {
		left = fmt.Sprintf("%d LEFT ALLOCATED", r.AllocationsLeft)
	}
	fmt.Fprintf(w, "producer: shut down in %.2fs: %d allocation(s) retired and freed, %s\n", r.ShutdownSeconds, r.Retired, left)
}

// addStats adds the counters of a later exporter to those of the ones
// before it (a restart); the gauges are the later one's.
func addStats(a, b share.ExporterStats) share.ExporterStats {
	b.Offers += a.Offers
	b.Releases += a.Releases
	b.BytesOffered += a.BytesOffered
	b.ConsumersLost += a.ConsumersLost
	b.ConsumersDropped += a.ConsumersDropped
	b.ConsumersFailed += a.ConsumersFailed
	b.BroadcastMissed += a.BroadcastMissed
	b.OrderedReleases += a.OrderedReleases
	b.Retired += a.Retired
	b.Abandoned += a.Abandoned
	b.Replaced += a.Replaced
	return b
}
