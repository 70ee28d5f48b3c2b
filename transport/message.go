package transport

import (
	"fmt"

	"github.com/seed743c36cf/cudashare/internal/uuid"
)

// Role is the part a side plays on a connection. A connection joins one
// producer and one consumer; which of them dials does not matter.
type Role uint8

// Roles.
const (
	RoleProducer Role = 1 // exports buffers: sends offers and retires
	RoleConsumer Role = 2 // imports buffers: sends releases, closed and credits
)

func (r Role) valid() bool { return r == RoleProducer || r == RoleConsumer || r == RoleObserver }

func (r Role) String() string {
	switch r {
	case RoleProducer:
		return "producer"
	case RoleConsumer:
		return "consumer"
	case RoleObserver:
		return "observer"
	}
	return fmt.Sprintf("role(%d)", uint8(r))
}

// Caps is a set of optional protocol features. A side advertises what it
// can receive; bits it does not know are ignored.
type Caps uint64

// CapVMM says that the side, a consumer, imports vmm handles
// (HandleVMM), and so accepts the file descriptors that come with their
// offers: the only descriptors an offer carries.
const CapVMM Caps = 1 << 0

// CapReleaseEvents says that the side (a producer) honours the event a
// release may carry: it does not write a released buffer again before the
// event's work is done (PROTOCOL.md, section 4, release). A consumer sends
// release events only to a producer that advertised it.
const CapReleaseEvents Caps = 1 << 1

// CapFabric says that the side, a consumer, imports fabric handles
// (HandleFabric). Reserved: the Go implementation does not advertise it.
const CapFabric Caps = 1 << 2

// CapShm says that the side can carry the connection's frames through
// the shm channel, two lanes in shared memory (PROTOCOL.md, section 2.3). When both sides set
// it, the listener sends the segment with its hello-ack, and the frames
// after the handshake go through it.
const CapShm Caps = 1 << 3

// HandleKind says how an offer's allocation is shared (PROTOCOL.md,
// section 4.1).
type HandleKind uint8

// Handle kinds.
const (
	// HandleIPC: Handle is a CUipcMemHandle (legacy CUDA IPC).
	HandleIPC HandleKind = 0
	// HandleVMM: a VMM allocation exported as a POSIX file descriptor. The
	// first offer of the allocation on a connection carries the fd; Handle
	// is an opaque identity of the allocation, the same in every offer.
	HandleVMM HandleKind = 1
	// HandleFabric: Handle is a CUmemFabricHandle. Reserved.
	HandleFabric HandleKind = 2
)

func (k HandleKind) String() string {
	switch k {
	case HandleIPC:
		return "ipc"
	case HandleVMM:
		return "vmm"
	case HandleFabric:
		return "fabric"
	}
	return fmt.Sprintf("handle_kind(%d)", uint8(k))
}

// UUID identifies a CUDA device (CUuuid). Devices are named by UUID on the
// wire because CUDA_VISIBLE_DEVICES renumbers ordinals per process. It is the
// same type as driver.UUID.
type UUID = uuid.UUID

// Handle is the 64 bytes that name an offer's allocation (Offer.Handle)
// or an interprocess event (Offer.Event, Message.ReleaseEvent). What they
// are depends on the field and, for Offer.Handle, on the offer's
// HandleKind (PROTOCOL.md, section 4.1):
//   - HandleIPC: the allocation's CUipcMemHandle.
//   - HandleVMM: an opaque identity of the allocation, the same in every
//     offer of it (the Go producer: its AllocID, little-endian, then
//     zeros); the memory travels as the offer's file descriptor.
//   - HandleFabric: a CUmemFabricHandle (reserved).
//
// Offer.Event and Message.ReleaseEvent are a CUipcEventHandle.
//
// It is not driver.IpcMemHandle: transport is wire code and does not
// depend on driver, and the bytes are a memory handle for one kind only.
// The side that knows which they are converts (driver.IpcMemHandle(h),
// driver.IpcEventHandle(h), Handle(h)).
type Handle [64]byte

