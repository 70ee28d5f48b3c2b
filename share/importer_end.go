//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/seed743c36cf/cudashare/transport"
)

// This file is how an importer ends: the producer gone (its goodbye, the
// connection's end), Shutdown and Close, and the queued leases dropped on
// the way.

// dropQueuedLocked ends a lease that was never returned.
func (im *Importer) dropQueuedLocked(l *Lease) {
	if l.err != nil || l.a.closed {
		return
	}
	l.a.leases--
	if l.a.lost.Load() {
		im.stats.ReleasesDropped++
	} else {
		im.sendReleaseLocked(l.seq, nil)
	}
	if l.a.leases == 0 && (l.a.retired || l.a.lost.Load() || im.gone || im.state != stateOpen) {
		im.closeAllocLocked(l.a)
	}
}

// drainLocked drops every queued lease.
func (im *Importer) drainLocked() {
	for {
		select {
		case l := <-im.ready:
			im.dropQueuedLocked(l)
		default:
			return
		}
	}
}

// unholdLocked counts a lease returned no more, and wakes Shutdown with
// the last.
func (im *Importer) unholdLocked() {
	if im.held.Add(-1) == 0 && im.heldZero != nil {
		close(im.heldZero)
		im.heldZero = nil
	}
}

// endLocked stops Next with err.
func (im *Importer) endLocked(err error) {
	if im.ended == nil {
		// First: a handOut that does not see it is one that Shutdown
		// sees in held (handOut).
		im.ending.Store(true)
		im.ended = err
		close(im.stop)
		im.endLife() // a reconnection under way gives up
		// A Next that reads the connection returns (importer_read.go).
		connInterrupt(im.conn)
	}
}

// onEnd runs when the connection has ended: the producer is gone, or
// this side closed it.
func (im *Importer) onEnd(err error) {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.state == stateOpen && im.policy != nil && im.comesBack(err) {
		im.loseLocked(err)
		return
	}
	im.gone = true
	if im.state == stateOpen {
		switch {
		case err == io.EOF && im.byeCode == transport.GoodbyeRestarting:
			im.endLocked(fmt.Errorf("%w (goodbye: %q): %w", ErrProducerGone, im.byeWhy, ErrProducerRestarting))
		case err == io.EOF:
			im.endLocked(fmt.Errorf("%w (goodbye: %q): %w", ErrProducerGone, im.byeWhy, io.EOF))
		default:
			im.endLocked(fmt.Errorf("%w: %w", ErrProducerGone, err))
		}
	}
	im.drainLocked()
	// Mappings no lease is in close now; the others with their last
	// release. The producer's memory stays alive while mapped.
	for _, a := range im.allocs {
		if a.leases == 0 {
			im.closeAllocLocked(a)
		}
	}
}

// Shutdown ends the importer gracefully: Next stops returning leases
// (offers still arriving go back to the producer), Shutdown waits within
// ctx until every lease Next returned is released, closes every mapping,
// confirms the allocations the producer retired, says goodbye and closes
// the connection. Mappings are closed before the goodbye, so the producer
// may free its memory as soon as it reads it. If ctx ends first, Shutdown
// closes at once, as Close does, and returns ctx's error.
func (im *Importer) Shutdown(ctx context.Context) error {
	im.mu.Lock()
	if im.state == stateClosed {
		im.mu.Unlock()
		return nil
	}
	im.state = stateShutting
	im.endLocked(fmt.Errorf("share: importer shut down: %w", ErrClosed))
	im.drainLocked()
	for im.held.Load() > 0 {
		if im.heldZero == nil {
			im.heldZero = make(chan struct{})
		}
		w := im.heldZero
		im.mu.Unlock()
		select {
		case <-w:
		case <-ctx.Done():
			return errors.Join(ctx.Err(), im.Close())
		}
		im.mu.Lock()
	}
	im.mu.Unlock()
	return im.close(ctx, "consumer shut down")
}

