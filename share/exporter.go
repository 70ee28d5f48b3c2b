//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// ExporterConfig configures an Exporter. The zero value is usable.
type ExporterConfig struct {
	// AllowedUIDs are the users whose consumers may connect. Empty means
	// this process's effective user only.
	AllowedUIDs []uint32
	// Logger receives arrivals and losses of consumers and memory that
	// Close could not free. Nil means slog.Default().
	Logger *slog.Logger
	// LeaseTimeout is how long a consumer may hold one lease. A consumer
	// that holds a lease longer is stuck: it is dropped with an error
	// (transport.ErrTimeout) that says so, and what it held is handled as
	// for a lost consumer. 0 means DefaultLeaseTimeout; negative, no
	// deadline.
	LeaseTimeout time.Duration
	// LeaseWarn is how long a lease may be held before its holder and
	// buffer are named in the log, once per lease (exporter_alarm.go). 0
	// means half the lease timeout (half DefaultLeaseTimeout with none);
	// negative, never.
	LeaseWarn time.Duration
	// MaxLeasesPerConsumer caps the leases one consumer holds at once,
	// below the credits it granted. 0 means no cap but the credits. Offer
	// picks, among consumers with a credit, the one holding the fewest
	// leases, so one slow consumer never holds more than about its share.
	MaxLeasesPerConsumer int
	// WriteTimeout bounds how long a consumer may leave the producer's
	// messages unread before it is dropped (transport.Config.WriteTimeout).
	// 0 means the transport's default.
	WriteTimeout time.Duration
	// DisableShm keeps each consumer's messages on its socket instead
	// of the shm channel shared with it (transport.Config.DisableShm).
	DisableShm bool
	// ShmSpin is how long a receive polls a consumer's shm lane before it
	// sleeps (transport.Config.ShmSpin). 0 means the transport's default.
	ShmSpin time.Duration
	// Sharing is how rings and arenas are allocated and shared: VMM
	// allocations exported as file descriptors, or legacy IPC. The zero
	// value, SharingAuto, takes VMM where the device supports it.
	// Exporter.Sharing says which was taken and why.
	Sharing Sharing
}

// DefaultLeaseTimeout is ExporterConfig.LeaseTimeout's default.
const DefaultLeaseTimeout = 60 * time.Second

// ExporterStats are an exporter's counters.
type ExporterStats struct {
	Consumers     int    // connected and taking offers now
	ConsumersLost uint64 // consumers whose connection ended without a goodbye (those dropped included)
	Offers        uint64 // offers sent, one per consumer reached
	Releases      uint64 // leases ended: released, or dropped with their consumer
	// OrderedReleases counts releases that were stream-ordered: the
	// buffer's next write waits for the consumer's GPU work.
	OrderedReleases uint64
	// ReleaseEventsOpened counts consumers' release events opened from
	// their handles: each once per consumer, however many releases carry it.
	ReleaseEventsOpened uint64
	BytesOffered        uint64 // bytes offered by those offers
	Leases              int    // leases outstanding now
	Retired             uint64 // allocations retired (and freed, if the exporter allocated them)
	Allocations         int    // allocations known now: registered, rings and arenas
	// ConsumersDropped counts consumers the producer dropped: a protocol
	// violation (seen by share or by the transport), a lease held past
	// LeaseTimeout, half a frame held past the frame timeout, or messages
	// left unread past WriteTimeout.
	ConsumersDropped uint64
	// ConsumersFailed counts consumers that ended their connection with an
	// error message of their own (such as code 10 for an allocation they
	// could not import): the log says who, the code and their text.
	ConsumersFailed uint64
	// BroadcastMissed counts consumers a Broadcast skipped because their
	// backlog was full (see Broadcast).
	BroadcastMissed uint64
	// ConsumersHandedOn counts connections that outlived the process that
	// opened them (handed on, or inherited by a child): the processes
	// holding them then are watched instead.
	ConsumersHandedOn uint64
	// ConsumersUnwatched counts connections whose holding processes could
	// not be found or watched (unknown pid, another PID namespace): what
	// they may map with legacy IPC is freed only after a goodbye, else
	// never before the producer exits. VMM allocations wait on no watch.
	ConsumersUnwatched uint64
	// Abandoned counts buffers given up to a lost consumer that may still
	// read them (VMM): never written again. AbandonedBytes is what of
	// them lies in arenas, out of use until the arena is retired; Replaced
	// counts ring allocations replaced with fresh memory because of them.
	Abandoned, AbandonedBytes, Replaced uint64
}