// Offer offers a range of a producer's device allocation to a consumer.
type Offer struct {
	// Seq names this lease in releases. The producer chooses it; it must
	// not repeat among the offers outstanding on a connection.
	Seq uint64
	// AllocID names the producer's allocation; it is never reused, so a
	// consumer may cache its mapping under it until a retire.
	AllocID uint64
	// Generation counts the producer's offers of the allocation, from 1:
	// a later offer of the same range has a larger one.
	Generation uint64
	// Handle names the allocation: for HandleIPC its CUipcMemHandle; see
	// HandleKind for the others.
	Handle Handle
	// HandleKind says how the allocation is shared.
	HandleKind HandleKind
	// AllocSize is the size of the whole allocation; Offset and Size
	// select the offered range within it.
	AllocSize, Offset, Size uint64
	// Device is the UUID of the device that holds the allocation.
	Device UUID
	// Event is a CUipcEventHandle to wait on before reading, if HasEvent.
	Event    Handle
	HasEvent bool
	// Meta is small user metadata (shape, dtype, ...): one msgpack value of
	// at most MaxMetaSize bytes, or empty for none. It must be JSON-like:
	// nil, bool, integer, float, str, bin, array, and map with str keys,
	// nested at most 16 deep; msgpack.Marshal of a map[string]any of such
	// values makes one. Received, it is a view into the connection's
	// buffer, valid until the next Recv.
	Meta []byte
	// FDs are descriptors that travel with the offer (SCM_RIGHTS), at most
	// MaxFDs, and only to a peer that advertised CapVMM. SendOffer
	// duplicates them, so the caller keeps its own. Received, they belong
	// to the caller, who must close them.
	FDs []int
}

// checkRange checks that the offered range lies within the allocation.
func (o *Offer) checkRange() error {
	if o.Offset > o.AllocSize || o.Size > o.AllocSize-o.Offset {
		return malformed("offer: range [%d, +%d) outside allocation of %d bytes", o.Offset, o.Size, o.AllocSize)
	}
	return nil
}

// Message is one received message. Recv fills in Kind and the fields that
// belong to it and leaves the others as they were; slices are views that
// stay valid until the next Recv on the same connection.
type Message struct {
	Kind Kind
	// Offer is set for KindOffer.
	Offer Offer
	// Seqs are the released sequence numbers, for KindRelease.
	Seqs []uint64
	// ReleaseEvent, if HasReleaseEvent, is the interprocess event
	// (CUipcEventHandle) recorded after the consumer's last use of the
	// released buffers, for KindRelease.
	ReleaseEvent    Handle
	HasReleaseEvent bool
	// AllocID is the allocation retired (KindRetire) or closed (KindClosed).
	AllocID uint64
	// Credits is the number of offers granted, for KindCredit.
	Credits uint32
	// Reason is the peer's reason, for KindGoodbye.
	Reason string
	// ByeCode is what the peer's goodbye says comes next, for KindGoodbye.
	ByeCode GoodbyeCode
}

// GoodbyeCode is what a goodbye says comes next (PROTOCOL.md, section 4,
// goodbye).
type GoodbyeCode uint8

// Goodbye codes.
const (
	// GoodbyeDone: the sender is done; nothing more comes from it. The
	// plain goodbye, and what an unknown code means.
	GoodbyeDone GoodbyeCode = 0
	// GoodbyeRestarting: the sender, a producer, restarts: a new producer
	// (a new session) will listen at the same path soon, and a consumer
	// that reconnects is served again.
	GoodbyeRestarting GoodbyeCode = 1
)

func (c GoodbyeCode) String() string {
	switch c {
	case GoodbyeDone:
		return "done"
	case GoodbyeRestarting:
		return "restarting"
	}
	return fmt.Sprintf("goodbye_code(%d)", uint8(c))
}

// Peer describes the other side of a connection: who the kernel says it is
// (SO_PEERCRED) and what it said in the handshake.
type Peer struct {
	// UID, GID and PID are the peer's credentials at connect time, as the
	// kernel reports them, PID in this side's pid namespace.
	UID, GID uint32
	PID      int32
	// Role is the role the peer announced.
	Role Role
	// InstanceID is random per peer process; with PID it tells a restarted
	// process from the one before it.
	InstanceID [16]byte
	// Devices are the UUIDs of the devices the peer sees.
	Devices []UUID
	// Caps are the features the peer accepts.
	Caps Caps
	// Session is a producer's session id (PROTOCOL.md, section 4, hello, and 7.2): random
	// per producer instance, the same on all its connections, new when
	// the producer restarts, whose allocation ids and sequence numbers
	// start again. 0: the peer named none (a consumer, or a producer that
	// predates it): the session is unknown.
	Session uint64
}

func (p *Peer) String() string {
	if p.Role.valid() {
		return fmt.Sprintf("%s pid %d uid %d", p.Role, p.PID, p.UID)
	}
	return fmt.Sprintf("peer pid %d uid %d", p.PID, p.UID)
}
