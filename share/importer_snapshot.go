//go:build linux

package share

import (
	"cmp"
	"slices"
	"time"
)

// This file is what an operator sees of a consumer: its counters, what it
// maps, and how long it waited for the producer (Importer.Snapshot).

// ImporterSnapshot is a consistent picture of an importer, taken under
// its lock.
type ImporterSnapshot struct {
	Stats ImporterStats
	// Waiting is the time goroutines spent in Next waiting for an offer
	// (none queued), together, since the first Snapshot: a consumer that
	// waits a lot is starved by its producer, one that never waits keeps
	// the producer waiting. It is measured only once asked for: two clock
	// reads per wait cost a fast consumer measurably (bench/top-cost.sh).
	Waiting time.Duration
	// Path is how messages travel: "shm" (shared memory) or "socket".
	Path     string
	Mappings []MappingSnapshot // sorted by allocation
	// MappedBytes is the size of those mappings together.
	MappedBytes uint64
}

// MappingSnapshot is one allocation the importer maps.
type MappingSnapshot struct {
	Alloc   uint64 // the producer's allocation id
	Size    uint64
	Leases  int  // its leases queued or returned by Next
	Retired bool // the producer retired it; closed once no lease is in it
}

// waited adds the time since start to the time spent waiting in Next.
func (im *Importer) waited(start time.Time) {
	im.waitNanos.Add(int64(time.Since(start)))
}

// Snapshot returns the importer's counters, its mappings and the time
// spent waiting in Next.
func (im *Importer) Snapshot() ImporterSnapshot {
	im.timing.Store(true)
	s := ImporterSnapshot{Stats: im.Stats(), Waiting: time.Duration(im.waitNanos.Load()), Path: "socket"}
	if im.Shm() {
		s.Path = "shm"
	}
	im.mu.Lock()
	for _, a := range im.allocs {
		if a.closed {
			continue
		}
		var size uint64
		if a.ent != nil {
			size = a.ent.size
		}
		s.Mappings = append(s.Mappings, MappingSnapshot{Alloc: a.id, Size: size, Leases: a.leases, Retired: a.retired})
		s.MappedBytes += size
	}
	im.mu.Unlock()
	slices.SortFunc(s.Mappings, func(a, b MappingSnapshot) int { return cmp.Compare(a.Alloc, b.Alloc) })
	return s
}
