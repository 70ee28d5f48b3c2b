package pool

import (
	"sync/atomic"
	"time"
)

// Stats are a pool's counters since the first call to Pool.Stats: what
// its workers handled and how long their handlers ran. Busy over wall
// time and Workers is how busy the pool is; near 1, more workers (or a
// faster handler) would take more. Nothing is counted before it is asked
// for: two clock reads and two atomic adds per lease cost a fast consumer
// measurably (bench/top-cost.sh).
type Stats struct {
	Workers int
	Handled uint64        // leases handed to the handler
	Busy    time.Duration // time in the handler, all workers together
}

// counters are updated by the workers, lock-free, once timing is set.
type counters struct {
	calls  atomic.Uint64
	busy   atomic.Int64
	timing atomic.Bool // set by the first Stats
}

func (c *counters) handled(start time.Time) {
	c.busy.Add(int64(time.Since(start)))
	c.calls.Add(1)
}

// Stats returns the pool's counters, and starts counting on its first
// call: a handler call under way then is not counted.
func (p *Pool) Stats() Stats {
	p.stats.timing.Store(true)
	return Stats{Workers: p.cfg.Workers, Handled: p.stats.calls.Load(), Busy: time.Duration(p.stats.busy.Load())}
}