// Exporter is the producer side: it listens on a Unix socket, accepts
// consumers in the background, and offers them device buffers of one
// context. See the package documentation for the guarantees.
//
// Its state comes in parts, each with one owner (a reader following one
// buffer goes down this list to the wire and back up once):
//
//   - buffers and their allocations (allocTable, allocRec, Buffer):
//     exporter.go, buffer.go, ring.go, arena.go, sharing.go (vmm or ipc),
//     vmm.go (the descriptor path), abandon.go (what a lost consumer may
//     still read), retire.go (the end of an allocation's life);
//     Exporter.mu;
//   - the consumers admitted (conns, consumer): exporter_consumer.go,
//     procwatch.go, and exporter_consumer_gone.go for their end; mu;
//   - who takes the next offer (offerPolicy): offer_policy.go; mu;
//   - the offer itself, from reservation to the wire and the settling of
//     its send: offer.go (the send runs without mu);
//   - the consumers' messages: exporter_read.go, by whoever holds the
//     reading token (read_token.go), with no lock for its own pass state
//     (readPass); a release or a closed is applied where it is read
//     (exporter_consumer.go, onRelease and onClosed), under mu;
//   - the lease deadline (leaseClock): lease_clock.go; what lost consumers
//     keep pinned: pinned.go; mu.
//
// One mutex guards the parts under mu because an offer changes a
// consumer's, a buffer's and the policy's state together; the reading and
// the sends, where the time goes, run without it.
type Exporter struct {
	dctx *driver.Context
	dev  transport.UUID
	ln   *transport.Listener
	log  *slog.Logger
	// peerLog is log limited against a flood of consumers (the
	// listener's): for what each connection may write once, as fast as
	// consumers connect.
	peerLog *slog.Logger

	sharing    Sharing // SharingIPC or SharingVMM
	sharingWhy string
	session    uint64 // sent in every hello-ack (exporter_restart.go)
	restarting bool   // Restart: the goodbyes say so; guarded by mu
	gran       uint64 // VMM allocation granularity

	life      context.Context // ends with Close; bounds every goroutine
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	done      chan struct{} // closed by Close
	closeOnce sync.Once
	// The reading of every consumer's connection (exporter_read.go):
	// whoever holds rd's token reads them all through poll. reading is set
	// while a producer's wait reads or is about to; notified counts
	// notifyLocked calls, which end such a wait.
	rd       handover
	poll     poller
	reading  atomic.Bool
	notified atomic.Uint64
	// The token's holder's (no lock: one goroutine at a time holds it).
	pass readPass
	// Consumers that connected, for the token's holder to take in
	// (joining, under mu); joined counts them, readPass.taken those taken.
	joining []*consumer
	joined  atomic.Uint64

	// mu guards what follows, and the state of every consumer, allocation
	// and buffer of the exporter: an offer changes the three together.
	mu         sync.Mutex
	closing    bool                   // no more offers or buffers
	conns      map[*consumer]struct{} // every consumer not yet dropped
	policy     offerPolicy            // who takes the next offer (offer_policy.go)
	recs       allocTable             // the allocations offered from (exporter.go, retire.go)
	clock      leaseClock             // lease_clock.go
	eventPool  []*expEvent
	pids       map[int]*procWatch      // the watch of each consumer process
	cevents    map[*consEvent]struct{} // consumers' release events not yet closed
	creditWait chan struct{}           // closed when a credit may have come free; made by a waiter
	changed    chan struct{}           // closed on any other change waiters watch
	stats      ExporterStats
	obs        observation // what Snapshot reports beyond stats (exporter_snapshot.go)
}

// readPass is the reading token's holder's state (exporter_read.go): the
// connections it reads, where the last pass began, passes made, the
// message being handled, and how many joined consumers it took in.
type readPass struct {
	readers  []*consumer
	start, n int
	msg      transport.Message
	taken    uint64
}

// allocTable is every allocation the exporter offers from, by id and, for
// registered memory, by base address. Exporter.mu.
type allocTable struct {
	lastID uint64 // ids are never reused by this process
	byID   map[uint64]*allocRec
	byBase map[driver.DevicePtr]*allocRec
}

// recState is the life of an allocation record.
type recState uint8

const (
	recLive     recState = iota
	recRetiring          // no more offers; waiting for every consumer to close
	recFreeing           // closed everywhere; being freed
	recFreed
)

