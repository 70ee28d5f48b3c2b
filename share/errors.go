//go:build linux

package share

import (
	"errors"

	"github.com/seed743c36cf/cudashare/internal/closed"
	"github.com/seed743c36cf/cudashare/transport"
)

// Errors. Every error this package returns for one of these conditions
// matches the sentinel with errors.Is; driver and transport errors stay
// wrapped underneath, so errors.Is(err, driver.ErrPeerAccessUnsupported)
// works too.
var (
	// ErrClosed: the Exporter, Importer or Ring was closed or shut down
	// on this side: Next after an Importer's Shutdown or Close, a Lease's
	// CopyToHost or WaitOn after its Importer's Close, Offer, Register,
	// NewRing, Acquire or WaitConsumers after an Exporter's Shutdown or
	// Close. A consumer's connection that closes under an Exporter is not
	// an error of the exporter (the consumer is dropped). It is one value
	// with driver.ErrClosed and transport.ErrClosed, named in each package
	// for its callers' convenience: a caller may match "closed" from any
	// layer with any of the three.
	ErrClosed = closed.Err
	// ErrProducerGone: the producer said goodbye or vanished. After a
	// goodbye the error also matches io.EOF: the stream ended cleanly.
	ErrProducerGone = errors.New("share: producer gone")
	// ErrProducerRestarting: the producer said goodbye because it
	// restarts (PROTOCOL.md, goodbye code restarting), and the importer
	// has no ImporterConfig.Reconnect to wait for the next one. It comes
	// with ErrProducerGone, not with io.EOF: the stream did not end.
	ErrProducerRestarting = errors.New("share: producer restarting")
	// ErrReconnectDeadline: the producer went away and none came back at
	// its path within ImporterConfig.Reconnect's deadline. It comes with
	// ErrProducerGone.
	ErrReconnectDeadline = errors.New("share: no producer came back within the reconnect deadline")
	// ErrPeerAccessUnsupported: the importer's device cannot map memory
	// of the producer's device. The message names both UUIDs.
	ErrPeerAccessUnsupported = errors.New("share: peer access unsupported between the devices")
	// ErrStaleHandle: an offer's IPC handle names an allocation other than
	// the one this process maps under it (a reused handle or address).
	// Next never returns a lease in the stale mapping.
	ErrStaleHandle = errors.New("share: stale IPC handle")
	// ErrIPCNamespace: the driver refused a legacy CUDA IPC handle
	// (CUDA_ERROR_INVALID_CONTEXT, matched too) of a producer in a PID
	// namespace beside this process's (another container), where legacy
	// IPC does not work. A producer with VMM sharing works there.
	ErrIPCNamespace = errors.New("share: legacy CUDA IPC handles do not open between processes in sibling PID namespaces (separate containers)")
	// ErrRetired: the buffer's allocation is being retired or was retired;
	// it can no longer be offered.
	ErrRetired = errors.New("share: allocation retired")
	// ErrFreed: the buffer was freed.
	ErrFreed = errors.New("share: buffer freed")
	// ErrNotHeld: the buffer is not the producer's to offer: a ring
	// buffer that went back to its ring (Acquire it again first).
	ErrNotHeld = errors.New("share: buffer not held by the producer")
	// ErrAbandoned: a consumer lost while holding the buffer may still
	// read it (VMM sharing): it is never written again. A ring has put
	// fresh memory in its place; take another buffer. Arena.Alloc returns
	// it when such ranges leave the arena no room of the size asked for.
	ErrAbandoned = errors.New("share: buffer abandoned to a lost consumer")
	// ErrForeignBuffer: the buffer was made by another Exporter (or is
	// nil); an exporter offers, broadcasts and retires only its own.
	ErrForeignBuffer = errors.New("share: the buffer does not belong to this exporter")
	// ErrRegistered: Free of a registered buffer (Exporter.Register). Its
	// memory is the caller's: there is nothing to give back; use
	// Exporter.Retire to stop sharing it, then free the memory.
	ErrRegistered = errors.New("share: Free of a registered buffer: its memory belongs to the caller; use Exporter.Retire")
)

// The connection's errors, which a user of share meets and matches: the
// same values as transport's (ErrDisconnected is transport.ErrDisconnected),
// so that errors.Is works with either name and a user of share needs
// nothing of package transport. What each means is documented there
// (transport/errors.go) and in PROTOCOL.md's error codes.
var (
	// ErrDisconnected: the peer closed the connection or vanished.
	ErrDisconnected = transport.ErrDisconnected
	// ErrWriteTimeout: the peer read nothing for the write timeout.
	ErrWriteTimeout = transport.ErrWriteTimeout
	// ErrTimeout: a deadline passed (a half-read frame, a lease held past
	// the producer's lease timeout, a full shm lane left unread); also
	// matched by a peer's error with that code.
	ErrTimeout = transport.ErrTimeout
	// ErrRemote: the peer sent an error message; errors.As with a
	// *RemoteError gives its code and text.
	ErrRemote = transport.ErrRemote
	// ErrPeerRefused: the peer's credentials are not allowed, or the peer
	// refused this process's.
	ErrPeerRefused = transport.ErrPeerRefused
	// ErrHandshake: the handshake failed.
	ErrHandshake = transport.ErrHandshake
	// ErrVersion: the peer speaks another protocol version.
	ErrVersion = transport.ErrVersion
	// ErrUnsafePath: the socket's directory or file is open to others.
	ErrUnsafePath = transport.ErrUnsafePath
	// ErrNotSupported: the peer lacks a capability this side needs (vmm,
	// release events).
	ErrNotSupported = transport.ErrNotSupported
	// ErrMalformed, ErrUnexpectedMessage, ErrUnknownMessage,
	// ErrFrameTooLarge, ErrCredit, ErrLimit: the peer broke the protocol
	// (PROTOCOL.md, section 4, error codes).
	ErrMalformed         = transport.ErrMalformed
	ErrUnexpectedMessage = transport.ErrUnexpectedMessage
	ErrUnknownMessage    = transport.ErrUnknownMessage
	ErrFrameTooLarge     = transport.ErrFrameTooLarge
	ErrCredit            = transport.ErrCredit
	ErrLimit             = transport.ErrLimit
)

// RemoteError is the error message a peer sent (PROTOCOL.md, section 4,
// error): errors.As(err, new(*RemoteError)) gives its code and text. It is
// transport's type, named here so that a user of share needs nothing of
// transport.
type RemoteError = transport.RemoteError
