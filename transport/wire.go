package transport

import (
	"fmt"
)

// Wire constants of protocol version 1. PROTOCOL.md is the normative text;
// these mirror it.
const (
	// Version is the protocol version this package speaks.
	Version = 1

	// headerSize is the length prefix: a big-endian uint32 body length.
	headerSize = 4

	// MinFrameSize is the smallest frame cap a Config may set. Every
	// version 1 message fits in it.
	MinFrameSize = 8 << 10
	// DefaultMaxFrameSize is the frame cap when Config.MaxFrameSize is 0.
	DefaultMaxFrameSize = 64 << 10
	// MaxFrameSizeLimit is the largest frame cap a Config may set.
	MaxFrameSizeLimit = 16 << 20

	// MaxMetaSize bounds the encoded size of Offer.Meta.
	MaxMetaSize = 4096
	// MaxReleaseSeqs bounds the sequence numbers in one release message.
	MaxReleaseSeqs = 512
	// MaxDevices bounds the device list of a handshake.
	MaxDevices = 64
	// MaxFDs bounds the descriptors that travel with one message.
	MaxFDs = 4
	// MaxWindow is the protocol's bound on a consumer's window, the
	// offers a producer may have outstanding on one connection: the
	// initial credits of the hello (Config.Credits) plus every credit
	// message (PROTOCOL.md, flow control). share.MaxCredits, a lower
	// limit of the Go importer's own configuration, is another bound.
	MaxWindow = 1 << 20

	// maxDepth bounds the nesting of any msgpack value we walk, so that a
	// hostile frame cannot exhaust the stack.
	maxDepth = 16
	// maxTextLen bounds the reason of a goodbye and the text of an error.
	maxTextLen = 1024
)

// Kind identifies a message: the first element of its msgpack array.
type Kind uint8

// Message kinds of protocol version 1.
const (
	KindHello    Kind = 1 // dialer -> listener, first message
	KindHelloAck Kind = 2 // listener -> dialer, answer to hello
	KindOffer    Kind = 3 // producer -> consumer
	KindRelease  Kind = 4 // consumer -> producer
	KindRetire   Kind = 5 // producer -> consumer
	KindClosed   Kind = 6 // consumer -> producer
	KindCredit   Kind = 7 // consumer -> producer
	KindGoodbye  Kind = 8 // either way, last message
	KindError    Kind = 9 // either way, last message
)

var kindNames = [...]string{
	KindHello: "hello", KindHelloAck: "hello-ack", KindOffer: "offer",
	KindRelease: "release", KindRetire: "retire", KindClosed: "closed",
	KindCredit: "credit", KindGoodbye: "goodbye", KindError: "error",
}

func (k Kind) String() string {
	if int(k) < len(kindNames) && kindNames[k] != "" {
		return kindNames[k]
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Field counts of version 1 messages, kind included. A receiver skips
// elements past these (a later minor revision may append fields).
const (
	helloFields = 8
	// helloSessionFields: a producer's hello or hello-ack that names its
	// session.
	helloSessionFields = 9
	offerFields        = 12
	// offerKindFields: an offer that names its handle kind.
	offerKindFields = 13
	releaseFields   = 2
	// releaseEventFields: a release that carries an event.
	releaseEventFields = 3
	allocFields        = 2 // retire, closed
	creditFields       = 2
	goodbyeFields      = 2
	// goodbyeCodeFields: a goodbye that says why with a code.
	goodbyeCodeFields = 3
	errorFields       = 3
)

// hello is the body of a hello or hello-ack message.
type hello struct {
	kind       Kind
	version    uint64
	role       Role
	pid        uint64
	instanceID [16]byte
	devices    []UUID
	caps       Caps
	credits    uint64
	session    uint64 // 0: none sent
}