// The producer's events that Next opened are destroyed by close, unless a
// Next or WaitOn may be using one then, without mu: then by the last of
// those, once done. Close never waits for them: one that waits on the host
// for the producer's GPU work may take as long as that work. Each counts
// itself in evUse (useEvent) before it looks whether the importer stopped
// (NextOn: ending, which endLocked sets; WaitOn: state, under mu), so one
// that did not see close begin is one that closeEvents sees in evUse.

func (im *Importer) useEvent() { im.evUse.Add(1) }

// doneWithEvent ends a useEvent; the last one after close began destroys
// the events. Sequentially consistent atomics: close stores evClosing and
// then loads evUse, this adds to evUse and then loads evClosing, so at
// least one of them sees the other and destroys (once: freeEvents).
func (im *Importer) doneWithEvent() {
	if im.evUse.Add(-1) == 0 && im.evClosing.Load() {
		if err := im.freeEvents(); err != nil {
			im.log.Error("share: destroying the producer's events failed", "err", err)
		}
	}
}

// closeEvents, from close, destroys the producer's events now unless a
// Next or WaitOn may be using one.
func (im *Importer) closeEvents() error {
	im.evClosing.Store(true)
	if im.evUse.Load() != 0 {
		if closeLeavesEvents != nil {
			closeLeavesEvents()
		}
		return nil
	}
	return im.freeEvents()
}

// freeEvents destroys the producer's events, once. No more are opened:
// the connection's reading has ended.
func (im *Importer) freeEvents() error {
	if !im.evFreed.CompareAndSwap(false, true) {
		return nil
	}
	im.mu.Lock()
	defer im.mu.Unlock()
	var err error
	for h, ev := range im.events {
		if cerr := ev.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
		delete(im.events, h)
	}
	for _, ev := range im.stale {
		err = errors.Join(err, ev.Close())
	}
	im.stale = nil
	return err
}

// Close ends the importer without waiting for leases: every mapping is
// closed, including those of leases not yet released (their pointers are
// invalid from now on; their Release does nothing), the producer is told
// goodbye (Close waits at most a second for it to read it and hang up) and
// the connection is closed. Close never waits for GPU work: a Next that is
// waiting on the producer's event meanwhile returns its lease, invalid like
// the others, and the producer's events are destroyed once it is done.
// Close is idempotent.
func (im *Importer) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	return im.close(ctx, "consumer closed")
}

func (im *Importer) close(ctx context.Context, reason string) error {
	im.mu.Lock()
	if im.state == stateClosed {
		recvDone, bgDone, reconDone := im.recvDone, im.bgDone, im.reconDone
		im.mu.Unlock()
		<-recvDone
		<-bgDone
		if reconDone != nil {
			<-reconDone
		}
		return nil
	}
	im.state = stateClosed
	im.endLocked(fmt.Errorf("share: importer closed: %w", ErrClosed))
	im.drainLocked()
	for _, a := range im.allocs {
		im.closeAllocLocked(a)
	}
	for a := range im.lost {
		im.closeAllocLocked(a)
	}
	gone := im.gone
	im.gone = true // nothing more is sent but the goodbye
	// No reconnection replaces them once the state is closed.
	conn, recvDone, bgDone, reconDone := im.conn, im.recvDone, im.bgDone, im.reconDone
	im.mu.Unlock()
	var err error
	if !gone {
		// Every mapping is closed: the goodbye lets the producer free. Stay
		// connected until the producer has read it and closed (or ctx
		// ends), so that its writes meanwhile cannot fail and lose the
		// goodbye, which would make it wait for this process to exit.
		if serr := conn.SendGoodbye(ctx, reason); serr == nil {
			select {
			case <-recvDone:
			case <-ctx.Done():
			}
		} else if !errors.Is(serr, transport.ErrClosed) && !errors.Is(serr, transport.ErrDisconnected) {
			err = serr
		}
	}
	conn.Close()
	im.pushTimer.Stop()
	<-recvDone
	<-bgDone
	if reconDone != nil {
		<-reconDone
	}
	err = errors.Join(err, im.closeEvents())
	im.mu.Lock()
	im.syncReleasesLocked()
	for s, r := range im.relEvs {
		if cerr := r.ev.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
		delete(im.relEvs, s)
	}
	im.mu.Unlock()
	return err
}
