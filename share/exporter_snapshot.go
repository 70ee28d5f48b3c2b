//go:build linux

package share

import (
	"cmp"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// This file is what an operator sees of a running producer: who holds
// what, since when (Exporter.Snapshot). The counters behind it are plain
// fields incremented under Exporter.mu where the code already holds it,
// so the hot path pays an increment and, per offer and per release, one
// read of the monotonic clock (vDSO, no system call): about 20 ns beside
// a handoff of microseconds, and what makes a stuck lease's age exact.

// ExporterSnapshot is a consistent picture of an exporter, taken under its
// lock. Durations are nanoseconds on the wire (PROTOCOL.md, section 9).
type ExporterSnapshot struct {
	PID     int    // the producer's process
	Socket  string // its socket's path
	Device  string // the UUID of the device it offers buffers of
	Sharing string // "vmm" or "ipc"
	// Uptime is how long the exporter has run, by the monotonic clock:
	// rates are differences of counters over differences of Uptime.
	Uptime   time.Duration
	UnixNano int64 // the wall clock when the snapshot was taken
	// LeaseTimeout drops a consumer holding a lease longer (negative:
	// none); LeaseWarn is when a lease's holder is named in the log.
	LeaseTimeout, LeaseWarn time.Duration
	Stats                   ExporterStats
	// Consumers are the connections not yet forgotten: those taking
	// offers, and those lost that still hold something. Sorted by leases
	// held, most first.
	Consumers []ConsumerSnapshot
	// Truncated counts consumers left out to keep the snapshot within
	// MaxSnapshotSize on the wire (the ones holding the fewest leases).
	Truncated int
	// Handoff is the time from each offer to its release, over every
	// lease released so far.
	Handoff Histogram
	// LeaseAges are the ages of the leases held now.
	LeaseAges Histogram
	Rings     []RingSnapshot
	Arenas    []ArenaSnapshot
}

// ConsumerSnapshot is one consumer's connection as the producer sees it.
type ConsumerSnapshot struct {
	// PID is the consumer's process as the kernel reports it in the
	// producer's PID namespace: 0 for one in a namespace the producer's
	// cannot see (another container).
	PID int32
	UID uint32
	// Comm is the executable's name (/proc/PID/comm); empty when unknown.
	Comm string
	// OtherPIDNamespace: its PID namespace is not the producer's (it
	// reads pid 0, or /proc/PID/ns/pid differs). Container: also its mount
	// namespace differs, as far as /proc says.
	OtherPIDNamespace, Container bool
	// Cgroup is its cgroup (v2 path), where it differs from the producer's.
	Cgroup string
	// Connected is how long ago it connected.
	Connected time.Duration
	// State: "active" (taking offers), "lagging" (missed a broadcast and
	// has had no room since), "dropped" (the producer dropped it for
	// cause, its memory not yet released), "lost" (its connection ended
	// without a goodbye while it held something), "left".
	State   string
	Credits uint64 // its window: the most leases it may hold
	Leases  int    // leases held now
	// OldestLease is the age of the oldest lease it holds, 0 with none.
	OldestLease time.Duration
	// OldestAlloc, OldestOffset, OldestSize name the buffer of that lease.
	OldestAlloc, OldestOffset, OldestSize uint64
	LeasedBytes                           uint64 // bytes its leases cover
	Allocations                           int    // allocations it may map
	MappedBytes                           uint64 // their sizes together
	Offers, BytesOffered                  uint64
	Releases, OrderedReleases             uint64
	// BroadcastMissed counts broadcasts it missed (backlog full).
	BroadcastMissed uint64
	// Dropped is why the producer ended its connection, if it did.
	Dropped string
	Path    string // how messages travel: "shm" (shared memory) or "socket"
	Sharing string // "vmm" or "ipc"
}

// RingSnapshot is one ring's occupancy.
type RingSnapshot struct {
	Alloc   uint64 // its first allocation's id
	Buffers int
	Free    int // ready to be acquired
	Leased  int // leased to consumers now
}

// ArenaSnapshot is one arena's occupancy.
type ArenaSnapshot struct {
	Alloc                 uint64
	Size, Free, Abandoned uint64 // bytes
}

// identity is who a consumer is, read from /proc once when it connects.
type identity struct {
	comm              string
	otherNS, otherMnt bool
	cgroup            string
}

// consumerCounters are a consumer's counters. Exporter.mu.
type consumerCounters struct {
	offers, bytesOffered      uint64
	releases, orderedReleases uint64
	broadcastMissed           uint64
	dropped                   string
	since                     time.Duration // Exporter.clock when it connected
}

// observation is what the exporter keeps for Snapshot beyond its
// counters: the origin of its monotonic clock, the lease timeout and
// warning threshold, and the handoff histogram. Exporter.mu (born,
// leaseTimeout and leaseWarn are fixed).
type observation struct {
	born                    time.Time
	leaseTimeout, leaseWarn time.Duration
	handoff                 Histogram
}

func newObservation(warn, leaseTimeout time.Duration) observation {
	return observation{born: time.Now(), leaseTimeout: leaseTimeout, leaseWarn: leaseWarnAfter(warn, leaseTimeout)}
}

// now is the exporter's monotonic clock: one vDSO read, no wall clock.
func (o *observation) now() time.Duration { return time.Since(o.born) }

// readIdentity reads what /proc says of pid. Off the hot path: once per
// connection, in the accept loop.
func readIdentity(pid int32) identity {
	if pid == 0 {
		return identity{otherNS: true, otherMnt: true}
	}
	p := "/proc/" + strconv.Itoa(int(pid))
	var id identity
	if b, err := os.ReadFile(p + "/comm"); err == nil {
		id.comm = strings.TrimSpace(string(b))
	} else if exe, err := os.Readlink(p + "/exe"); err == nil {
		id.comm = filepath.Base(exe)
	}
	differs := func(ns string) bool {
		mine, err1 := os.Readlink("/proc/self/ns/" + ns)
		theirs, err2 := os.Readlink(p + "/ns/" + ns)
		return err1 == nil && err2 == nil && mine != theirs
	}
	id.otherNS, id.otherMnt = differs("pid"), differs("mnt")
	mine, _ := os.ReadFile("/proc/self/cgroup")
	if theirs, err := os.ReadFile(p + "/cgroup"); err == nil && string(theirs) != string(mine) {
		id.cgroup = cgroupPath(string(theirs))
	}
	return id
}

// cgroupPath is the cgroup v2 path in a /proc/PID/cgroup ("0::/path"),
// else its first line.
func cgroupPath(s string) string {
	for line := range strings.Lines(s) {
		if p, ok := strings.CutPrefix(strings.TrimSpace(line), "0::"); ok {
			return p
		}
	}
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// Snapshot returns a consistent picture of the exporter: its counters, each
// consumer's identity and holdings, the handoff histogram, and the rings'
// and arenas' occupancy. It is taken under the exporter's lock, for a time
// linear in the leases outstanding, and copies everything: the caller may
// keep it.
func (e *Exporter) Snapshot() ExporterSnapshot {
	e.mu.Lock()
	defer e.mu.Unlock()
	now := e.obs.now()
	s := ExporterSnapshot{
		PID: os.Getpid(), Socket: e.ln.Addr(), Device: e.dev.String(), Sharing: e.sharing.String(),
		Uptime: now, UnixNano: time.Now().UnixNano(),
		LeaseTimeout: e.obs.leaseTimeout, LeaseWarn: e.obs.leaseWarn,
		Stats:   e.stats,
		Handoff: e.obs.handoff,
	}
	s.Stats.Consumers = len(e.policy.consumers)
	s.Stats.Allocations = len(e.recs.byID)
	s.Consumers = make([]ConsumerSnapshot, 0, len(e.conns))
	for c := range e.conns {
		if c.ended && !c.holdsLocked() && c.abandoned == 0 {
			continue // gone, holding nothing: not the operator's concern
		}
		s.Consumers = append(s.Consumers, e.consumerSnapshotLocked(c, now, &s.LeaseAges))
	}
	slices.SortFunc(s.Consumers, func(a, b ConsumerSnapshot) int {
		return cmp.Or(cmp.Compare(b.Leases, a.Leases), cmp.Compare(a.PID, b.PID), cmp.Compare(b.Connected, a.Connected))
	})
	var rings map[*Ring]bool
	for _, rec := range e.recs.byID {
		switch {
		case rec.ring != nil && !rings[rec.ring]:
			if rings == nil {
				rings = make(map[*Ring]bool)
			}
			rings[rec.ring] = true
			r := rec.ring
			rs := RingSnapshot{Alloc: r.rec.id, Buffers: len(r.bufs), Free: len(r.free)}
			for _, b := range r.bufs {
				if b.leases > 0 {
					rs.Leased++
				}
			}
			s.Rings = append(s.Rings, rs)
		case rec.arena != nil:
			a := rec.arena
			s.Arenas = append(s.Arenas, ArenaSnapshot{Alloc: rec.id, Size: rec.size, Free: a.spans.available(), Abandoned: a.lostBytes()})
		}
	}
	slices.SortFunc(s.Rings, func(a, b RingSnapshot) int { return cmp.Compare(a.Alloc, b.Alloc) })
	slices.SortFunc(s.Arenas, func(a, b ArenaSnapshot) int { return cmp.Compare(a.Alloc, b.Alloc) })
	return s
}

// consumerSnapshotLocked describes c at now, adding the ages of its
// leases to ages. mu held.
func (e *Exporter) consumerSnapshotLocked(c *consumer, now time.Duration, ages *Histogram) ConsumerSnapshot {
	cs := ConsumerSnapshot{
		PID: c.peer.PID, UID: c.peer.UID, Comm: c.who.comm,
		OtherPIDNamespace: c.who.otherNS, Container: c.who.otherNS && c.who.otherMnt, Cgroup: c.who.cgroup,
		Connected: now - c.obs.since,
		Credits:   c.window, Leases: int(c.out),
		Allocations: len(c.allocs),
		Offers:      c.obs.offers, BytesOffered: c.obs.bytesOffered,
		Releases: c.obs.releases, OrderedReleases: c.obs.orderedReleases,
		BroadcastMissed: c.obs.broadcastMissed, Dropped: c.obs.dropped,
		Path: "socket", Sharing: e.sharing.String(),
	}
	if c.conn.Shm() {
		cs.Path = "shm"
	}
	switch {
	case c.kicked:
		cs.State = "dropped"
	case c.ended && (c.saidBye || c.sentBye):
		cs.State = "left"
	case c.ended:
		cs.State = "lost"
	case c.lagging:
		cs.State = "lagging"
	default:
		cs.State = "active"
	}
	for rec, m := range c.allocs {
		cs.LeasedBytes += m.bytes
		cs.MappedBytes += rec.size
	}
	for i := range c.slots {
		sl := &c.slots[i]
		if sl.b == nil || !sl.sent {
			continue
		}
		age := now - sl.at
		ages.observe(age)
		if age > cs.OldestLease {
			cs.OldestLease = age
			cs.OldestAlloc, cs.OldestOffset, cs.OldestSize = sl.b.rec.id, sl.b.off, sl.b.size
		}
	}
	return cs
}
