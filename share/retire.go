//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/seed743c36cf/cudashare/transport"
)

// --- Retiring ----------------------------------------------------------------

// Retire retires the allocation that holds b, with every buffer in it:
// offers of them stop, every consumer that may map it is told, and once
// each has closed its mapping (or said goodbye, or its process exited) the
// allocation is freed if the exporter allocated it (a Ring or an Arena),
// or handed back to its owner (Register). It waits within ctx and never
// frees early: if ctx ends first it returns ctx's error and the
// retirement goes on; a later Retire or Shutdown finishes it.
func (e *Exporter) Retire(ctx context.Context, b *Buffer) error {
	if err := e.own(b); err != nil {
		return err
	}
	return e.retire(ctx, b.rec)
}

func (e *Exporter) retire(ctx context.Context, rec *allocRec) error {
	if err := e.startRetire(ctx, rec); err != nil {
		return err
	}
	return e.finishRetire(ctx, rec)
}

// startRetire stops offers of rec and tells its consumers.
func (e *Exporter) startRetire(ctx context.Context, rec *allocRec) error {
	e.mu.Lock()
	if rec.state == recLive {
		rec.state = recRetiring
		e.notifyLocked(&e.creditWait) // offers waiting for credit give up
		if rec.arena != nil {
			e.notifyLocked(&rec.arena.room)
		}
	}
	// An offer of rec between reservation and queueing would reach the
	// consumer after the retire: wait for those to leave first.
	for rec.sending > 0 {
		if err := e.waitLocked(ctx, &e.changed); err != nil {
			e.mu.Unlock()
			return err
		}
	}
	var targets []*consumer
	for c := range rec.mappers {
		if m := c.allocs[rec]; !m.retireSent && !c.ended {
			m.retireSent = true
			targets = append(targets, c)
		}
	}
	e.mu.Unlock()
	for _, c := range targets {
		if err := c.conn.SendRetire(ctx, rec.id); err != nil && ctx.Err() != nil {
			e.mu.Lock()
			if m := c.allocs[rec]; m != nil {
				m.retireSent = false // not queued: tell it on the next try
			}
			e.mu.Unlock()
			return err
		}
		// Any other error means the connection failed: c is dropped
		// once it is known to hold nothing.
	}
	return nil
}

// finishRetire waits until no consumer maps rec, then frees it.
func (e *Exporter) finishRetire(ctx context.Context, rec *allocRec) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for {
		switch {
		case rec.state == recFreed:
			return nil
		case rec.state == recRetiring && len(rec.mappers) == 0 && rec.sending == 0:
			rec.state = recFreeing
			e.mu.Unlock()
			var err error
			if rec.owned {
				err = e.freeMemory(rec)
			}
			e.mu.Lock()
			if err != nil {
				rec.state = recRetiring
				e.notifyLocked(&e.changed)
				return fmt.Errorf("share: free allocation %d at %#x: %w", rec.id, uint64(rec.base), err)
			}
			e.dropRecLocked(rec)
			return nil
		}
		if err := e.waitLocked(ctx, &e.changed); err != nil {
			return err
		}
	}
}

// dropRecLocked forgets a freed (or handed back) allocation.
func (e *Exporter) dropRecLocked(rec *allocRec) {
	rec.state = recFreed
	delete(e.recs.byID, rec.id)
	if e.recs.byBase[rec.base] == rec {
		delete(e.recs.byBase, rec.base)
	}
	for b := range rec.evBufs {
		e.eventPool = append(e.eventPool, b.ev)
		b.ev = nil
	}
	clear(rec.evBufs)
	if r := rec.ring; r != nil && !rec.quarantined && !r.deadClosed {
		r.deadClosed = true
		close(r.dead)
		e.wakeReaderLocked()
	}
	if a := rec.arena; a != nil {
		// Nothing will be allocated there again.
		for _, b := range a.pending {
			for _, ce := range b.after {
				e.unrefEventLocked(ce, 1)
			}
			b.after = nil
		}
		a.pending = nil
	}
	e.stats.Retired++
	e.notifyLocked(&e.changed)
}

// --- Ending -------------------------------------------------------------------

