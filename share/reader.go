//go:build linux

package share

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/seed743c36cf/cudashare/transport"
)

// Who reads the connection.
//
// A goroutine waiting in Next with nothing queued reads the connection
// itself, instead of waiting for the background reader (recvLoop) to read
// an offer, queue its lease and wake it: that hop (a futex wake and a
// channel handoff) cost more than the rest of the handoff on a busy
// machine. One goroutine reads at a time, the holder of a token:
//
//   - a Next that finds nothing queued takes the token if it is free,
//     reads and acts on messages exactly as the background reader does,
//     and returns the first lease queued, leaving the others queued;
//   - the background reader takes the token back only when no Next has
//     read for handBack, so that retires, the goodbye and the producer's
//     end are still seen while the application is busy elsewhere; it
//     gives the token up after a message, when someone waits in Next;
//   - a Next that gives the token up while others wait in Next wakes one
//     of them to take it;
//   - whoever receives the connection's end records it and hands the
//     token to the background reader, which alone ends the importer
//     (onEnd), closes the connection and closes recvDone.
//
// A Next reading must return when its context ends or the importer stops:
// reads take a context of the reader's own (the transport arms it once,
// not per read), cancelled then and replaced.
type reader struct {
	im    *Importer
	tok   atomic.Int32
	turn  chan struct{}     // the token is free, for a goroutine waiting in Next
	bg    chan struct{}     // wakes the background reader to take the token
	msg   transport.Message // the token holder's
	err   error             // why the connection ended; set before ended
	ended atomic.Bool       // the connection ended: only the background reader takes the token

	recent atomic.Bool // a Next read since the hand-back timer was armed
	armed  atomic.Bool // the hand-back timer is armed
	timer  *time.Timer

	mu        sync.Mutex // guards what follows
	ctx       context.Context
	cancel    context.CancelFunc
	watchDone <-chan struct{} // the Done of the caller's context that interrupts reads
	watchStop func() bool
}

// Token holders.
const (
	tokFree = iota
	tokNext
	tokBG
)

// handBack is how long the connection stays unread, after a Next read
// it, before the background reader takes it.
const handBack = time.Millisecond

func (r *reader) init(im *Importer) {
	r.im = im
	r.tok.Store(tokBG) // the background reader starts reading
	r.turn = make(chan struct{}, 1)
	r.bg = make(chan struct{}, 1)
	r.timer = time.AfterFunc(time.Hour, r.handFired)
	r.timer.Stop()
}

// ctxFor returns the context to read with, after arranging that it is
// cancelled when caller's ends (nil: no caller).
func (r *reader) ctxFor(caller context.Context) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	if caller != nil {
		// Watch the caller's context; the watch stays for the next reads
		// of callers with the same context (a pool's workers): one
		// registration, not one per Next. A stale watch interrupts a read
		// spuriously, at most once, and the reader reads on.
		if d := caller.Done(); d != nil && d != r.watchDone {
			if r.watchStop != nil {
				r.watchStop()
			}
			r.watchDone = d
			r.watchStop = context.AfterFunc(caller, r.interrupt)
		}
	}
	if r.ctx == nil {
		r.ctx, r.cancel = context.WithCancel(context.Background())
	}
	return r.ctx
}

// interrupt makes the read in progress, if any, return.
func (r *reader) interrupt() {
	r.mu.Lock()
	if r.cancel != nil {
		r.cancel()
		r.ctx, r.cancel = nil, nil
	}
	r.mu.Unlock()
}

// stopTimers drops the timer and the watch once nothing reads anymore.
func (r *reader) stopTimers() {
	r.timer.Stop()
	r.mu.Lock()
	if r.watchStop != nil {
		r.watchStop()
		r.watchStop, r.watchDone = nil, nil
	}
	if r.cancel != nil {
		r.cancel()
		r.ctx, r.cancel = nil, nil
	}
	r.mu.Unlock()
}

func (r *reader) wakeBG() {
	select {
	case r.bg <- struct{}{}:
	default:
	}
}

func (r *reader) stopped() bool {
	select {
	case <-r.im.stop:
		return true
	default:
		return false
	}
}

// yield gives the token up: to a goroutine waiting in Next, else to the
// background reader within handBack, or at once if the importer stopped
// or the connection ended.
func (r *reader) yield() {
	r.tok.Store(tokFree)
	if r.ended.Load() || r.stopped() {
		r.wakeBG()
		return
	}
	if r.im.waiters.Load() > 0 {
		select {
		case r.turn <- struct{}{}:
		default:
		}
	}
	// Also when a waiter was woken: it may leave without reading.
	r.recent.Store(true)
	if !r.armed.Swap(true) {
		r.timer.Reset(handBack)
	}
}

