package share

import (
	"context"
	"log/slog"
	"time"

	"github.com/seed743c36cf/cudashare/internal/transportx"
	"github.com/seed743c36cf/cudashare/transport"
)

// The parts of package transport that only share uses, typed: transport
// hands them over through internal/transportx rather than exporting them
// (see there). A wrong type panics here, at initialization.
var (
	connTryRecv      = transportx.TryRecv.(func(*transport.Conn, *transport.Message) (bool, error))
	connInterrupt    = transportx.Interrupt.(func(*transport.Conn))
	connQueueRelease = transportx.QueueRelease.(func(*transport.Conn, context.Context, *transport.Handle, ...uint64) error)
	connPush         = transportx.Push.(func(*transport.Conn))
	connPeerHungUp   = transportx.PeerHungUp.(func(*transport.Conn) bool)
	connPeerSocket   = transportx.PeerSocket.(func(*transport.Conn) (uint64, error))
	listenerLogger   = transportx.PeerLogger.(func(*transport.Listener) *slog.Logger)

	// errInterrupted is what a Recv that connInterrupt ended returns.
	errInterrupted = transportx.ErrInterrupted
)

// poller is transport's Poller: one goroutine waits for messages on many
// connections (transport/poller.go).
type poller interface {
	Add(c *transport.Conn) error
	Remove(c *transport.Conn)
	Wake()
	Wait(ctx context.Context) error
	Poll() error
	Close() error
}

// newPoller returns an empty poller whose Wait polls the shm lanes for up
// to spin before it sleeps.
func newPoller(spin time.Duration) (poller, error) {
	p, err := transportx.NewPoller(spin)
	if err != nil {
		return nil, err
	}
	return p.(poller), nil
}
