//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// This file is how a consumer's releases reach the producer: queued and
// pushed together, and, for stream-ordered releases, the one interprocess
// event per stream that they carry.

// sendReleaseLocked and sendClosedLocked send to the producer unless it
// is gone. Sends only queue (the connection's writer writes), so holding
// mu keeps releases and closes in order with the state they report. A
// failure means the connection failed; whoever reads it next sees that
// and ends the importer.
//
// Releases are queued, not written one by one: they leave together when a
// goroutine is about to wait in Next (or is waiting there), when a quarter
// of the credits are pending, or after releaseDelay at most, whichever
// comes first; a release must reach the producer soon, since its lease
// deadline runs until then.
func (im *Importer) sendReleaseLocked(seq uint64, after *relEvent) {
	if im.gone {
		return
	}
	var ev *transport.Handle
	if after != nil {
		ev = &after.h
	}
	im.sendFailed(connQueueRelease(im.conn, context.Background(), ev, seq))
	im.pending++
	switch {
	case im.rd.waiting.Load() > 0 || im.pending >= im.pushAt:
		im.pushLocked()
	case im.pending == 1:
		im.pushTimer.Reset(releaseDelay)
	}
}

// releaseDelay bounds how long a release waits to leave with others.
const releaseDelay = 100 * time.Microsecond

// push writes the queued releases.
func (im *Importer) push() {
	im.mu.Lock()
	im.pushLocked()
	im.mu.Unlock()
}

func (im *Importer) pushLocked() {
	if im.pending > 0 {
		im.pending = 0
		connPush(im.conn)
	}
}

func (im *Importer) sendClosedLocked(allocID uint64) {
	if !im.gone {
		im.sendFailed(im.conn.SendClosed(context.Background(), allocID))
	}
}

func (im *Importer) sendFailed(err error) {
	if err != nil && !errors.Is(err, transport.ErrClosed) {
		im.log.Debug("share: send to the producer failed", "err", err)
	}
}

// releaseLocked ends a lease returned by Next; after, if not nil, is the
// event recorded after the lease's last use on the GPU. mu held.
func (im *Importer) releaseLocked(a *impAlloc, seq uint64, after *relEvent) {
	im.unholdLocked()
	im.stats.Released++
	if a.closed {
		return // force-closed by Close
	}
	a.leases--
	if a.lost.Load() {
		// Its producer is gone: no one waits for the release, and the
		// producer connected now never offered it.
		im.stats.ReleasesDropped++
	} else {
		im.sendReleaseLocked(seq, after)
	}
	if a.leases == 0 && (a.retired || a.lost.Load() || im.gone || im.state == stateClosed) {
		im.closeAllocLocked(a)
	}
}

// relEvent is the interprocess event of one stream that stream-ordered
// releases record: recording it again only moves its completion later, so
// the producer, waiting on its latest record, waits for every earlier use.
type relEvent struct {
	ev *driver.Event
	h  transport.Handle
}

// releaseEvent returns s's release event, creating it on first use. mu
// held.
func (im *Importer) releaseEventLocked(s *driver.Stream) (*relEvent, error) {
	if r := im.relEvs[s]; r != nil {
		return r, nil
	}
	if len(im.relEvs) >= maxReleaseStreams {
		return nil, fmt.Errorf("share: stream-ordered releases on more than %d streams", maxReleaseStreams)
	}
	ev, err := im.dctx.NewEvent(driver.EventInterprocess | driver.EventDisableTiming)
	if err != nil {
		return nil, fmt.Errorf("share: create a release event: %w", err)
	}
	h, err := ev.IpcHandle()
	if err != nil {
		ev.Close()
		return nil, fmt.Errorf("share: release event handle: %w", err)
	}
	r := &relEvent{ev: ev, h: transport.Handle(h)}
	im.relEvs[s] = r
	return r, nil
}

// maxReleaseStreams bounds the streams one importer releases on, and so
// the events a producer opens for it (it refuses more than
// MaxReleaseEvents).
const maxReleaseStreams = 64

// syncReleasesLocked waits on the host for the work of every
// stream-ordered release made so far. mu held.
func (im *Importer) syncReleasesLocked() {
	for _, r := range im.relEvs {
		if err := r.ev.Synchronize(); err != nil {
			im.log.Error("share: waiting for stream-ordered releases failed", "err", err)
		}
	}
}
