package transport

import (
	"errors"
	"fmt"
	"strings"

	"github.com/seed743c36cf/cudashare/internal/closed"
)

// Errors. Every error this package returns for a protocol or connection
// failure matches one of these with errors.Is, and names the peer.
var (
	// ErrClosed: the Conn or Listener was closed on this side, and every
	// later call on it returns an error matching this. It is one value
	// with driver.ErrClosed and share.ErrClosed, named in each package for
	// its callers' convenience: a caller may match "closed" from any layer
	// with any of the three. A peer that went away is ErrDisconnected (or
	// io.EOF after its goodbye), not ErrClosed.
	ErrClosed = closed.Err
	// ErrFrameTooLarge: a frame's length prefix exceeds the frame cap.
	ErrFrameTooLarge = errors.New("transport: frame too large")
	// ErrMalformed: a frame is not valid msgpack or does not fit the schema.
	ErrMalformed = errors.New("transport: malformed message")
	// ErrUnknownMessage: a message kind this version does not define.
	ErrUnknownMessage = errors.New("transport: unknown message kind")
	// ErrUnexpectedMessage: a message out of order or in the wrong
	// direction, such as an offer before the handshake or from a consumer.
	ErrUnexpectedMessage = errors.New("transport: unexpected message")
	// ErrVersion: the peer speaks another protocol version.
	ErrVersion = errors.New("transport: protocol version mismatch")
	// ErrHandshake: the handshake failed for a reason other than the
	// version, such as two producers meeting.
	ErrHandshake = errors.New("transport: handshake failed")
	// ErrPeerRefused: the peer's credentials are not allowed, or the peer
	// refused ours.
	ErrPeerRefused = errors.New("transport: peer refused")
	// ErrCredit: flow control was violated: more offers than credits, or
	// more releases than outstanding offers.
	ErrCredit = errors.New("transport: flow control violated")
	// ErrNotSupported: the peer did not advertise a capability this
	// operation needs.
	ErrNotSupported = errors.New("transport: not supported by peer")
	// ErrWriteTimeout: the peer did not read for Config.WriteTimeout.
	ErrWriteTimeout = errors.New("transport: write timed out")
	// ErrDisconnected: the peer went away without a goodbye.
	ErrDisconnected = errors.New("transport: peer disconnected")
	// ErrRemote: the peer sent an error message; see RemoteError.
	ErrRemote = errors.New("transport: error from peer")
	// ErrUnsafePath: the socket's directory or file is not private to
	// this user.
	ErrUnsafePath = errors.New("transport: unsafe socket path")
	// ErrTimeout: a peer held something past a deadline, such as half a
	// frame past Config.FrameTimeout, or a lease past the producer's
	// lease deadline.
	ErrTimeout = errors.New("transport: timeout")
	// ErrLimit: a peer exceeded a limit, such as too many connections or
	// pending handshakes from one process.
	ErrLimit = errors.New("transport: limit exceeded")
	// errInterrupted: Conn.interrupt woke the Recv that was waiting. It
	// is not a failure: the connection stays usable.
	errInterrupted = errors.New("transport: receive interrupted")
)

// Error codes of the error message (PROTOCOL.md, "Error codes").
const (
	codeOther          = 0
	codeVersion        = 1
	codePeerRefused    = 2
	codeMalformed      = 3
	codeUnknownMessage = 4
	codeUnexpected     = 5
	codeFrameTooLarge  = 6
	codeCredit         = 7
	codeHandshake      = 8
	codeNotSupported   = 9
	codeInternal       = 10
	codeTimeout        = 11
	codeLimit          = 12
)

var codeSentinels = [...]error{
	codeVersion:        ErrVersion,
	codePeerRefused:    ErrPeerRefused,
	codeMalformed:      ErrMalformed,
	codeUnknownMessage: ErrUnknownMessage,
	codeUnexpected:     ErrUnexpectedMessage,
	codeFrameTooLarge:  ErrFrameTooLarge,
	codeCredit:         ErrCredit,
	codeHandshake:      ErrHandshake,
	codeNotSupported:   ErrNotSupported,
	codeInternal:       nil,
	codeTimeout:        ErrTimeout,
	codeLimit:          ErrLimit,
}

// codeOf maps a local failure to the code that tells the peer about it.
func codeOf(err error) uint32 {
	if errors.Is(err, ErrWriteTimeout) {
		// The peer held what was written to it past a deadline.
		return codeTimeout
	}
	for code, s := range codeSentinels {
		if s != nil && errors.Is(err, s) {
			return uint32(code)
		}
	}
	return codeInternal
}

// RemoteError is an error message received from the peer. It matches
// ErrRemote and, for the codes that have one, the sentinel of its code: a
// listener's refusal matches ErrPeerRefused, a version mismatch ErrVersion.
type RemoteError struct {
	Code    uint32
	Message string
	// Peer is the peer that sent it.
	Peer string
}

func (e *RemoteError) Error() string {
	what := "error"
	if int(e.Code) < len(codeSentinels) && codeSentinels[e.Code] != nil {
		what = strings.TrimPrefix(codeSentinels[e.Code].Error(), "transport: ")
	}
	return fmt.Sprintf("transport: %s reports %s (code %d): %s", e.Peer, what, e.Code, e.Message)
}

// Is reports whether target is ErrRemote or the sentinel of e.Code.
func (e *RemoteError) Is(target error) bool {
	if target == ErrRemote {
		return true
	}
	return int(e.Code) < len(codeSentinels) && codeSentinels[e.Code] != nil && codeSentinels[e.Code] == target
}
