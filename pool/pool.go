//go:build linux

package pool

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/share"
)

// Handler processes one lease. It must not keep the lease, its pointer or
// anything that refers to the leased memory after it returns: the pool
// releases the lease then. GPU work on the memory goes on the lease's
// stream (l.Stream(), ready for it); with Config.ReleaseAfter that work
// may still be queued when the handler returns, otherwise it must have
// been waited for. ctx ends with the pool's context, when a handler fails,
// and when the producer drops this consumer or vanishes (its leases are
// void then), but not at its goodbye. With share.ImporterConfig.Reconnect
// a vanished producer ends nothing: the workers go on with the leases of
// the producer that takes its place, and never get a lease whose memory
// died with its producer (legacy IPC: Lease.Err says ErrProducerGone,
// which a handler that holds one across the loss sees).
type Handler func(ctx context.Context, l *share.Lease) error

// Config configures a pool. The zero value is one worker whose leases are
// ready on the importer's stream, released when its handler returns.
type Config struct {
	// Workers is how many leases are worked on at once: one per worker
	// goroutine. 0 means 1; negative is an error.
	Workers int
	// Context, if not nil, gives each worker a stream of its own in it
	// (non-blocking, so it does not wait for the legacy NULL stream): the
	// worker's leases are made ready on it (Importer.NextOn) and a handler
	// queues its GPU work there (Lease.Stream), so that workers' GPU work
	// overlaps. It must be the importer's context.
	Context *driver.Context
	// ReleaseAfter releases each lease after the GPU work its handler
	// queued on the lease's stream (Lease.ReleaseAfter), with no host
	// wait: the producer's next write of the buffer waits for that work
	// on the GPU. Without it, the handler must have waited for its work.
	ReleaseAfter bool
	// ShutdownTimeout bounds the importer's shutdown once the workers are
	// done. It only waits for releases already made, so it is quick unless
	// the connection is stuck. 0 means 10s.
	ShutdownTimeout time.Duration
}

const defaultShutdownTimeout = 10 * time.Second

// PanicError is a handler panic turned into an error.
type PanicError struct {
	Value any    // what the handler panicked with
	Stack []byte // the handler goroutine's stack at the panic
}

func (e *PanicError) Error() string {
	return fmt.Sprintf("pool: handler panicked: %v\n%s", e.Value, e.Stack)
}

// Unwrap returns the panic value if it is an error.
func (e *PanicError) Unwrap() error {
	err, _ := e.Value.(error)
	return err
}

// Pool is a running set of workers; see Start.
type Pool struct {
	g       *errgroup.Group
	ctx     context.Context
	lost    context.Context         // ctx, or ended with the importer's error: the producer dropped this consumer or vanished
	lose    context.CancelCauseFunc // frees lost
	imp     *share.Importer
	cfg     Config
	streams []*driver.Stream
	done    chan struct{}
	err     error
	stats   counters // stats.go
}

// Start starts workers goroutines that take leases from imp and run h on
// each, until ctx is cancelled, a handler fails, or the producer goes
// away; it is StartWith with Config{Workers: workers}.
func Start(ctx context.Context, imp *share.Importer, workers int, h Handler) *Pool {
	return StartWith(ctx, imp, Config{Workers: max(workers, 1)}, h)
}

// Run is Start followed by Wait.
func Run(ctx context.Context, imp *share.Importer, workers int, h Handler) error {
	return Start(ctx, imp, workers, h).Wait()
}

// RunWith is StartWith followed by Wait.
func RunWith(ctx context.Context, imp *share.Importer, cfg Config, h Handler) error {
	return StartWith(ctx, imp, cfg, h).Wait()
}

