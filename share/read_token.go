//go:build linux

package share

import (
	"context"
	"errors"
	"sync/atomic"
	"time"
)

// handover passes the reading of a side's connections between the
// goroutines that wait for what they bring and a background reader: on
// the consumer's side one connection (Importer.Next waits for offers), on
// the producer's side every consumer's, through one transport's poller
// (Ring.Acquire, Offer, Broadcast, Arena.Alloc and Buffer.WaitOn wait for
// releases; exporter_read.go). One goroutine reads at a time: whoever
// takes the token.
//
//   - A goroutine that has to wait takes the token, if it is free, and
//     reads itself until what it waits for comes: no other goroutine is
//     woken and no thread is crossed per message, which is what the
//     handoff costs otherwise (bench/RESULTS.md: GOMAXPROCS=1 made it
//     1.4-2x faster on two H200s). It waits as before, for a goroutine
//     that reads, when the token is taken.
//   - The background reader takes the token once no wait has begun for
//     handoverAfter, so that what must be answered while nobody waits
//     (retires, goodbyes, a peer's end, releases that free a consumer's
//     credit) is, and gives it back as soon as a wait begins again: the
//     wait interrupts its receive (intr: connInterrupt, or the
//     Poller's Wake). Once stop is closed, it reads whenever the token is
//     free, until the connections end.
type handover struct {
	tok     chan struct{}
	begun   atomic.Uint64 // waits begun
	waiting atomic.Int32  // goroutines waiting now, reading or not
	bg      atomic.Bool   // the background reader holds the token
	intr    func()        // interrupts the connection's receive
}

// isClosed reports whether ch is closed; ch is never sent on. A one-case
// select with a default locks no channel that is empty and open.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// ctxEnded reports whether err, from a receive under ctx, is ctx's end
// (the connection stays usable) rather than the connection's.
func ctxEnded(ctx context.Context, err error) bool {
	return ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded))
}

// handoverAfter is how long no wait must begin before the background
// reader takes the connection.
const handoverAfter = time.Millisecond

func (h *handover) init(intr func()) {
	h.tok = make(chan struct{}, 1)
	h.tok <- struct{}{}
	h.intr = intr
}

// begin and end bracket a wait.
func (h *handover) begin() {
	h.begun.Add(1)
	h.waiting.Add(1)
	if h.bg.Load() {
		h.intr()
	}
}
func (h *handover) end() { h.waiting.Add(-1) }

// give gives the token back.
func (h *handover) give() { h.tok <- struct{}{} }

// wanted reports whether a wait has begun since seen (a count of begun),
// or one is under way.
func (h *handover) wanted(seen uint64) bool {
	return h.begun.Load() != seen || h.waiting.Load() > 0
}

// background runs the background reader until ended is closed. read reads
// the connection as the token's holder: until wanted, unless stopped, and
// then until the connection ends, which it reports.
func (h *handover) background(stop, ended <-chan struct{}, read func(stopped bool) (ended bool)) {
	t := time.NewTimer(handoverAfter)
	defer t.Stop()
	seen := h.begun.Load()
	pause := func() bool { // false once the connection has ended
		t.Reset(handoverAfter)
		select {
		case <-t.C:
			return true
		case <-stop:
			// Read from now on whenever the token is free.
			stop = nil
			t.Stop()
			return true
		case <-ended:
			return false
		}
	}
	for {
		stopped := stop == nil
		if n := h.begun.Load(); n != seen && !stopped {
			seen = n
			if !pause() {
				return
			}
			continue
		}
		// A handover without a new wait: take the token when it is free
		// (a wait reading since before then holds it until it ends).
		select {
		case <-h.tok:
		case <-stop:
			stop = nil
			continue
		case <-ended:
			return
		}
		// A swap, not a store: it must be ordered before the load of
		// waiting in wanted, as a wait's add is before its load of bg
		// (transport/ring.go, sleep, says why a store is not enough
		// under the race detector). One of the two sees the other.
		h.bg.Swap(true)
		if !stopped && h.wanted(seen) {
			// A wait is back, or wants the token: it reads.
			h.bg.Store(false)
			h.give()
			if !pause() {
				return
			}
			continue
		}
		end := read(stopped)
		h.bg.Store(false)
		h.give()
		if end {
			return
		}
	}
}
