// Package transportx reaches the parts of package transport that only
// package share uses: the Poller that lets one goroutine read every
// consumer, and the Conn methods that a reader sharing a connection with
// others, or a producer watching a consumer's process, needs. A Go program
// that speaks the protocol directly (PROTOCOL.md) needs none of them, so
// transport keeps them unexported and hands them over here in its init,
// as grpc-go's internal package and the standard library do: only this
// module can import an internal package.
//
// The variables are set by package transport's init, which runs before any
// package that imports transport is initialized. Their types name no
// transport type (transport imports this package, so this package cannot
// import transport): the Conn, Message, Listener and Poller arguments are
// passed as any, and package share holds the typed wrappers
// (share/transport_internal.go). A wrong type is a panic in share's
// initialization, which every test of share runs.
package transportx

import "time"

var (
	// NewPoller returns a new *transport.poller (Add, Remove, Wake, Wait,
	// Poll and Close, as transport's poller.go documents) for connections
	// whose receives poll their shm lanes for up to spin.
	NewPoller func(spin time.Duration) (any, error)

	// TryRecv is Conn.Recv that never waits: func(*transport.Conn,
	// *transport.Message) (bool, error).
	TryRecv any
	// Interrupt ends one wait of a Conn's Recv with ErrInterrupted:
	// func(*transport.Conn).
	Interrupt any
	// QueueRelease queues a release without writing it, until the next
	// send or Push: func(*transport.Conn, context.Context,
	// *transport.Handle, ...uint64) error.
	QueueRelease any
	// Push writes what QueueRelease left queued: func(*transport.Conn).
	Push any
	// PeerHungUp reports whether the peer's end of the socket is closed:
	// func(*transport.Conn) bool.
	PeerHungUp any
	// PeerSocket returns the inode of the peer's end of the socket:
	// func(*transport.Conn) (uint64, error).
	PeerSocket any
	// PeerLogger returns a Listener's rate-limited logger:
	// func(*transport.Listener) *slog.Logger.
	PeerLogger any

	// ErrInterrupted is what a Recv ended by Interrupt returns.
	ErrInterrupted error
)
