//go:build linux

package share

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/seed743c36cf/cudashare/transport"
)

// This file is how an importer outlives its producer: when the producer
// vanishes, or says goodbye because it restarts, an importer with a
// ReconnectPolicy keeps its leases and its users' Next calls, dials the
// path again with backoff until a producer answers or the deadline
// passes, and goes on with the new producer's leases.
//
// A new producer is a new session (PROTOCOL.md, section 7.2): its
// allocation ids and sequence numbers start again. So everything of the
// lost producer is set apart before the new one is read: its mappings
// leave the allocation table (those that leases are in stay mapped, as
// lost, until their last release, which goes nowhere), its events are
// forgotten, and the registry keys new mappings by the new session.

// ReconnectPolicy is how an importer reconnects (ImporterConfig.Reconnect).
type ReconnectPolicy struct {
	// Deadline bounds how long the importer tries to reach a producer
	// again, from when it lost the last one; then Next returns an error
	// matching ErrReconnectDeadline and ErrProducerGone. 0 means no
	// deadline: it tries until it is closed.
	Deadline time.Duration
	// MinBackoff is the wait before the second try (the first is at
	// once); it doubles with each failed try up to MaxBackoff. 0 means
	// 10ms and 500ms: a producer that restarts listens again within
	// milliseconds, and one that does not costs a few tries a second.
	MinBackoff, MaxBackoff time.Duration
}

const (
	defaultReconnectMin = 10 * time.Millisecond
	defaultReconnectMax = 500 * time.Millisecond
	// forever stands for no deadline in a dial that waits.
	forever = time.Duration(1<<63 - 1)
)

// resolve checks p and fills in its defaults; nil stays nil.
func (p *ReconnectPolicy) resolve() (*ReconnectPolicy, error) {
	if p == nil {
		return nil, nil
	}
	r := *p
	if r.Deadline < 0 || r.MinBackoff < 0 || r.MaxBackoff < 0 {
		return nil, errors.New("share: Dial: a negative duration in ImporterConfig.Reconnect")
	}
	if r.MinBackoff == 0 {
		r.MinBackoff = defaultReconnectMin
	}
	if r.MaxBackoff == 0 {
		r.MaxBackoff = max(defaultReconnectMax, r.MinBackoff)
	}
	if r.MaxBackoff < r.MinBackoff {
		return nil, fmt.Errorf("share: Dial: Reconnect.MaxBackoff %v below MinBackoff %v", r.MaxBackoff, r.MinBackoff)
	}
	return &r, nil
}

// firstWait is how long Dial waits for a first producer.
func (p *ReconnectPolicy) firstWait() time.Duration {
	if p.Deadline == 0 {
		return forever
	}
	return p.Deadline
}

// sessionOf is the session a producer named in its hello-ack, or, if it
// named none, one of our own that no other connection has: an unknown
// session is a new one.
func sessionOf(p transport.Peer) uint64 {
	if p.Session != 0 {
		return p.Session
	}
	var b [8]byte
	rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:]) | 1<<63 // never 0
}

// releaseEventsOK reports whether releases to the producer p may carry
// events. A producer whose SO_PEERCRED pid reads 0 runs in a PID
// namespace above this one or beside it (another container), where the
// driver may refuse to open our events: releases wait on the host
// instead (PROTOCOL.md, section 4.1).
func releaseEventsOK(p transport.Peer) bool {
	return p.Caps&transport.CapReleaseEvents != 0 && p.PID != 0
}

// comesBack reports whether the end of the connection (err) is one that
// a producer comes back from: a goodbye that says it restarts, or a
// producer that vanished. A plain goodbye (done), being dropped by the
// producer, and this side's own failures are not.
func (im *Importer) comesBack(err error) bool {
	if err == io.EOF {
		return im.byeCode == transport.GoodbyeRestarting
	}
	return producerVanished(err)
}

