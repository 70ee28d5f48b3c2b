//go:build linux

package share

// AllocatedBytes is the size of every allocation the exporter knows now
// (registered, rings and arenas) as it records them: a VMM allocation
// rounded up to the granularity, a cuMemAlloc one as asked (the driver's
// own rounding is not seen here: compare the device's free memory).
func AllocatedBytes(e *Exporter) uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	var n uint64
	for _, rec := range e.recs.byID {
		n += rec.size
	}
	return n
}
