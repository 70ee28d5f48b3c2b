//go:build linux

package share

import (
	"context"
	"crypto/rand"
	"encoding/binary"

	"github.com/seed743c36cf/cudashare/transport"
)

// This file is a producer's restart on purpose: the session id that tells
// consumers one producer from the next, and the goodbye that asks them to
// come back (PROTOCOL.md, sections 4, hello and goodbye, and 7.2).

// newSession draws a producer's session id: random, 64 bits, never 0
// (which means "unknown").
func newSession() uint64 {
	var b [8]byte
	rand.Read(b[:])
	if s := binary.LittleEndian.Uint64(b[:]); s != 0 {
		return s
	}
	return 1
}

// Session returns the session id this exporter sends in every
// hello-ack: its consumers key their mappings by it, so that the
// allocation ids of a producer that replaces this one, which start
// again, are never taken for this one's.
func (e *Exporter) Session() uint64 { return e.session }

// Restart is Shutdown for a producer that restarts: it retires and frees
// everything as Shutdown does, and its goodbye tells each consumer that
// a new producer (a new Exporter at the same path, in this process or
// another) comes: a consumer with ImporterConfig.Reconnect waits for it
// and goes on, one without ends with ErrProducerRestarting. The caller
// then starts the new producer.
func (e *Exporter) Restart(ctx context.Context) error {
	e.mu.Lock()
	e.restarting = true
	e.mu.Unlock()
	return e.Shutdown(ctx)
}

// goodbyeLocked is what Shutdown's goodbye says. mu held.
func (e *Exporter) goodbyeLocked() (transport.GoodbyeCode, string) {
	if e.restarting {
		return transport.GoodbyeRestarting, "producer restarting"
	}
	return transport.GoodbyeDone, "producer shut down"
}
