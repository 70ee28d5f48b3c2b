//go:build linux

package share

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// consumer is one connected consumer, from its handshake until the
// exporter forgets it (dropLocked).
//
// What a consumer may map belongs to its connection: nothing is voided
// while the connection is open. After it ends, its leases and mappings are
// void at once if it said goodbye (or we did, after it closed
// everything), or if it held nothing; otherwise once every process that
// held the connection has exited, which unmapped everything. Those are
// the process that opened it and, if that one exits while the connection
// is still open (it handed the connection on, or forked), the processes
// found holding it then, and so on. If none can be found or watched, what
// the connection may map is never voided (PROTOCOL.md, section 7.1).
type consumer struct {
	e       *Exporter
	conn    *transport.Conn
	peer    transport.Peer
	watches []*procWatch // processes that held the connection; Exporter.mu
	proc    *procWatch   // the process that opened it (nil: unknown pid)
	// noEvents: its SO_PEERCRED pid reads 0, so its PID namespace is
	// neither this one nor below it (an ancestor's, or a sibling's: another
	// container), where the driver may refuse legacy IPC handles,
	// interprocess events included (PROTOCOL.md, section 4.1). Its offers
	// carry no event: the producer waits for the buffer's event on the
	// host before sending.
	noEvents bool
	who      identity // fixed at connect

	// Guarded by Exporter.mu.
	window, out uint64 // credits granted; offers not released
	slots       []leaseSlot
	freeSlots   []uint32
	voided      []voidedOffer                   // offers in flight that its loss or drop voided
	allocs      map[*allocRec]*mapping          // allocations it may map
	ringLeases  map[*Ring]int                   // its leases in each ring, all allocations of it together
	events      map[transport.Handle]*consEvent // its release events, opened once
	active      bool                            // in the rotation
	saidBye     bool                            // it said goodbye: everything it held is void
	byeReason   string                          // what its goodbye said
	sentBye     bool                            // we said goodbye after retiring everything
	ended       bool                            // its connection has ended
	handedOn    bool                            // it passed to other processes, which are watched
	unwatchable bool                            // it passed to processes that cannot be watched
	kicked      bool                            // the exporter dropped it for cause
	lagging     bool                            // it missed a broadcast, and has not had room since
	released    bool                            // it has released a lease: no newcomer (pickLocked)
	dropped     bool                            // forgotten: nothing it held counts
	abandoned   int                             // VMM buffers given up to it when it was lost
	obs         consumerCounters                // what Snapshot reports of it

	done chan struct{} // closed when its connection has ended

	// sendMu orders the offers of VMM allocations to it, so that the one
	// carrying an allocation's fd reaches it first (sendFD).
	sendMu sync.Mutex
}

// consEvent is a consumer's release event, opened in this process. A
// buffer released after it is not written again before its work is done.
// It is closed once its consumer is dropped and no buffer waits on it.
type consEvent struct {
	ev   *driver.Event
	refs int  // buffers whose next write waits on it, and waits under way
	dead bool // its consumer's processes are gone, or it said goodbye: nothing waits on it
	// orphan: its consumer was dropped while its processes may live; it is
	// still waited on, and closed once nothing refers to it.
	orphan bool
}

// MaxReleaseEvents bounds the distinct release events one consumer may use
// (PROTOCOL.md, section 4, release); one more is a limit error.
const MaxReleaseEvents = 64

// mapping is one consumer's use of one allocation.
type mapping struct {
	fdSent     bool   // the allocation's fd went out to it (consumer.sendMu)
	retireSent bool   // it was told to close it, and may answer closed
	leases     int    // its leases in the allocation
	bytes      uint64 // what those leases cover
}

// leaseSlot is an outstanding offer. seq = gen<<32 | index, so a release
// finds its buffer without a map and a stale seq does not match.
type leaseSlot struct {
	b   *Buffer
	gen uint32
	// sent: the offer's send finished and counted in Stats.Offers. A
	// consumer dropped while the send is in flight voids the lease, and
	// finishLocked settles the count.
	sent bool
	// epoch is the lease clock's reading when the offer was made; the
	// lease janitor compares it with the clock's.
	epoch uint64
	// at is Exporter.clock at the offer; warned: its holder was named in
	// the log for holding it past ExporterConfig.LeaseWarn.
	at     time.Duration
	warned bool
}

// voidedOffer is an offer whose lease the consumer's loss or drop voided
// while it was being sent; finishLocked ends it when the send returns.
type voidedOffer struct {
	seq uint64
	// vmm: a lost consumer's lease of a VMM buffer, not yet ended. The
	// consumer may read the buffer only if the send delivered the offer:
	// then finishLocked abandons the buffer; either way it ends the lease.
	vmm bool
}

