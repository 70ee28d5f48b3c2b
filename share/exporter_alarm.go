//go:build linux

package share

import "time"

// This file is the early warning of a stuck consumer: before the lease
// timeout drops it, the log names who holds which buffer, once per lease.

// leaseWarnAfter resolves ExporterConfig.LeaseWarn against the lease
// timeout: half of it by default, never if negative.
func leaseWarnAfter(warn, timeout time.Duration) time.Duration {
	switch {
	case warn < 0:
		return -1
	case warn > 0:
		return warn
	case timeout > 0:
		return timeout / 2
	}
	return DefaultLeaseTimeout / 2
}

// warnHeldLocked names, in one log line per consumer and tick, the
// consumers holding leases past the warning threshold that were not named
// for them yet: the oldest such lease's buffer and how many there are. So
// each lease is reported once, and a consumer that holds a thousand
// leases writes one line, not a thousand. It runs on the lease janitor's
// warning ticks, so a warning comes up to LeaseWarn/8 (10ms at least)
// late. mu held.
func (e *Exporter) warnHeldLocked() {
	if e.obs.leaseWarn < 0 {
		return
	}
	now := e.obs.now()
	for c := range e.conns {
		if c.dropped {
			continue
		}
		var oldest *leaseSlot
		n := 0
		for i := range c.slots {
			s := &c.slots[i]
			if s.b == nil || !s.sent || s.warned || now-s.at < e.obs.leaseWarn {
				continue
			}
			s.warned = true
			n++
			if oldest == nil || s.at < oldest.at {
				oldest = s
			}
		}
		if oldest == nil {
			continue
		}
		e.log.Warn("share: a consumer holds a lease past the warning threshold",
			"pid", c.peer.PID, "comm", c.who.comm, "uid", c.peer.UID,
			"alloc", oldest.b.rec.id, "offset", oldest.b.off, "size", oldest.b.size,
			"held", (now - oldest.at).Round(time.Millisecond), "more_leases_past_threshold", n-1,
			"leases", c.out, "warn_after", e.obs.leaseWarn, "lease_timeout", e.obs.leaseTimeout)
	}
}
