//go:build linux

package share

import (
	"github.com/seed743c36cf/cudashare/driver"
)

// SettleMissesInFlight plays, on b, this interleaving: settle A (modelled:
// it holds ev1 in b.settling) is under way; ev2 lands in b.after; a real
// settle B comes, takes ev2 and is held in its wait (settleWaiting); A
// ends. It reports whether a settle C coming then would wait for ev2 too
// (false: C would return at once and let a write land under ev2's work).
func SettleMissesInFlight(e *Exporter, b *Buffer, ev1, ev2 *driver.Event) (cWaitsForEv2 bool) {
	e.mu.Lock()
	ce1, ce2 := &consEvent{ev: ev1, refs: 1}, &consEvent{ev: ev2, refs: 1}
	b.settling = append(b.settling[:0], ce1) // A's, under way
	b.settlers++
	b.after = append(b.after[:0], ce2)
	e.mu.Unlock()
	waiting, release := make(chan struct{}), make(chan struct{})
	settleWaiting = func() { close(waiting); <-release }
	defer func() { settleWaiting = nil }()
	done := make(chan error, 1)
	go func() { done <- e.settle(b, nil) }()
	<-waiting // B took ev2, and waits
	e.mu.Lock()
	// A ends, as settle does.
	if b.settlers--; b.settlers == 0 {
		for _, ce := range b.settling {
			e.unrefEventLocked(ce, 1)
		}
		clear(b.settling)
		b.settling = b.settling[:0]
	}
	// What C would wait for.
	for _, ce := range append(append([]*consEvent(nil), b.settling...), b.after...) {
		if ce == ce2 {
			cWaitsForEv2 = true
		}
	}
	e.mu.Unlock()
	close(release)
	<-done
	return cWaitsForEv2
}

// SetSettleWaiting sets the test hook settleWaiting (nil: none).
func SetSettleWaiting(f func()) { settleWaiting = f }
