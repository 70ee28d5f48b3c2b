package pool

import (
	"sync/atomic"
	"time"
)

// Stats are a pool's counters: what its workers handled and how long
// their handlers ran. Busy over wall time and Workers is how busy the
// pool is; near 1, more workers (or a faster handler) would take more.
type Stats struct {
	Workers int
	Handled uint64        // leases handed to the handler
	Busy    time.Duration // time in the handler, all workers together
}

// counters are updated by the workers, lock-free: one clock read before
// and after each handler call, beside a handler's microseconds at least.
type counters struct {
	calls atomic.Uint64
	busy  atomic.Int64
}

func (c *counters) handled(start time.Time) {
	c.busy.Add(int64(time.Since(start)))
	c.calls.Add(1)
}

// Stats returns the pool's counters.
func (p *Pool) Stats() Stats {
	return Stats{Workers: p.cfg.Workers, Handled: p.stats.calls.Load(), Busy: time.Duration(p.stats.busy.Load())}
}