// StartWith starts cfg.Workers goroutines that take leases from imp and
// run h on each, until ctx is cancelled, a handler fails, or the producer
// goes away. The errgroup's limit is the number of workers: one lease per
// worker is held at most, so the pool never takes more leases than it can
// work on.
func StartWith(ctx context.Context, imp *share.Importer, cfg Config, h Handler) *Pool {
	failed := func(err error) *Pool {
		p := &Pool{done: make(chan struct{}), err: err}
		close(p.done)
		return p
	}
	switch {
	case imp == nil || h == nil:
		return failed(errors.New("pool: Start with a nil importer or handler"))
	case cfg.Workers < 0:
		return failed(fmt.Errorf("pool: %d workers", cfg.Workers))
	case cfg.ShutdownTimeout < 0:
		return failed(errors.New("pool: negative ShutdownTimeout"))
	}
	cfg.Workers = max(cfg.Workers, 1)
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = defaultShutdownTimeout
	}
	var streams []*driver.Stream
	if cfg.Context != nil {
		for range cfg.Workers {
			s, err := cfg.Context.NewStream(true)
			if err != nil {
				for _, s := range streams {
					s.Close()
				}
				return failed(fmt.Errorf("pool: a stream for each worker: %w", err))
			}
			streams = append(streams, s)
		}
	}
	// The handlers' context also ends when the producer drops this
	// consumer or vanishes: their leases are void then, and a handler
	// busy for long (every worker holding a lease, none in Next) would
	// not learn it otherwise. A goodbye does not end it: the producer
	// waits for the leases it holds to be released.
	lost, lose := context.WithCancelCause(ctx)
	g, gctx := errgroup.WithContext(lost)
	g.SetLimit(cfg.Workers)
	go func() {
		select {
		case <-imp.Done():
			if err := imp.Err(); errors.Is(err, share.ErrProducerGone) && !errors.Is(err, io.EOF) {
				lose(err)
			}
		case <-gctx.Done():
		}
	}()
	p := &Pool{g: g, ctx: ctx, lost: lost, lose: lose, imp: imp, cfg: cfg, streams: streams, done: make(chan struct{})}
	for i := range cfg.Workers {
		w := worker{imp: imp, h: h, releaseAfter: cfg.ReleaseAfter, stats: &p.stats}
		if streams != nil {
			w.stream, w.own = streams[i], true
		}
		g.Go(func() error { return w.work(gctx) })
	}
	go p.finish()
	return p
}

// Wait waits for the workers and the importer's shutdown, and returns the
// first error: a handler's (or its panic's), the importer's (such as
// share.ErrProducerGone when the producer vanished), or ctx's. It returns
// nil when the producer said goodbye. Wait may be called more than once.
func (p *Pool) Wait() error {
	<-p.done
	return p.err
}

func (p *Pool) finish() {
	defer close(p.done)
	err := p.g.Wait()
	cerr := p.ctx.Err() // once: a cancel between two reads would lose both causes
	if err == nil {
		err = cerr
	}
	if cerr == nil && p.lost.Err() != nil && (err == nil || errors.Is(err, context.Canceled)) {
		// The workers saw their context end and left the cause to
		// whoever ended it: the importer. A handler that returned its
		// context's error (context.Canceled) says no more than that.
		err = context.Cause(p.lost)
	}
	defer p.lose(nil)
	sctx, cancel := context.WithTimeout(context.WithoutCancel(p.ctx), p.cfg.ShutdownTimeout)
	defer cancel()
	// The importer waits for the stream-ordered releases' work before it
	// closes the mappings; then the streams can go.
	if serr := p.imp.Shutdown(sctx); serr != nil && err == nil {
		err = fmt.Errorf("pool: importer shutdown: %w", serr)
	}
	for _, s := range p.streams {
		if cerr := s.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("pool: close a worker's stream: %w", cerr)
		}
	}
	p.err = err
}

// worker takes leases until the context ends or the importer has no more.
type worker struct {
	imp          *share.Importer
	h            Handler
	stream       *driver.Stream // its own, or nil: the importer's
	own          bool
	releaseAfter bool
	stats        *counters
}

func (w *worker) work(ctx context.Context) error {
	for {
		var l *share.Lease
		var err error
		if w.own {
			l, err = w.imp.NextOn(ctx, w.stream)
		} else {
			l, err = w.imp.Next(ctx)
		}
		if err != nil {
			switch {
			case ctx.Err() != nil:
				return nil // the cause is reported by whoever cancelled
			case errors.Is(err, io.EOF):
				return nil // the producer said goodbye
			}
			return err
		}
		if errors.Is(l.Err(), share.ErrProducerGone) {
			// Its producer went away (legacy IPC: the memory with it)
			// since Next handed it out: a handler never sees a dead
			// lease. With ImporterConfig.Reconnect the next lease is
			// the new producer's.
			l.Release()
			continue
		}
		var start time.Time
		timed := w.stats.timing.Load() // after the first Stats (stats.go)
		if timed {
			start = time.Now()
		}
		err = call(ctx, w.h, l)
		if timed {
			w.stats.handled(start)
		}
		var rerr error
		if w.releaseAfter && err == nil {
			rerr = l.ReleaseAfter(l.Stream())
		} else {
			// A handler that failed may have left anything queued: a
			// host wait is the safe end.
			if w.releaseAfter && l.Stream() != nil {
				rerr = l.Stream().Synchronize()
			}
			l.Release()
		}
		if err == nil && rerr != nil {
			err = fmt.Errorf("pool: release: %w", rerr)
		}
		if err != nil {
			return err
		}
	}
}

// call runs h, turning a panic into a *PanicError.
func call(ctx context.Context, h Handler, l *share.Lease) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = &PanicError{Value: r, Stack: debug.Stack()}
		}
	}()
	return h(ctx, l)
}