// allocRec is one device allocation the exporter offers from. Fields after
// handle are guarded by Exporter.mu.
type allocRec struct {
	id     uint64 // never reused by this process
	base   driver.DevicePtr
	size   uint64
	bufID  uint64
	handle transport.Handle // cached: one IpcGetMemHandle per allocation
	owned  bool             // allocated by the exporter, freed on retire
	kind   transport.HandleKind
	vmm    *vmmMem // the producer's handle and mapping, for HandleVMM
	ring   *Ring
	arena  *Arena
	// offers counts the offers of the allocation, whatever its buffer:
	// each one's generation, so that a range offered again, an arena's
	// offset reused by a fresh buffer included, gets a larger one
	// (PROTOCOL.md section 4, offer). Exporter.mu.
	offers uint64

	state   recState
	sending int                    // offers between reservation and queueing
	mappers map[*consumer]struct{} // consumers that may have it mapped (their allocs say how)
	evBufs  map[*Buffer]struct{}   // buffers holding a pooled event
	// quarantined: a ring allocation replaced because a lost consumer may
	// read a buffer in it; members are its buffers still in use, whose
	// successors come in when they are idle.
	quarantined bool
	members     int
	ringBufs    []*Buffer // a ring allocation's buffers, made with it
}

// expEvent is an interprocess event and its cached handle.
type expEvent struct {
	ev *driver.Event
	h  transport.Handle
}

