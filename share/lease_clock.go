//go:build linux

package share

import (
	"fmt"
	"time"

	"github.com/seed743c36cf/cudashare/transport"
)

// This file is the lease deadline: a consumer that holds a lease past the
// producer's lease timeout is dropped.

// leaseTicks is how many ticks of the lease clock make the lease timeout:
// a lease is overdue between 1 and 1+1/leaseTicks timeouts after its
// offer, and the clock costs nothing per offer.
const leaseTicks = 8

// leaseClock is the lease deadline's clock: epoch counts the janitor's
// ticks, and each lease slot remembers the tick of its offer. Exporter.mu.
type leaseClock struct {
	epoch uint64
}

// leaseJanitor drops consumers that hold a lease past the timeout.
func (e *Exporter) leaseJanitor(timeout time.Duration) {
	defer e.wg.Done()
	t := time.NewTicker(max(timeout/leaseTicks, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-e.life.Done():
			return
		}
		e.mu.Lock()
		e.clock.epoch++
		stuck, why := e.overdueLocked(timeout)
		e.warnPinnedLocked(time.Now())
		e.warnHeldLocked()
		e.mu.Unlock()
		for i, c := range stuck {
			e.kick(c, why[i])
		}
	}
}

// overdueLocked returns the consumers that hold a lease past the timeout
// by the lease clock, each with the reason to drop it. mu held.
func (e *Exporter) overdueLocked(timeout time.Duration) (stuck []*consumer, why []error) {
	for c := range e.conns {
		if c.ended || c.kicked {
			continue
		}
		for i := range c.slots {
			s := &c.slots[i]
			if s.b != nil && s.sent && e.clock.epoch-s.epoch > leaseTicks {
				stuck = append(stuck, c)
				why = append(why, fmt.Errorf("%w: it held a lease (allocation %d, %d bytes at offset %d) longer than the producer's lease timeout of %v",
					transport.ErrTimeout, s.b.rec.id, s.b.size, s.b.off, timeout))
				break
			}
		}
	}
	return stuck, why
}
