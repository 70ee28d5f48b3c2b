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

	"github.com/seed743c36cf/cudashare/share"
)

// Handler processes one lease. It must not keep the lease, its pointer or
// anything that refers to the leased memory after it returns: the pool
// releases the lease then. Work it queues on a stream must have been
// waited for, or be ordered before anything that reuses the memory.
type Handler func(ctx context.Context, l *share.Lease) error

// shutdownTimeout bounds the importer's shutdown after the workers are
// done. It only waits for releases the pool has already made, so it is
// quick unless the importer's connection is stuck.
const shutdownTimeout = 10 * time.Second

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
	g    *errgroup.Group
	ctx  context.Context
	imp  *share.Importer
	done chan struct{}
	err  error
}

// Start starts workers goroutines that take leases from imp and run h on
// each, until ctx is cancelled, a handler fails, or the producer goes
// away. The errgroup's limit is the number of workers: one lease per
// worker is held at most, so the pool never takes more leases than it can
// work on.
func Start(ctx context.Context, imp *share.Importer, workers int, h Handler) *Pool {
	if imp == nil || h == nil {
		p := &Pool{done: make(chan struct{}), err: errors.New("pool: Start with a nil importer or handler")}
		close(p.done)
		return p
	}
	if workers < 1 {
		workers = 1
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(workers)
	p := &Pool{g: g, ctx: ctx, imp: imp, done: make(chan struct{})}
	for range workers {
		g.Go(func() error { return work(gctx, imp, h) })
	}
	go p.finish()
	return p
}

// Run is Start followed by Wait.
func Run(ctx context.Context, imp *share.Importer, workers int, h Handler) error {
	return Start(ctx, imp, workers, h).Wait()
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
	if err == nil {
		err = p.ctx.Err()
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(p.ctx), shutdownTimeout)
	defer cancel()
	if serr := p.imp.Shutdown(sctx); serr != nil && err == nil {
		err = fmt.Errorf("pool: importer shutdown: %w", serr)
	}
	p.err = err
}

// work is one worker: it takes leases until the context ends or the
// importer has no more.
func work(ctx context.Context, imp *share.Importer, h Handler) error {
	for {
		l, err := imp.Next(ctx)
		if err != nil {
			switch {
			case ctx.Err() != nil:
				return nil // the cause is reported by whoever cancelled
			case errors.Is(err, io.EOF):
				return nil // the producer said goodbye
			}
			return err
		}
		err = call(ctx, h, l)
		if rerr := l.Release(); err == nil && rerr != nil {
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