// NewExporter listens on the Unix socket at path (see transport.Listen for
// the rules on its directory) and accepts consumers in the background. ctx
// bounds the setup only. Buffers are offered from dctx's device; dctx must
// outlive the Exporter.
func NewExporter(ctx context.Context, dctx *driver.Context, path string, cfg ExporterConfig) (*Exporter, error) {
	if dctx == nil {
		return nil, errors.New("share: NewExporter: nil context")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	dev := dctx.Device().UUID()
	tcfg := transport.DefaultConfig(transport.RoleProducer)
	tcfg.Devices = []transport.UUID{dev}
	tcfg.Logger = log
	if len(cfg.AllowedUIDs) > 0 {
		tcfg.AllowedUIDs = cfg.AllowedUIDs
	}
	if cfg.WriteTimeout < 0 || cfg.MaxLeasesPerConsumer < 0 {
		return nil, errors.New("share: NewExporter: negative WriteTimeout or MaxLeasesPerConsumer")
	}
	tcfg.WriteTimeout = cfg.WriteTimeout
	tcfg.DisableShm, tcfg.ShmSpin = cfg.DisableShm, cfg.ShmSpin
	tcfg.ReleaseEvents = true // Acquire, AcquireOn, Arena.Alloc and Wait honour them
	tcfg.Session = newSession()
	leaseTimeout := cfg.LeaseTimeout
	if leaseTimeout == 0 {
		leaseTimeout = DefaultLeaseTimeout
	}
	sharing, gran, why, err := resolveSharing(dctx.Device(), cfg.Sharing)
	if err != nil {
		return nil, err
	}
	spin := cfg.ShmSpin
	if spin == 0 {
		spin = transport.DefaultConfig(transport.RoleProducer).ShmSpin
	}
	poll, err := newPoller(spin)
	if err != nil {
		return nil, fmt.Errorf("share: NewExporter: %w", err)
	}
	ln, err := transport.Listen(ctx, path, tcfg)
	if err != nil {
		poll.Close()
		return nil, err
	}
	log.Info("share: exporter sharing path", "sharing", sharing.String(), "why", why)
	e := &Exporter{
		sharing: sharing, sharingWhy: why, gran: gran, session: tcfg.Session,
		dctx:    dctx,
		dev:     dev,
		ln:      ln,
		poll:    poll,
		log:     log,
		peerLog: listenerLogger(ln),
		done:    make(chan struct{}),
		conns:   make(map[*consumer]struct{}),
		recs:    allocTable{byID: make(map[uint64]*allocRec), byBase: make(map[driver.DevicePtr]*allocRec)},
		pids:    make(map[int]*procWatch),
		cevents: make(map[*consEvent]struct{}),
		policy:  offerPolicy{maxLeases: uint64(cfg.MaxLeasesPerConsumer)},
		obs:     newObservation(cfg.LeaseWarn, leaseTimeout),
	}
	ln.ServeObservers(e.encodeSnapshot)
	e.life, e.cancel = context.WithCancel(context.Background())
	e.rd.init(poll.Wake)
	e.wg.Add(2)
	go e.readLoop()
	go e.acceptLoop()
	if leaseTimeout > 0 || e.obs.leaseWarn >= 0 {
		e.wg.Add(1)
		go e.leaseJanitor(leaseTimeout, e.obs.leaseWarn)
	}
	return e, nil
}

// Addr returns the path of the exporter's socket.
func (e *Exporter) Addr() string { return e.ln.Addr() }

// --- Buffers ---------------------------------------------------------------

// newRecLocked records an allocation. mu held.
func (e *Exporter) newRecLocked(base driver.DevicePtr, size, bufID uint64, h driver.IpcMemHandle, owned bool) *allocRec {
	e.recs.lastID++
	rec := &allocRec{
		id: e.recs.lastID, base: base, size: size, bufID: bufID, handle: transport.Handle(h), owned: owned,
		mappers: make(map[*consumer]struct{}),
		evBufs:  make(map[*Buffer]struct{}),
	}
	e.recs.byID[rec.id] = rec
	if !owned {
		e.recs.byBase[base] = rec
	}
	return rec
}

// Register makes size bytes at p available to offer, memory of the
// exporter's context that the caller allocated and keeps ownership of. p
// need not be the base of its allocation: the base and size are found with
// AddressRange, and the allocation's IPC handle is taken once and cached
// for every buffer registered in it. The allocation is told apart by base
// address and buffer id, so memory freed and allocated again at the same
// address gets a new record (and a new allocation id on the wire).
//
// The caller may free the memory only after Retire of a buffer in it has
// returned: that is when no consumer maps it any more.
func (e *Exporter) Register(p driver.DevicePtr, size uint64) (*Buffer, error) {
	base, asize, err := e.dctx.AddressRange(p)
	if err != nil {
		return nil, fmt.Errorf("share: register %#x: %w", uint64(p), err)
	}
	off := uint64(p - base)
	if size == 0 || size > asize-off {
		return nil, fmt.Errorf("share: register %d bytes at %#x: the allocation at %#x has %d bytes: %w",
			size, uint64(p), uint64(base), asize, driver.ErrInvalidValue)
	}
	bufID, err := e.dctx.BufferID(base)
	if err != nil {
		return nil, fmt.Errorf("share: register %#x: %w", uint64(p), err)
	}
	rec, err := e.registered(base, bufID)
	if err != nil {
		return nil, err
	}
	if rec == nil {
		h, err := e.dctx.IpcGetMemHandle(base)
		if err != nil {
			return nil, fmt.Errorf("share: register %#x: %w", uint64(p), err)
		}
		e.mu.Lock()
		if e.closing {
			e.mu.Unlock()
			return nil, ErrClosed
		}
		if rec = e.recs.byBase[base]; rec == nil || rec.bufID != bufID {
			rec = e.newRecLocked(base, asize, bufID, h, false)
		}
		e.mu.Unlock()
	}
	return &Buffer{e: e, rec: rec, off: off, size: size}, nil
}

// registered returns the live record of the allocation at base with
// bufID, or nil if there is none. A record at base with another buffer id
// is stale: its memory was freed behind the exporter's back and the
// address reused. It is retired in the background (its consumers close the
// old mapping) and forgotten.
func (e *Exporter) registered(base driver.DevicePtr, bufID uint64) (*allocRec, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closing {
		return nil, ErrClosed
	}
	rec := e.recs.byBase[base]
	switch {
	case rec == nil:
		return nil, nil
	case rec.bufID == bufID && rec.state == recLive:
		return rec, nil
	case rec.bufID == bufID:
		return nil, fmt.Errorf("%w: register in allocation %d at %#x, which is being retired", ErrRetired, rec.id, uint64(base))
	}
	e.log.Warn("share: the allocation at this address was freed without Retire and the address reused; retiring the old record",
		"base", fmt.Sprintf("%#x", uint64(base)), "alloc", rec.id, "old_buffer_id", rec.bufID, "new_buffer_id", bufID)
	delete(e.recs.byBase, base)
	if rec.state == recLive {
		rec.state = recRetiring
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			if err := e.retire(e.life, rec); err != nil && e.life.Err() == nil {
				e.log.Warn("share: retiring a stale allocation record failed", "alloc", rec.id, "err", err)
			}
		}()
	}
	return nil, nil
}

// --- Waiting and notifying -------------------------------------------------

// waitLocked waits for *ch to be closed by notifyLocked, within ctx and the
// exporter's life. mu held on entry and on return.
func (e *Exporter) waitLocked(ctx context.Context, ch *chan struct{}) error {
	if *ch == nil {
		*ch = make(chan struct{})
	}
	w := *ch
	e.mu.Unlock()
	var err error
	select {
	case <-w:
	case <-ctx.Done():
		err = ctx.Err()
	case <-e.done:
		err = ErrClosed
	}
	e.mu.Lock()
	return err
}

// notifyLocked wakes the waiters of *ch. It allocates nothing when no one
// waits.
func (e *Exporter) notifyLocked(ch *chan struct{}) {
	if *ch != nil {
		close(*ch)
		*ch = nil
	}
	// A wait that reads a connection watches this count instead of a
	// channel (waitReadingLocked).
	e.notified.Add(1)
	e.wakeReaderLocked()
}