// loseLocked sets the lost producer apart and starts reconnecting. mu
// held; the connection's reader calls it (readEnd), so nothing reads the
// connection any more.
func (im *Importer) loseLocked(cause error) {
	im.gone = true // nothing more is sent to it
	// Lost first, then the look at evUse: a Next that counted itself in
	// evUse before this looks at lost after (NextOn), and one of the two
	// sees the other.
	for _, a := range im.allocs {
		a.lost.Store(true)
	}
	im.drainLocked()
	for _, a := range im.allocs {
		if a.leases == 0 {
			im.closeAllocLocked(a)
		} else {
			// Mapped until its last lease is released: VMM memory lives
			// while mapped, and so the leases stay valid; legacy IPC
			// memory died with its producer, and its leases say so.
			im.lost[a] = struct{}{}
		}
	}
	clear(im.allocs)
	clear(im.failed)
	for h, ev := range im.events {
		if im.evUse.Load() == 0 {
			if err := ev.Close(); err != nil {
				im.log.Debug("share: destroying a lost producer's event failed", "err", err)
			}
		} else {
			im.stale = append(im.stale, ev)
		}
		delete(im.events, h)
	}
	im.pending = 0
	im.byeWhy, im.byeCode = "", transport.GoodbyeDone
	im.up = make(chan struct{})
	im.reconDone = make(chan struct{})
	im.log.Info("share: the producer is gone; reconnecting", "path", im.path, "cause", cause,
		"deadline", im.policy.Deadline, "leases_held", im.held.Load())
	go im.reconnect(cause, im.up, im.reconDone)
}

// reconnecting returns a channel closed once a producer is back or the
// importer ends, while the importer reconnects; nil otherwise.
func (im *Importer) reconnecting() <-chan struct{} {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.up == nil {
		return nil
	}
	return im.up
}

// reconnect dials the path until a producer answers, the deadline passes
// or the importer ends (life).
func (im *Importer) reconnect(cause error, up, done chan struct{}) {
	defer close(done)
	pol := im.policy
	start := time.Now()
	var deadline <-chan time.Time
	if pol.Deadline > 0 {
		dt := time.NewTimer(pol.Deadline)
		defer dt.Stop()
		deadline = dt.C
	}
	backoff := pol.MinBackoff
	wait := time.NewTimer(0) // the first try at once
	defer wait.Stop()
	var err error
	for tries := 0; ; tries++ {
		select {
		case <-wait.C:
		case <-deadline:
			im.giveUp(up, fmt.Errorf("%w: %w: none at %s for %v (%d tries; last: %v; the last producer: %v)",
				ErrProducerGone, ErrReconnectDeadline, im.path, pol.Deadline, tries, err, cause))
			return
		case <-im.life.Done():
			return // ended: endLocked closed stop, which wakes the waiters
		}
		var conn *transport.Conn
		conn, err = transport.Dial(im.life, im.path, im.tcfg)
		if err == nil {
			if im.install(conn, up, time.Since(start), tries+1) {
				return
			}
			conn.Close()
			return
		}
		wait.Reset(backoff)
		backoff = min(2*backoff, pol.MaxBackoff)
	}
}

// giveUp ends the importer when no producer came back.
func (im *Importer) giveUp(up chan struct{}, err error) {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.state == stateOpen {
		im.endLocked(err)
	}
	if im.up == up {
		close(up)
		im.up = nil
	}
}

// install makes conn the importer's connection, unless the importer has
// ended meanwhile. It holds the reading's token while it swaps, so that
// no reader sees half of it.
func (im *Importer) install(conn *transport.Conn, up chan struct{}, took time.Duration, tries int) bool {
	select {
	case <-im.rd.tok:
	case <-im.life.Done():
		return false
	}
	im.mu.Lock()
	if im.state != stateOpen {
		im.mu.Unlock()
		im.rd.give()
		return false
	}
	peer := conn.Peer()
	im.conn, im.peer, im.session = conn, peer, sessionOf(peer)
	im.connNow.Store(conn)
	im.relEvOK.Store(releaseEventsOK(peer))
	im.gone, im.readDone = false, false
	im.recvDone, im.bgDone = make(chan struct{}), make(chan struct{})
	im.stats.Reconnects++
	close(up)
	im.up = nil
	go im.readLoop(im.recvDone, im.bgDone)
	im.mu.Unlock()
	im.rd.give()
	im.log.Info("share: reconnected to a producer", "path", im.path, "producer", peer.String(),
		"session", fmt.Sprintf("%#x", im.session), "after", took.Round(time.Millisecond), "tries", tries)
	return true
}