// Shutdown ends the exporter gracefully: it stops offering and accepting,
// retires every allocation, waits within ctx until every consumer has
// closed its mappings (or left), frees what the exporter allocated, says
// goodbye to each consumer and closes.
//
// If ctx ends first, it still says goodbye to every consumer that holds
// nothing (so that a well-behaved consumer is not told the producer
// crashed), drops the others with an error that says why, closes as Close
// does (never freeing what a consumer may map), and returns an error that
// matches ctx's and names what each blocking consumer still maps.
func (e *Exporter) Shutdown(ctx context.Context) error {
	e.mu.Lock()
	e.closing = true
	e.notifyLocked(&e.creditWait)
	e.notifyLocked(&e.changed)
	recs := slices.Collect(maps.Values(e.recs.byID))
	e.mu.Unlock()
	e.ln.Close()
	var err error
	for _, rec := range recs {
		if err = e.startRetire(ctx, rec); err != nil {
			break
		}
	}
	if err == nil {
		for _, rec := range recs {
			if err = e.finishRetire(ctx, rec); err != nil {
				break
			}
		}
	}
	var done, stuck []*consumer
	e.mu.Lock()
	if err != nil {
		if blockers := e.blockersLocked(recs); blockers != nil {
			err = fmt.Errorf("share: shutdown: %w; %w", err, blockers)
		}
	}
	for c := range e.conns {
		switch {
		case c.ended || c.kicked:
		case c.holdsLocked():
			stuck = append(stuck, c)
		default:
			c.sentBye = true
			done = append(done, c)
		}
	}
	bye, reason := e.goodbyeLocked()
	e.mu.Unlock()
	for _, c := range stuck {
		e.kick(c, fmt.Errorf("%w: the producer shut down before this consumer released its leases and closed its mappings", transport.ErrTimeout))
	}
	// The goodbyes go out even after ctx ended, briefly: they cost the
	// good consumers nothing and tell them the truth.
	byeCtx, cancel := ctx, context.CancelFunc(func() {})
	if ctx.Err() != nil {
		byeCtx, cancel = context.WithTimeout(context.Background(), goodbyeGrace)
	}
	defer cancel()
	// Say goodbye to all, then wait for each to close (a consumer closes
	// when it reads the goodbye): closing first could make a consumer's
	// last write fail before it has read the goodbye.
	for _, c := range done {
		c.conn.SendGoodbyeCode(byeCtx, bye, reason)
	}
	for _, c := range done {
		select {
		case <-c.done:
			continue
		case <-byeCtx.Done():
			if err == nil {
				err = fmt.Errorf("share: shutdown: waiting for consumers to read the goodbye: %w", byeCtx.Err())
			}
		}
		break
	}
	return errors.Join(err, e.Close())
}

// goodbyeGrace bounds the goodbyes of a Shutdown whose context ended.
const goodbyeGrace = time.Second

// Close ends the exporter at once: it stops listening and closes every
// connection without waiting for anything. It frees only the allocations
// it made that no consumer may still map; an allocation that a consumer
// may still map is never freed early: it stays allocated (and is logged)
// until the context is destroyed or the process exits. Use Shutdown to
// free everything. Close is idempotent.
func (e *Exporter) Close() error {
	var errs []error
	e.closeOnce.Do(func() {
		e.mu.Lock()
		e.closing = true
		close(e.done)
		e.wakeReaderLocked()
		conns := slices.Collect(maps.Keys(e.conns))
		e.mu.Unlock()
		e.ln.Close()
		e.cancel()
		for _, c := range conns {
			c.conn.Close()
		}
		e.wg.Wait()
		e.poll.Close()

		e.mu.Lock()
		defer e.mu.Unlock()
		for _, rec := range e.recs.byID {
			if rec.state == recFreed || rec.state == recFreeing {
				continue // a Retire in flight frees it
			}
			// A consumer's handle and mapping keep VMM memory alive by
			// themselves: only legacy IPC memory must outlive its mappers.
			if rec.vmm == nil && len(rec.mappers) > 0 || rec.sending > 0 {
				if rec.owned {
					e.log.Warn("share: Close leaves an allocation that a consumer may still map allocated",
						"alloc", rec.id, "base", fmt.Sprintf("%#x", uint64(rec.base)), "size", rec.size, "consumers", len(rec.mappers))
				}
				continue
			}
			if rec.owned {
				if err := e.freeMemory(rec); err != nil {
					errs = append(errs, fmt.Errorf("share: free allocation %d: %w", rec.id, err))
					continue
				}
			}
			e.dropRecLocked(rec)
		}
		for _, ev := range e.eventPool {
			if err := ev.ev.Close(); err != nil {
				errs = append(errs, err)
			}
		}
		e.eventPool = nil
		for ce := range e.cevents {
			if err := ce.ev.Close(); err != nil {
				errs = append(errs, err)
			}
			ce.ev = nil
		}
		clear(e.cevents)
	})
	return errors.Join(errs...)
}

// blockersLocked describes what keeps a retirement from finishing.
func (e *Exporter) blockersLocked(recs []*allocRec) error {
	var errs []error
	for _, rec := range recs {
		if rec.state == recFreed {
			continue
		}
		for c := range rec.mappers {
			m := c.allocs[rec]
			switch {
			case m == nil:
			case c.ended:
				errs = append(errs, fmt.Errorf("allocation %d may still be mapped by %s, lost without a goodbye (%d lease(s))", rec.id, c.peer.String(), m.leases))
			default:
				errs = append(errs, fmt.Errorf("allocation %d is still mapped by %s (%d lease(s), retire sent: %v)", rec.id, c.peer.String(), m.leases, m.retireSent))
			}
		}
	}
	return errors.Join(errs...)
}
