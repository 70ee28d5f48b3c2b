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

// leaseJanitor drops consumers that hold a lease past the timeout (none
// if timeout <= 0), and names those that hold one past the warning
// threshold (none if warn < 0). The warning has a ticker of its own, at
// an eighth of its threshold: on the lease clock's ticks alone it came up
// to LeaseTimeout/8 late, and never without a lease timeout.
func (e *Exporter) leaseJanitor(timeout, warn time.Duration) {
	defer e.wg.Done()
	var lease, warning <-chan time.Time
	if timeout > 0 {
		t := time.NewTicker(max(timeout/leaseTicks, time.Millisecond))
		defer t.Stop()
		lease = t.C
	}
	if warn >= 0 {
		t := time.NewTicker(max(warn/leaseTicks, minWarnTick))
		defer t.Stop()
		warning = t.C
	}
	for {
		var stuck []*consumer
		var why []error
		select {
		case <-lease:
			e.mu.Lock()
			e.clock.epoch++
			stuck, why = e.overdueLocked(timeout)
			e.warnPinnedLocked(time.Now())
			e.mu.Unlock()
		case <-warning:
			e.mu.Lock()
			e.warnHeldLocked()
			e.mu.Unlock()
		case <-e.life.Done():
			return
		}
		for i, c := range stuck {
			e.kick(c, why[i])
		}
	}
}

// minWarnTick bounds how often the warning pass, which walks every lease
// under the exporter's lock, runs however small LeaseWarn is.
const minWarnTick = 10 * time.Millisecond

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