// handFired wakes the background reader unless a Next read lately.
func (r *reader) handFired() {
	if r.recent.Swap(false) {
		r.timer.Reset(handBack)
		return
	}
	r.armed.Store(false)
	r.wakeBG()
}

// read reads and acts on one message with the token held; ok is false
// once the connection has ended (recorded for the background reader).
// An interrupted read returns ok with nothing done. With take, an offer's
// lease is returned unless others are queued (see onOffer).
func (r *reader) read(ctx context.Context, take bool) (l *Lease, ok bool) {
	err := r.im.conn.Recv(ctx, &r.msg)
	if err == nil {
		if l, err = r.im.handle(&r.msg, take); err == nil {
			return l, true
		}
	} else if ctx.Err() != nil && errors.Is(err, context.Canceled) {
		return nil, true
	}
	r.err = err
	r.ended.Store(true)
	return nil, false
}

// wait waits within ctx for a lease, reading the connection itself when
// no one else does.
func (im *Importer) wait(ctx context.Context) (*Lease, error) {
	r := &im.rd
	im.waiters.Add(1)
	for {
		if !r.ended.Load() && !r.stopped() && r.tok.CompareAndSwap(tokFree, tokNext) {
			l, err := im.readFor(ctx)
			if l != nil || err != nil {
				im.waiters.Add(-1)
				r.yield()
				return l, err
			}
			r.yield() // the importer stopped or the connection ended
		}
		// About to wait for the producer: what was released must reach
		// it first, or it may have no credit to offer with.
		im.push()
		select {
		case l := <-im.ready:
			im.waiters.Add(-1)
			return l, nil
		case <-im.stop:
			im.waiters.Add(-1)
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			im.mu.Lock()
			defer im.mu.Unlock()
			return nil, im.ended
		case <-ctx.Done():
			im.waiters.Add(-1)
			return nil, ctx.Err()
		case <-r.turn:
		}
	}
}

// readFor reads, with the token held, until a lease (or an offer's error)
// is queued, which it takes; ctx ends (its error); or the importer stops
// or the connection ends (neither).
func (im *Importer) readFor(ctx context.Context) (*Lease, error) {
	r := &im.rd
	for {
		select {
		case l := <-im.ready:
			return l, nil
		default:
		}
		// The context first, then the checks: an interruption between
		// them cancels the context read with.
		rctx := r.ctxFor(ctx)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if r.stopped() {
			return nil, nil
		}
		if !im.conn.Buffered() {
			// About to wait for the producer: what was released must
			// reach it first, or it may have no credit to offer with.
			// Not before: releases leave together while offers come in
			// faster than they are handled.
			im.push()
		}
		l, ok := r.read(rctx, true)
		if l != nil {
			// Others wait in Next: queue what is buffered already, so
			// that each is woken with its lease at once rather than in
			// turn, each taking the token to read the next.
			for ok && im.waiters.Load() > 1 && im.conn.Buffered() {
				_, ok = r.read(rctx, false)
			}
			return l, nil
		}
		if !ok {
			return nil, nil
		}
	}
}

// recvLoop is the background reader: it reads while it holds the token,
// and once the connection ends, ends the importer.
func (im *Importer) recvLoop() {
	defer close(im.recvDone)
	r := &im.rd
	for {
		if im.readBG() {
			break
		}
		for {
			<-r.bg
			if r.tok.CompareAndSwap(tokFree, tokBG) {
				break
			}
		}
	}
	// The token stays here: nothing reads anymore.
	r.ended.Store(true)
	im.onEnd(r.err)
	// Nothing comes after a goodbye; closing at once lets a producer that
	// lingers after its goodbye finish.
	im.conn.Close()
	r.stopTimers()
}

// readBG reads with the token held until the connection ends (true) or
// it gives the token to a goroutine waiting in Next (false).
func (im *Importer) readBG() bool {
	r := &im.rd
	for {
		if r.ended.Load() {
			return true
		}
		if _, ok := r.read(r.ctxFor(nil), false); !ok {
			return true
		}
		// Someone waits in Next (the lease just queued may be theirs):
		// they read from now on. Once stopped, no Next reads.
		if im.waiters.Load() > 0 && !r.stopped() {
			r.yield()
			return false
		}
	}
}
