//go:build linux

package share

// WarnHeld runs the lease janitor's warning pass now.
func WarnHeld(e *Exporter) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.warnHeldLocked()
}
