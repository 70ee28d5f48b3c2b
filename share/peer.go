package share

import (
	"fmt"
	"slices"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// Peer is the process at the other end of a connection: who the kernel
// says it is (SO_PEERCRED) and what it said in its handshake. share's API
// describes peers with it rather than with transport's type, so that a
// user of share needs nothing of transport.
type Peer struct {
	// UID, GID and PID are the peer's credentials at connect time, as the
	// kernel reports them, PID in this process's pid namespace: 0 when
	// the peer lives in a namespace this one cannot see into.
	UID, GID uint32
	PID      int32
	// InstanceID is random per peer process; with PID it tells a restarted
	// process from the one before it.
	InstanceID [16]byte
	// Devices are the UUIDs of the devices the peer named in its
	// handshake: a Go producer the one it offers from.
	Devices []driver.UUID
	// Session is a producer's session id (PROTOCOL.md, section 7.2):
	// random per producer instance, new when it restarts. 0: unknown.
	Session uint64
}

func (p Peer) String() string { return fmt.Sprintf("pid %d uid %d", p.PID, p.UID) }

// peerOf copies a transport Peer; the devices are the copy's own.
func peerOf(p transport.Peer) Peer {
	return Peer{UID: p.UID, GID: p.GID, PID: p.PID, InstanceID: p.InstanceID, Devices: slices.Clone(p.Devices), Session: p.Session}
}
