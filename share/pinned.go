//go:build linux

package share

import (
	"time"
)

// With legacy IPC, what a consumer lost without a goodbye (or dropped)
// holds stays leased until its process exits (PROTOCOL.md 7.1). Stopped
// consumers that are never killed can so hold a whole ring, or everything
// in use of an arena, and the producer's Acquire or Alloc then waits for
// good: correct, and silent. A reviewer's producer stopped offering for
// 110 s with nothing in its log. The lease janitor therefore says so, once
// a minute while it lasts, naming the processes the producer waits for.
// (With VMM, such buffers are given up and replaced, and nothing waits.)

// pinnedWarnEvery is how often the warning is repeated while it holds.
const pinnedWarnEvery = time.Minute

// pinnedHolders are the lost consumers holding buffers of one ring or
// arena: the buffers (once each, a broadcast offers one to several) and
// the consumers' descriptions.
type pinnedHolders struct {
	bufs  map[*Buffer]struct{}
	bytes uint64
	who   []string
}

// warnPinnedLocked warns for each ring whose every buffer, and each arena
// with an Alloc waiting whose every range in use, is held by consumers
// that are lost and whose processes live; not for one retired. It runs on
// the lease janitor's ticks (LeaseTimeout/8): with no lease timeout, it
// does not run. mu held.
func (e *Exporter) warnPinnedLocked(now time.Time) {
	var held map[any]*pinnedHolders
	for c := range e.conns {
		if !c.ended || c.dropped {
			continue
		}
		name := ""
		for i := range c.slots {
			b := c.slots[i].b
			if b == nil || b.abandoned || (b.ring == nil && b.arena == nil) {
				continue
			}
			var key any = b.ring
			if b.ring == nil {
				key = b.arena
			}
			if held == nil {
				held = make(map[any]*pinnedHolders)
			}
			h := held[key]
			if h == nil {
				h = &pinnedHolders{bufs: make(map[*Buffer]struct{})}
				held[key] = h
			}
			if _, ok := h.bufs[b]; !ok {
				h.bufs[b] = struct{}{}
				h.bytes += b.span
			}
			// Named once in each ring or arena it holds buffers of.
			if name == "" {
				name = c.peer.String()
			}
			if len(h.who) == 0 || h.who[len(h.who)-1] != name {
				h.who = append(h.who, name)
			}
		}
	}
	for key, h := range held {
		switch x := key.(type) {
		case *Ring:
			if x.deadClosed || len(h.bufs) < len(x.bufs) || len(x.free) > 0 || now.Sub(x.pinnedWarned) < pinnedWarnEvery {
				continue
			}
			x.pinnedWarned = now
			e.log.Warn("share: consumers lost without a goodbye hold every buffer of a ring; Acquire waits until their processes exit (legacy IPC: what they map stays theirs until then)",
				"alloc", x.rec.id, "buffers", len(x.bufs), "holders", h.who)
		case *Arena:
			inUse := x.rec.size - x.spans.available() - x.lostBytes()
			if x.rec.state != recLive || x.waiting == 0 || h.bytes < inUse || now.Sub(x.pinnedWarned) < pinnedWarnEvery {
				continue
			}
			x.pinnedWarned = now
			e.log.Warn("share: consumers lost without a goodbye hold everything in use of an arena; Alloc waits until their processes exit (legacy IPC: what they map stays theirs until then)",
				"alloc", x.rec.id, "held_bytes", h.bytes, "free_bytes", x.spans.available(), "arena", x.rec.size, "holders", h.who)
		}
	}
}
