//go:build linux

package share

// This file is the offer policy: who takes the next offer (Offer), who
// can take a broadcast (Broadcast), and how much one consumer may hold.
// Its state is the exporter's policy, under Exporter.mu; the per-consumer
// counts it reads (out, window, released, ringLeases) are the consumer's.

// offerPolicy is the offer policy's state. Exporter.mu.
type offerPolicy struct {
	consumers []*consumer // taking offers, in round-robin order
	rr        int         // where the next round-robin scan starts
	maxLeases uint64      // ExporterConfig.MaxLeasesPerConsumer; 0: none
	// The leases held by consumers taking offers that have released none
	// yet (newcomers), and by those that have: pickLocked keeps newcomers
	// from taking what the others could use (consumer.released).
	newcomerOut, releasedOut int
}

// capLocked is how many leases c may hold at once.
func (e *Exporter) capLocked(c *consumer) uint64 {
	if e.policy.maxLeases > 0 {
		return min(c.window, e.policy.maxLeases)
	}
	return c.window
}

// pickLocked returns the consumer to offer to next, or nil if none can
// take a lease: of those below their cap, the one whose process holds the
// fewest leases, after every one whose process holds none through a lost
// connection (loadLocked), ties going round-robin. So a consumer that
// stops releasing stops being picked once it holds more than the others,
// and can never hold much more than its share of what is offered.
//
// A newcomer (a consumer that has released nothing yet) is passed over
// while the newcomers together hold as many leases as the consumers that
// have released, or more (at least one: newcomers may always hold one),
// unless no consumer that has released can take the lease. Holding
// nothing, a newcomer would otherwise beat a consumer that is releasing
// at every pick: a crowd of connections that take a buffer each and never
// release would take every buffer a releasing consumer returns. So the
// crowd holds at most about half of what is offered, a releasing consumer is
// served throughout, and a newcomer still gets its first lease as soon as
// the others hold more than the newcomers (a consumer merely slow to
// start is not starved). The passing over never makes Offer wait: a
// lease that only newcomers can take goes to one of them.
func (e *Exporter) pickLocked() *consumer {
	n := len(e.policy.consumers)
	// best: the pick; spare: the best newcomer passed over, taken when no
	// other can take the lease.
	var best, spare pick
	newcomers := e.policy.newcomerOut < max(e.policy.releasedOut, 1)
	for i := range n {
		j := e.policy.rr + i
		if j >= n {
			j -= n
		}
		c := e.policy.consumers[j]
		if c.out >= e.capLocked(c) {
			continue
		}
		if !c.released && !newcomers {
			spare.consider(c, j)
			continue
		}
		if best.consider(c, j) && !best.lost && best.load == 0 {
			break
		}
	}
	if best.c == nil {
		best = spare
	}
	if best.c != nil {
		e.policy.rr = best.at + 1
		if e.policy.rr == n {
			e.policy.rr = 0
		}
	}
	return best.c
}

// pick is pickLocked's best candidate so far.
type pick struct {
	c    *consumer
	at   int // its index in Exporter.consumers
	lost bool
	load uint64
}

// consider takes c, at index at, if it comes before the candidate so far,
// and reports whether it did.
func (p *pick) consider(c *consumer, at int) bool {
	lost, load := c.loadLocked()
	if p.c != nil && (lost && !p.lost || lost == p.lost && load >= p.load) {
		return false
	}
	*p = pick{c: c, at: at, lost: lost, load: load}
	return true
}

// takesLocked reports whether c can take a broadcast of b now.
func (e *Exporter) takesLocked(c *consumer, b *Buffer) bool {
	if !c.active || c.out >= e.capLocked(c) {
		return false
	}
	if len(e.policy.consumers) < 2 {
		return true
	}
	if r := b.rec.ring; r != nil {
		return 2*c.ringLeases[r] < len(r.bufs)
	}
	m := c.allocs[b.rec]
	if m == nil || m.leases == 0 {
		return true
	}
	switch rec := b.rec; {
	case rec.arena != nil:
		return 2*(m.bytes+b.size) <= rec.size
	}
	return true
}