// addOut changes the count of c's outstanding leases, and its process's
// and, while it takes offers, its class's (Exporter.newcomerOut). mu held.
func (c *consumer) addOut(d int) {
	c.out = uint64(int64(c.out) + int64(d))
	if c.active {
		*c.classOut() += d
	}
	if c.proc != nil {
		c.proc.leases += d
		if c.ended {
			c.proc.lost += d
		}
	}
}

// classOut is the exporter's count of the leases held by the consumers
// taking offers of c's class: newcomers, or those that have released.
// mu held.
func (c *consumer) classOut() *int {
	if c.released {
		return &c.e.policy.releasedOut
	}
	return &c.e.policy.newcomerOut
}

// loadLocked is what Offer compares to pick a consumer, lowest first:
// whether c's process holds leases through a connection that ended
// without a goodbye (they stay leased while it lives, as it may map them:
// a process that keeps connecting, taking buffers and hanging up gets a
// buffer only when no other consumer can take one), then the leases its
// process holds through all its connections.
func (c *consumer) loadLocked() (lost bool, leases uint64) {
	if c.proc != nil {
		return c.proc.lost > 0 || c.proc.abandoned > 0, uint64(c.proc.leases)
	}
	return false, c.out
}

// holdsLocked reports whether c holds a lease or may map an allocation.
func (c *consumer) holdsLocked() bool { return c.out > 0 || len(c.allocs) > 0 }

// Consumers returns the number of consumers taking offers now.
func (e *Exporter) Consumers() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.policy.consumers)
}

// WaitConsumers waits within ctx until at least n consumers take offers.
func (e *Exporter) WaitConsumers(ctx context.Context, n int) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for len(e.policy.consumers) < n {
		if e.closing {
			return ErrClosed
		}
		if err := e.waitLocked(ctx, &e.changed); err != nil {
			return err
		}
	}
	return nil
}

// Stats returns the exporter's counters.
func (e *Exporter) Stats() ExporterStats {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := e.stats
	s.Consumers = len(e.policy.consumers)
	s.Allocations = len(e.recs.byID)
	return s
}

func (e *Exporter) acceptLoop() {
	defer e.wg.Done()
	for {
		conn, err := e.ln.Accept(e.life)
		if err != nil {
			return
		}
		peer := conn.Peer()
		if err := e.refuse(peer.Caps); err != nil {
			e.log.Warn("share: refusing a consumer", "peer", peer.String(), "why", err)
			conn.CloseWithError(err)
			continue
		}
		c := &consumer{
			e: e, conn: conn, peer: peer,
			window: conn.Credits(),
			allocs: make(map[*allocRec]*mapping),
			// A broadcast asks per consumer: a ring of many VMM
			// allocations is one count, not a walk of allocs.
			ringLeases: make(map[*Ring]int),
			events:     make(map[transport.Handle]*consEvent),
			done:       make(chan struct{}),
			// Fixed for the connection: read without the lock.
			noEvents: peer.PID == 0,
			who:      readIdentity(peer.PID),
		}
		e.mu.Lock()
		if e.closing {
			e.mu.Unlock()
			ctx, cancel := context.WithTimeout(e.life, time.Second)
			conn.Shutdown(ctx, "producer shutting down")
			cancel()
			continue
		}
		c.obs.since = e.obs.now()
		e.watchLocked(c, int(peer.PID))
		e.conns[c] = struct{}{}
		e.policy.consumers = append(e.policy.consumers, c)
		c.active = true
		// The reader takes it in on its next pass.
		e.joining = append(e.joining, c)
		e.joined.Add(1)
		e.notifyLocked(&e.changed)
		e.notifyLocked(&e.creditWait)
		e.mu.Unlock()
		e.log.Info("share: consumer connected", "peer", peer.String(), "credits", c.window)
	}
}

// kick drops c for cause: it broke the protocol or held a lease too long.
// It is told why, and its connection ends; what it held is then handled
// as for any consumer lost without a goodbye.
func (e *Exporter) kick(c *consumer, why error) {
	e.mu.Lock()
	// An ended connection needs no kick: it was lost, or dropped by the
	// transport, and counted then (onGone), between the caller's pick
	// (the lease janitor's, Shutdown's) and this.
	first := !c.kicked && !c.ended
	if first {
		c.kicked = true
		e.stats.ConsumersDropped++
		c.obs.dropped = why.Error()
		e.deactivateLocked(c)
	}
	e.mu.Unlock()
	if first {
		e.log.Warn("share: dropping consumer", "peer", c.peer.String(), "why", why)
		c.conn.CloseWithError(why)
	}
}

