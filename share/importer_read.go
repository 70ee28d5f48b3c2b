//go:build linux

package share

import (
	"context"
	"errors"
	"io"

	"github.com/seed743c36cf/cudashare/transport"
)

// This file is who reads the producer's messages: Next, while the
// application keeps calling it, or the background reader (read_token.go).
// Once the importer has stopped (Shutdown, Close, the producer gone), Next
// reads no more and the background reader reads until the connection
// ends.

// readLoop is the background reader.
// recvDone and bgDone are its connection's.
func (im *Importer) readLoop(recvDone, bgDone chan struct{}) {
	defer close(bgDone)
	im.rd.background(im.stop, recvDone, im.readBackground)
}

// readFor reads the connection for Next, as the token's holder, until an
// offer comes, whose lease it puts in *next, or ctx ends, or the importer
// stops. direct says the lease came from the connection, not from the
// background reader's queue. Before it waits for the producer, it pushes
// the releases queued (as Next must): not before, so that a consumer that
// has offers waiting releases in batches, with fewer writes, as it did
// when the leases were queued for it.
func (im *Importer) readFor(ctx context.Context, next **Lease) (direct bool) {
	pushed := false
	for !im.readDone {
		// What the background reader queued comes first. (One-case
		// selects with a default, and the length, do not lock a channel
		// that is empty and open: this runs once per handoff.)
		if len(im.ready) > 0 {
			select {
			case l := <-im.ready:
				*next = l
				return false
			default:
			}
		}
		if im.stopped() {
			return false
		}
		var err error
		if pushed {
			err = im.conn.Recv(ctx, &im.msg)
		} else if ok, terr := connTryRecv(im.conn, &im.msg); !ok && terr == nil {
			im.push()
			pushed = true
			continue
		} else {
			err = terr
		}
		if err != nil {
			if errors.Is(err, errInterrupted) {
				continue // the importer stopped (or an earlier interrupt)
			}
			if !ctxEnded(ctx, err) {
				im.readEnd(err)
			}
			return false
		}
		l, err := im.onMessage(&im.msg)
		if err != nil {
			im.readEnd(err)
			return false
		}
		if l != nil {
			*next = l
			if im.rd.waiting.Load() > 1 {
				// Others wait: what has come is theirs.
				im.drain()
			}
			return true
		}
	}
	return false
}

// readBackground reads the connection for the background reader, as the
// token's holder, queueing the leases, until Next runs again, unless the
// importer has stopped (stopped), and then until the connection ends. It
// reports whether the connection has ended.
func (im *Importer) readBackground(stopped bool) (ended bool) {
	seen := im.rd.begun.Load()
	for !im.readDone {
		err := im.conn.Recv(context.Background(), &im.msg)
		if errors.Is(err, errInterrupted) {
			// The importer stopped, or Next wants the connection.
			if stopped = stopped || im.stopped(); !stopped && im.rd.wanted(seen) {
				return false
			}
			continue
		}
		var l *Lease
		if err == nil {
			l, err = im.onMessage(&im.msg)
		}
		if err != nil {
			im.readEnd(err)
			break
		}
		if l != nil {
			im.queue(l)
		}
		if !stopped {
			if im.stopped() {
				stopped = true
			} else if im.rd.wanted(seen) {
				return false
			}
		}
	}
	return true
}

// drainMax bounds the messages a Next takes for others (drain) before it
// returns with its own lease.
const drainMax = 64

// drain handles, without waiting, the messages that have arrived, up to
// drainMax, and queues their leases.
func (im *Importer) drain() {
	for range drainMax {
		ok, err := connTryRecv(im.conn, &im.msg)
		var l *Lease
		if ok {
			l, err = im.onMessage(&im.msg)
		}
		if err != nil {
			im.readEnd(err)
			return
		}
		if !ok {
			return
		}
		if l != nil {
			im.queue(l)
		}
	}
}

// onMessage handles one message from the producer; an offer gives its
// lease. A goodbye ends the reading with io.EOF.
func (im *Importer) onMessage(m *transport.Message) (*Lease, error) {
	switch m.Kind {
	case transport.KindOffer:
		return im.onOffer(&m.Offer), nil
	case transport.KindRetire:
		im.onRetire(m.AllocID)
	case transport.KindGoodbye:
		im.mu.Lock()
		im.byeWhy, im.byeCode = m.Reason, m.ByeCode
		im.mu.Unlock()
		return nil, io.EOF
	}
	return nil, nil
}

// readEnd ends the reading, once: the connection's end (err) ends the
// importer.
func (im *Importer) readEnd(err error) {
	im.readDone = true
	im.onEnd(err)
	// Nothing comes after a goodbye; closing at once lets a producer that
	// lingers after its goodbye finish.
	im.conn.Close()
	close(im.recvDone)
}

// stopped reports whether Next has stopped for good.
func (im *Importer) stopped() bool { return isClosed(im.stop) }

// queue queues a lease for Next.
func (im *Importer) queue(l *Lease) {
	select {
	case im.ready <- l:
	default:
		// Only errors can find the queue full (leases are bounded by the
		// credits): drop this one.
		im.log.Warn("share: dropping an offer error, too many queued", "err", l.err)
	}
}