// onRelease ends the leases the consumer released. A sequence number it
// does not hold (never sent, or released already) is a protocol error.
func (e *Exporter) onRelease(c *consumer, seqs []uint64, after *consEvent) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	defer e.notifyLocked(&e.creditWait)
	now := e.obs.now() // once for the batch
	for _, seq := range seqs {
		idx := uint32(seq)
		if int(idx) >= len(c.slots) || c.slots[idx].gen != uint32(seq>>32) || c.slots[idx].b == nil {
			return fmt.Errorf("%w: release of offer %d, which it does not hold (never sent, or released already)",
				transport.ErrUnexpectedMessage, seq)
		}
		if !c.released {
			// Its first release: its leases count with the others' now.
			if c.active {
				e.policy.newcomerOut -= int(c.out)
				e.policy.releasedOut += int(c.out)
			}
			c.released = true
		}
		s := &c.slots[idx]
		b := s.b
		s.b = nil
		c.freeSlots = append(c.freeSlots, idx)
		c.addOut(-1)
		e.stats.Releases++
		c.obs.releases++
		e.obs.handoff.observe(now - s.at)
		e.unmapLeaseLocked(c, b)
		if after != nil {
			b.waitAfterLocked(after)
			e.stats.OrderedReleases++
			c.obs.orderedReleases++
		}
		e.unleaseLocked(b)
	}
	return nil
}

// consumerEvent returns c's release event with handle h, opening it on
// first use.
func (e *Exporter) consumerEvent(c *consumer, h transport.Handle) (*consEvent, error) {
	e.mu.Lock()
	ce := c.events[h]
	n := len(c.events)
	e.mu.Unlock()
	if ce != nil {
		return ce, nil
	}
	if n >= MaxReleaseEvents {
		return nil, fmt.Errorf("%w: more than %d release events", transport.ErrLimit, MaxReleaseEvents)
	}
	ev, err := e.dctx.IpcOpenEventHandle(driver.IpcEventHandle(h))
	if err != nil {
		return nil, fmt.Errorf("%w: a release event that cannot be opened: %w", transport.ErrMalformed, err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.stats.ReleaseEventsOpened++
	ce = &consEvent{ev: ev}
	c.events[h] = ce
	e.cevents[ce] = struct{}{}
	if c.dropped {
		e.killEventLocked(ce)
	}
	return ce, nil
}

// killEventLocked marks a dropped consumer's event dead: nothing waits on
// it any more (its process, and its GPU work, are gone), and it is closed
// once no wait is under way. mu held.
func (e *Exporter) killEventLocked(ce *consEvent) {
	ce.dead = true
	e.unrefEventLocked(ce, 0)
}

// unrefEventLocked drops n references to ce, closing it if it is dead and
// unreferenced. mu held.
func (e *Exporter) unrefEventLocked(ce *consEvent, n int) {
	ce.refs -= n
	if (ce.dead || ce.orphan) && ce.refs == 0 && ce.ev != nil {
		if err := ce.ev.Close(); err != nil {
			e.log.Warn("share: closing a consumer's release event", "err", err)
		}
		ce.ev = nil
		delete(e.cevents, ce)
	}
}

// unmapLeaseLocked takes one of c's leases of b off its mapping's count.
func (e *Exporter) unmapLeaseLocked(c *consumer, b *Buffer) {
	if m := c.allocs[b.rec]; m != nil {
		m.leases--
		m.bytes -= b.size
		if r := b.rec.ring; r != nil {
			c.ringLeases[r]--
		}
	}
}

// onClosed takes the consumer's word that it closed its mapping of an
// allocation. The word is trusted only where it can be true: as the
// answer to a retire, with no lease of the consumer left in the
// allocation. Anything else is a protocol error: a consumer that says it
// closed memory it still holds may still be using it.
func (e *Exporter) onClosed(c *consumer, allocID uint64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	rec := e.recs.byID[allocID]
	var m *mapping
	if rec != nil {
		m = c.allocs[rec]
	}
	switch {
	case m == nil:
		return fmt.Errorf("%w: closed for allocation %d, which it was never offered or closed already", transport.ErrUnexpectedMessage, allocID)
	case !m.retireSent:
		return fmt.Errorf("%w: closed for allocation %d, which was not retired", transport.ErrUnexpectedMessage, allocID)
	case m.leases > 0:
		return fmt.Errorf("%w: closed for allocation %d while holding %d lease(s) in it", transport.ErrUnexpectedMessage, allocID, m.leases)
	}
	delete(c.allocs, rec)
	delete(rec.mappers, c)
	if rec.state != recLive && len(rec.mappers) == 0 {
		e.notifyLocked(&e.changed)
	}
	return nil
}

// deactivateLocked takes c out of the rotation.
func (e *Exporter) deactivateLocked(c *consumer) {
	if !c.active {
		return
	}
	*c.classOut() -= int(c.out)
	c.active = false
	if i := slices.Index(e.policy.consumers, c); i >= 0 {
		e.policy.consumers = slices.Delete(e.policy.consumers, i, i+1)
		if e.policy.rr > i {
			e.policy.rr--
		}
		if e.policy.rr >= len(e.policy.consumers) {
			e.policy.rr = 0
		}
	}
	e.notifyLocked(&e.changed)
	e.notifyLocked(&e.creditWait)
}
