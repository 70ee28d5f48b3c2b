//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
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
	// MaxLeasesPerConsumer caps the leases one consumer holds at once,
	// below the credits it granted. 0 means no cap but the credits. Offer
	// picks, among consumers with a credit, the one holding the fewest
	// leases, so one slow consumer never holds more than about its share.
	MaxLeasesPerConsumer int
	// WriteTimeout bounds how long a consumer may leave the producer's
	// messages unread before it is dropped (transport.Config.WriteTimeout).
	// 0 means the transport's default.
	WriteTimeout time.Duration
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
	ConsumersLost uint64 // consumers that went away without a goodbye
	Offers        uint64 // offers sent, one per consumer reached
	Releases      uint64 // leases ended: released, or dropped with their consumer
	// OrderedReleases counts releases that were stream-ordered: the
	// buffer's next write waits for the consumer's GPU work.
	OrderedReleases uint64
	BytesOffered    uint64 // bytes lent by those offers
	Leases          int    // leases outstanding now
	Retired         uint64 // allocations retired (and freed, if the exporter allocated them)
	Allocations     int    // allocations known now: registered, rings and arenas
	// ConsumersDropped counts consumers the producer dropped: a protocol
	// violation, a lease held past LeaseTimeout, or messages left unread
	// past WriteTimeout.
	ConsumersDropped uint64
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
// consumers in the background, and lends them device buffers of one
// context. See the package documentation for the guarantees.
type Exporter struct {
	dctx *driver.Context
	dev  transport.UUID
	ln   *transport.Listener
	log  *slog.Logger

	sharing    Sharing // SharingIPC or SharingVMM
	sharingWhy string
	gran       uint64 // VMM allocation granularity

	life      context.Context // ends with Close; bounds every goroutine
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	done      chan struct{} // closed by Close
	closeOnce sync.Once

	mu          sync.Mutex
	closing     bool                   // no more offers or buffers
	consumers   []*consumer            // taking offers, in round-robin order
	conns       map[*consumer]struct{} // every consumer not yet dropped
	rr          int
	lastAllocID uint64
	allocs      map[uint64]*allocRec
	byBase      map[driver.DevicePtr]*allocRec
	eventPool   []*expEvent
	pids        map[int]*procWatch      // the watch of each consumer process
	cevents     map[*consEvent]struct{} // consumers' release events not yet closed
	maxLeases   uint64                  // ExporterConfig.MaxLeasesPerConsumer; 0: none
	epoch       uint64                  // the lease clock: ticks of leaseJanitor
	creditWait  chan struct{}           // closed when a credit may have come free; made by a waiter
	changed     chan struct{}           // closed on any other change waiters watch
	stats       ExporterStats
}

// recState is the life of an allocation record.
type recState uint8

const (
	recLive     recState = iota
	recRetiring          // no more offers; waiting for every consumer to close
	recFreeing           // closed everywhere; being freed
	recFreed
)

// allocRec is one device allocation the exporter lends from. Fields after
// handle are guarded by Exporter.mu.
type allocRec struct {
	id     uint64 // never reused by this process
	base   driver.DevicePtr
	size   uint64
	bufID  uint64
	handle transport.IPCHandle // cached: one IpcGetMemHandle per allocation
	owned  bool                // allocated by the exporter, freed on retire
	kind   transport.HandleKind
	vmm    *vmmMem // the producer's handle and mapping, for HandleFD
	ring   *Ring
	arena  *Arena

	state   recState
	sending int                    // offers between reservation and queueing
	mappers map[*consumer]struct{} // consumers that may have it mapped (their allocs say how)
	evBufs  map[*Buffer]struct{}   // buffers holding a pooled event
	// quarantined: a ring allocation replaced because a lost consumer may
	// read a buffer in it; members are its buffers still in use, whose
	// successors come in when they are idle.
	quarantined bool
	members     int
}

// expEvent is an interprocess event and its cached handle.
type expEvent struct {
	ev *driver.Event
	h  transport.IPCHandle
}

// NewExporter listens on the Unix socket at path (see transport.Listen for
// the rules on its directory) and accepts consumers in the background. ctx
// bounds the setup only. Buffers are lent from dctx's device; dctx must
// outlive the Exporter.
func NewExporter(ctx context.Context, dctx *driver.Context, path string, cfg ExporterConfig) (*Exporter, error) {
	if dctx == nil {
		return nil, errors.New("share: NewExporter: nil context")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	dev := transport.UUID(dctx.Device().UUID())
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
	tcfg.ReleaseEvents = true // Acquire, AcquireOn, Arena.Alloc and Wait honour them
	leaseTimeout := cfg.LeaseTimeout
	if leaseTimeout == 0 {
		leaseTimeout = DefaultLeaseTimeout
	}
	sharing, gran, why, err := resolveSharing(dctx.Device(), cfg.Sharing)
	if err != nil {
		return nil, err
	}
	ln, err := transport.Listen(ctx, path, tcfg)
	if err != nil {
		return nil, err
	}
	log.Info("share: exporter sharing path", "sharing", sharing.String(), "why", why)
	e := &Exporter{
		sharing: sharing, sharingWhy: why, gran: gran,
		dctx:    dctx,
		dev:     dev,
		ln:      ln,
		log:     log,
		done:    make(chan struct{}),
		conns:   make(map[*consumer]struct{}),
		allocs:  make(map[uint64]*allocRec),
		byBase:  make(map[driver.DevicePtr]*allocRec),
		pids:    make(map[int]*procWatch),
		cevents: make(map[*consEvent]struct{}),

		maxLeases: uint64(cfg.MaxLeasesPerConsumer),
	}
	e.life, e.cancel = context.WithCancel(context.Background())
	e.wg.Add(1)
	go e.acceptLoop()
	if leaseTimeout > 0 {
		e.wg.Add(1)
		go e.leaseJanitor(leaseTimeout)
	}
	return e, nil
}

// Addr returns the path of the exporter's socket.
func (e *Exporter) Addr() string { return e.ln.Addr() }

// --- Buffers ---------------------------------------------------------------

// newRecLocked records an allocation. mu held.
func (e *Exporter) newRecLocked(base driver.DevicePtr, size, bufID uint64, h driver.IpcMemHandle, owned bool) *allocRec {
	e.lastAllocID++
	rec := &allocRec{
		id: e.lastAllocID, base: base, size: size, bufID: bufID, handle: transport.IPCHandle(h), owned: owned,
		mappers: make(map[*consumer]struct{}),
		evBufs:  make(map[*Buffer]struct{}),
	}
	e.allocs[rec.id] = rec
	if !owned {
		e.byBase[base] = rec
	}
	return rec
}

// Register lends size bytes at p, memory of the exporter's context that
// the caller allocated and keeps ownership of. p need not be the base of
// its allocation: the base and size are found with AddressRange, and the
// allocation's IPC handle is taken once and cached for every buffer
// registered in it. The allocation is told apart by base address and
// buffer id, so memory freed and allocated again at the same address gets
// a new record (and a new allocation id on the wire).
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
		if rec = e.byBase[base]; rec == nil || rec.bufID != bufID {
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
	rec := e.byBase[base]
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
	delete(e.byBase, base)
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

// --- Offers -----------------------------------------------------------------

// OfferOptions go with an offer.
type OfferOptions struct {
	// Meta is small user metadata (shape, dtype, ...): one msgpack value
	// of at most transport.MaxMetaSize bytes, or nil. It is copied.
	Meta []byte
	// Stream, if not nil, is the stream whose work wrote the buffer: the
	// buffer's interprocess event is recorded on it, and the consumer's
	// stream waits for that event instead of the host synchronizing.
	// Offers of one buffer that are in flight together must use the same
	// stream. The writes must be ordered before the record: made on this
	// stream, or on the legacy NULL stream when this stream is a blocking
	// one (a non-blocking stream does not wait for NULL-stream work, and a
	// synchronous cuMemcpyHtoD from pageable memory may return before its
	// DMA lands). Nil: the buffer must be complete on the device when Offer
	// is called (synchronize first), and no event travels (and no event
	// call is made).
	Stream *driver.Stream
}

// Offer lends b to one consumer: the next, in round-robin order, that has
// a credit; it waits within ctx while none has. This is work distribution:
// each buffer goes to one consumer.
//
// The consumer holds the lease until it releases it; b.Wait, a Ring or an
// arena buffer's Free tell the producer when that is. The producer must
// not write b while it is leased.
func (e *Exporter) Offer(ctx context.Context, b *Buffer, opts OfferOptions) error {
	if err := ctx.Err(); err != nil {
		return err // a loop bounded by its context must end even when credit is free
	}
	if err := e.own(b); err != nil {
		return err
	}
	e.mu.Lock()
	var c *consumer
	for {
		if err := e.lendableLocked(b); err != nil {
			e.mu.Unlock()
			return err
		}
		if c = e.pickLocked(); c != nil {
			break
		}
		if err := e.waitLocked(ctx, &e.creditWait); err != nil {
			e.mu.Unlock()
			return err
		}
	}
	seq, gen, m := e.reserveLocked(c, b)
	ev := b.ev
	e.mu.Unlock()
	err := e.send(ctx, c, b, m, seq, gen, ev, &opts, true)
	e.mu.Lock()
	e.finishLocked(c, b, seq, err)
	e.mu.Unlock()
	return err
}

// Broadcast lends b to every consumer that keeps up, and returns how many
// it reached. It waits within ctx while no consumer can take b at all. A
// consumer that cannot take b now (at its credits or MaxLeasesPerConsumer,
// or, while other consumers are connected, holding half or more of b's
// ring, or of b's arena's bytes, so that it never pins a whole ring) is
// given up to BroadcastGrace to make room; if it does not, it misses b and
// is lagging: later broadcasts skip it without waiting until it has room
// again. What it misses is not queued for later (Stats.BroadcastMissed
// counts misses). So a stalled consumer costs the others one grace period,
// and its backlog is bounded. A consumer that goes away meanwhile is
// skipped. The event, if any, is recorded once.
func (e *Exporter) Broadcast(ctx context.Context, b *Buffer, opts OfferOptions) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	if err := e.own(b); err != nil {
		return 0, err
	}
	e.mu.Lock()
	for {
		if err := e.lendableLocked(b); err != nil {
			e.mu.Unlock()
			return 0, err
		}
		if slices.ContainsFunc(e.consumers, func(c *consumer) bool { return e.takesLocked(c, b) }) {
			break
		}
		// Credit, a new consumer and a lost one all wake creditWait.
		if err := e.waitLocked(ctx, &e.creditWait); err != nil {
			e.mu.Unlock()
			return 0, err
		}
	}
	targets := slices.Clone(e.consumers)
	// Pin b: a consumer that releases quickly must not return it to its
	// ring (or free it) while the broadcast is still going.
	b.sending++
	b.rec.sending++
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		e.unpinLocked(b)
		e.mu.Unlock()
	}()

	record := true
	n := 0
	var deadline time.Time // of the grace, from the first wait
	for _, c := range targets {
		e.mu.Lock()
		if err := e.lendableLocked(b); err != nil {
			e.mu.Unlock()
			return n, err
		}
		take, err := e.roomLocked(ctx, c, b, &deadline)
		if err != nil {
			e.mu.Unlock()
			return n, err
		}
		if !take {
			e.mu.Unlock()
			continue
		}
		seq, gen, m := e.reserveLocked(c, b)
		ev := b.ev
		e.mu.Unlock()
		err = e.send(ctx, c, b, m, seq, gen, ev, &opts, record)
		e.mu.Lock()
		e.finishLocked(c, b, seq, err)
		e.mu.Unlock()
		switch {
		case err == nil:
			n++
			record = false
		case ctx.Err() != nil || errors.Is(err, ErrClosed):
			return n, err
		case errors.Is(err, transport.ErrClosed), errors.Is(err, transport.ErrDisconnected),
			errors.Is(err, transport.ErrWriteTimeout), errors.Is(err, transport.ErrRemote):
			// This consumer is going away; its receive loop drops it.
		default:
			return n, err
		}
	}
	return n, nil
}

// BroadcastGrace is how long Broadcast waits for a consumer that keeps up
// to make room for a buffer before it misses it.
const BroadcastGrace = time.Second

// roomLocked waits, within ctx and the broadcast's grace, for c to be able
// to take b, and reports whether it can; one that cannot misses b and is
// lagging. The grace starts at the first wait of the broadcast. mu held.
func (e *Exporter) roomLocked(ctx context.Context, c *consumer, b *Buffer, deadline *time.Time) (bool, error) {
	for {
		if err := e.offerableLocked(b); err != nil {
			return false, err
		}
		switch {
		case !c.active:
			return false, nil
		case e.takesLocked(c, b):
			c.lagging = false
			return true, nil
		case c.lagging:
			e.stats.BroadcastMissed++
			return false, nil
		}
		if deadline.IsZero() {
			*deadline = time.Now().Add(BroadcastGrace)
		}
		wctx, cancel := context.WithDeadline(ctx, *deadline)
		err := e.waitLocked(wctx, &e.creditWait)
		cancel()
		switch {
		case ctx.Err() != nil:
			return false, ctx.Err()
		case err != nil && !errors.Is(err, context.DeadlineExceeded):
			return false, err
		case err != nil:
			c.lagging = true
			e.log.Warn("share: a consumer lags behind the broadcast; it misses buffers until it has room again",
				"peer", c.peer.String(), "leases", c.out)
		}
	}
}

// takesLocked reports whether c can take a broadcast of b now.
func (e *Exporter) takesLocked(c *consumer, b *Buffer) bool {
	if !c.active || c.out >= e.capLocked(c) {
		return false
	}
	if len(e.consumers) < 2 {
		return true
	}
	if r := b.rec.ring; r != nil {
		// Its leases in every allocation of the ring.
		n := 0
		for rec, m := range c.allocs {
			if rec.ring == r {
				n += m.leases
			}
		}
		return 2*n < len(r.bufs)
	}
	m := c.allocs[b.rec]
	if m == nil || m.leases == 0 {
		return true
	}
	switch rec := b.rec; {
	case rec.arena != nil:
		return 2*(m.bytes+b.size) <= rec.size
	}
	return true
}

// own checks that b is a buffer of e.
func (e *Exporter) own(b *Buffer) error {
	if b == nil || b.e != e {
		return errors.New("share: the buffer does not belong to this exporter")
	}
	return nil
}

// lendableLocked says why b cannot be lent now, if it cannot. mu held.
func (e *Exporter) lendableLocked(b *Buffer) error {
	if b.ring != nil && !b.held {
		// Back in its ring: the next Acquire may hand it out to be
		// rewritten while this lease would be read.
		return fmt.Errorf("%w: ring buffer at offset %d of allocation %d went back to its ring; Acquire it again", ErrNotHeld, b.off, b.rec.id)
	}
	return e.offerableLocked(b)
}

// offerableLocked says why b cannot be offered, if it cannot. mu held.
func (e *Exporter) offerableLocked(b *Buffer) error {
	switch {
	case e.closing:
		return ErrClosed
	case b.freed || b.freePending:
		return ErrFreed
	case b.rec.state != recLive:
		return fmt.Errorf("%w: allocation %d", ErrRetired, b.rec.id)
	}
	return nil
}

// pickLocked returns the consumer to lend to next, or nil if none can
// take a lease: of those below their cap, the one whose process holds the
// fewest leases, after every one whose process holds none through a lost
// connection (loadLocked), ties going round-robin. So a consumer that
// stops releasing stops being picked once it holds more than the others,
// and can never hold much more than its share of what is lent.
func (e *Exporter) pickLocked() *consumer {
	n := len(e.consumers)
	var best *consumer
	var bestLost bool
	var bestLoad uint64
	at := 0
	for i := range n {
		j := e.rr + i
		if j >= n {
			j -= n
		}
		c := e.consumers[j]
		if c.out >= e.capLocked(c) {
			continue
		}
		lost, load := c.loadLocked()
		if best != nil && (lost && !bestLost || lost == bestLost && load >= bestLoad) {
			continue
		}
		best, at, bestLost, bestLoad = c, j, lost, load
		if !lost && load == 0 {
			break
		}
	}
	if best != nil {
		e.rr = at + 1
		if e.rr == n {
			e.rr = 0
		}
	}
	return best
}

// reserveLocked takes a credit of c and a lease slot for b.
func (e *Exporter) reserveLocked(c *consumer, b *Buffer) (seq, gen uint64, _ *mapping) {
	var idx uint32
	if n := len(c.freeSlots); n > 0 {
		idx = c.freeSlots[n-1]
		c.freeSlots = c.freeSlots[:n-1]
	} else {
		idx = uint32(len(c.slots))
		c.slots = append(c.slots, leaseSlot{})
	}
	s := &c.slots[idx]
	s.gen++
	s.b = b
	s.sent = false
	s.epoch = e.epoch
	c.addOut(1)
	b.leases++
	b.sending++
	b.offers++
	b.rec.sending++
	e.stats.Leases++
	m := c.allocs[b.rec]
	if m == nil {
		m = &mapping{}
		c.allocs[b.rec] = m
		b.rec.mappers[c] = struct{}{}
	}
	m.leases++
	m.bytes += b.size
	return uint64(s.gen)<<32 | uint64(idx), b.offers, m
}

// send records the event if asked, and queues the offer.
func (e *Exporter) send(ctx context.Context, c *consumer, b *Buffer, m *mapping, seq, gen uint64, ev *expEvent, opts *OfferOptions, record bool) error {
	if opts.Stream != nil {
		if ev == nil {
			var err error
			if ev, err = e.bufferEvent(b); err != nil {
				return err
			}
		}
		if record {
			if err := ev.ev.Record(opts.Stream); err != nil {
				return fmt.Errorf("share: record the buffer's event: %w", err)
			}
		}
	}
	rec := b.rec
	o := transport.Offer{
		Seq: seq, AllocID: rec.id, Generation: gen, Handle: rec.handle, HandleKind: rec.kind,
		AllocSize: rec.size, Offset: b.off, Size: b.size, Device: e.dev, Meta: opts.Meta,
	}
	if ev != nil && opts.Stream != nil {
		if c.noEvents {
			// It may not open our event: wait for it here instead.
			if err := ev.ev.Synchronize(); err != nil {
				return fmt.Errorf("share: wait for the buffer's event: %w", err)
			}
		} else {
			o.Event, o.HasEvent = ev.h, true
		}
	}
	if rec.kind != transport.HandleFD {
		return c.conn.SendOffer(ctx, &o)
	}
	return e.sendFD(ctx, c, &o, m)
}

// finishLocked ends a reservation: on success the offer is out; on error
// it was not queued and the lease is undone.
func (e *Exporter) finishLocked(c *consumer, b *Buffer, seq uint64, err error) {
	if err == nil {
		e.stats.Offers++
		e.stats.BytesOffered += b.size
		if b.ring != nil && b.held {
			b.offered = true
		}
		if i := slices.Index(c.voided, seq); i >= 0 {
			// The consumer was lost while this offer was being sent, and
			// the loss voided the lease without counting it: it ends
			// here. (The consumer may have released it before: then it
			// was counted then.)
			c.voided = slices.Delete(c.voided, i, i+1)
			e.stats.Releases++
		} else if s := &c.slots[uint32(seq)]; !c.dropped && s.b == b && s.gen == uint32(seq>>32) {
			s.sent = true
		}
	} else if !c.dropped {
		idx := uint32(seq)
		if s := &c.slots[idx]; s.b == b && s.gen == uint32(seq>>32) {
			s.b = nil
			c.freeSlots = append(c.freeSlots, idx)
			c.addOut(-1)
			b.leases--
			e.stats.Leases--
			e.unmapLeaseLocked(c, b)
			e.notifyLocked(&e.creditWait)
		}
	}
	e.unpinLocked(b)
}

// unpinLocked ends one in-flight send of b.
func (e *Exporter) unpinLocked(b *Buffer) {
	b.sending--
	if b.rec.sending--; b.rec.sending == 0 && b.rec.state != recLive {
		e.notifyLocked(&e.changed)
	}
	if b.leases == 0 && b.sending == 0 {
		e.idleLocked(b)
	}
}

// bufferEvent returns b's interprocess event, taking one from the pool or
// creating one on first use.
func (e *Exporter) bufferEvent(b *Buffer) (*expEvent, error) {
	e.mu.Lock()
	if ev := b.ev; ev != nil {
		e.mu.Unlock()
		return ev, nil
	}
	var ev *expEvent
	if n := len(e.eventPool); n > 0 {
		ev = e.eventPool[n-1]
		e.eventPool = e.eventPool[:n-1]
	}
	e.mu.Unlock()
	if ev == nil {
		dev, err := e.dctx.NewEvent(driver.EventInterprocess | driver.EventDisableTiming)
		if err != nil {
			return nil, fmt.Errorf("share: create an interprocess event: %w", err)
		}
		h, err := dev.IpcHandle()
		if err != nil {
			dev.Close()
			return nil, fmt.Errorf("share: interprocess event handle: %w", err)
		}
		ev = &expEvent{ev: dev, h: transport.IPCHandle(h)}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if b.ev != nil {
		e.eventPool = append(e.eventPool, ev)
		return b.ev, nil
	}
	b.ev = ev
	b.rec.evBufs[b] = struct{}{}
	return ev, nil
}

// unleaseLocked ends one lease of b.
func (e *Exporter) unleaseLocked(b *Buffer) {
	b.leases--
	e.stats.Leases--
	if b.leases == 0 && b.sending == 0 {
		e.idleLocked(b)
	}
}

// idleLocked runs when b has no lease and no offer in flight: waiters
// wake, a pending Free completes, a ring buffer that was offered goes back
// to its ring.
func (e *Exporter) idleLocked(b *Buffer) {
	e.notifyLocked(&b.idle)
	switch {
	case b.freePending:
		e.freeBufferLocked(b)
	case b.ring != nil && b.held && b.offered:
		b.held, b.offered = false, false
		switch {
		case b.successor != nil:
			// Its allocation is being replaced: the successor takes its
			// slot.
			e.releaseAfterLocked(b)
			b.ring.free <- b.successor
			b.successor = nil
			e.memberIdleLocked(b.rec)
		case b.abandoned:
			// Never written again; its slot was refilled (or could not be).
			e.releaseAfterLocked(b)
		default:
			b.ring.free <- b // never blocks: the ring has room for all its buffers
		}
	}
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
}

// --- Consumers --------------------------------------------------------------

// --- Retiring ----------------------------------------------------------------

// Retire retires the allocation that holds b, with every buffer in it:
// offers of them stop, every consumer that may map it is told, and once
// each has closed its mapping (or said goodbye, or its process exited) the
// allocation is freed if the exporter allocated it (a Ring or an Arena),
// or handed back to its owner (Register). It waits within ctx and never
// frees early: if ctx ends first it returns ctx's error and the
// retirement goes on; a later Retire or Shutdown finishes it.
func (e *Exporter) Retire(ctx context.Context, b *Buffer) error {
	if err := e.own(b); err != nil {
		return err
	}
	return e.retire(ctx, b.rec)
}

func (e *Exporter) retire(ctx context.Context, rec *allocRec) error {
	if err := e.startRetire(ctx, rec); err != nil {
		return err
	}
	return e.finishRetire(ctx, rec)
}

// startRetire stops offers of rec and tells its consumers.
func (e *Exporter) startRetire(ctx context.Context, rec *allocRec) error {
	e.mu.Lock()
	if rec.state == recLive {
		rec.state = recRetiring
		e.notifyLocked(&e.creditWait) // offers waiting for credit give up
		if rec.arena != nil {
			e.notifyLocked(&rec.arena.room)
		}
	}
	// An offer of rec between reservation and queueing would reach the
	// consumer after the retire: wait for those to leave first.
	for rec.sending > 0 {
		if err := e.waitLocked(ctx, &e.changed); err != nil {
			e.mu.Unlock()
			return err
		}
	}
	var targets []*consumer
	for c := range rec.mappers {
		if m := c.allocs[rec]; !m.retireSent && !c.ended {
			m.retireSent = true
			targets = append(targets, c)
		}
	}
	e.mu.Unlock()
	for _, c := range targets {
		if err := c.conn.SendRetire(ctx, rec.id); err != nil && ctx.Err() != nil {
			e.mu.Lock()
			if m := c.allocs[rec]; m != nil {
				m.retireSent = false // not queued: tell it on the next try
			}
			e.mu.Unlock()
			return err
		}
		// Any other error means the connection failed: c is dropped
		// once it is known to hold nothing.
	}
	return nil
}

// finishRetire waits until no consumer maps rec, then frees it.
func (e *Exporter) finishRetire(ctx context.Context, rec *allocRec) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for {
		switch {
		case rec.state == recFreed:
			return nil
		case rec.state == recRetiring && len(rec.mappers) == 0 && rec.sending == 0:
			rec.state = recFreeing
			e.mu.Unlock()
			var err error
			if rec.owned {
				err = e.freeMemory(rec)
			}
			e.mu.Lock()
			if err != nil {
				rec.state = recRetiring
				e.notifyLocked(&e.changed)
				return fmt.Errorf("share: free allocation %d at %#x: %w", rec.id, uint64(rec.base), err)
			}
			e.dropRecLocked(rec)
			return nil
		}
		if err := e.waitLocked(ctx, &e.changed); err != nil {
			return err
		}
	}
}

// dropRecLocked forgets a freed (or handed back) allocation.
func (e *Exporter) dropRecLocked(rec *allocRec) {
	rec.state = recFreed
	delete(e.allocs, rec.id)
	if e.byBase[rec.base] == rec {
		delete(e.byBase, rec.base)
	}
	for b := range rec.evBufs {
		e.eventPool = append(e.eventPool, b.ev)
		b.ev = nil
	}
	clear(rec.evBufs)
	if r := rec.ring; r != nil && !rec.quarantined && !r.deadClosed {
		r.deadClosed = true
		close(r.dead)
	}
	if a := rec.arena; a != nil {
		// Nothing will be allocated there again.
		for _, b := range a.pending {
			for _, ce := range b.after {
				e.unrefEventLocked(ce, 1)
			}
			b.after = nil
		}
		a.pending = nil
	}
	e.stats.Retired++
	e.notifyLocked(&e.changed)
}

// --- Ending -------------------------------------------------------------------

// Shutdown ends the exporter gracefully: it stops offering and accepting,
// retires every allocation, waits within ctx until every consumer has
// closed its mappings (or left), frees what the exporter allocated, says
// goodbye to each consumer and closes.
//
// If ctx ends first, it still says goodbye to every consumer that holds
// nothing (so that a well-behaved consumer is not told the producer
// crashed), drops the others with an error that says why, closes as Close
// does (never freeing what a consumer may map), and returns an error that
// matches ctx's and names what each blocking consumer still maps.
func (e *Exporter) Shutdown(ctx context.Context) error {
	e.mu.Lock()
	e.closing = true
	e.notifyLocked(&e.creditWait)
	e.notifyLocked(&e.changed)
	recs := slices.Collect(maps.Values(e.allocs))
	e.mu.Unlock()
	e.ln.Close()
	var err error
	for _, rec := range recs {
		if err = e.startRetire(ctx, rec); err != nil {
			break
		}
	}
	if err == nil {
		for _, rec := range recs {
			if err = e.finishRetire(ctx, rec); err != nil {
				break
			}
		}
	}
	var done, stuck []*consumer
	e.mu.Lock()
	if err != nil {
		if blockers := e.blockersLocked(recs); blockers != nil {
			err = fmt.Errorf("share: shutdown: %w; %w", err, blockers)
		}
	}
	for c := range e.conns {
		switch {
		case c.ended || c.kicked:
		case c.holdsLocked():
			stuck = append(stuck, c)
		default:
			c.sentBye = true
			done = append(done, c)
		}
	}
	e.mu.Unlock()
	for _, c := range stuck {
		e.kick(c, fmt.Errorf("%w: the producer shut down before this consumer released its leases and closed its mappings", transport.ErrTimeout))
	}
	// The goodbyes go out even after ctx ended, briefly: they cost the
	// good consumers nothing and tell them the truth.
	byeCtx, cancel := ctx, context.CancelFunc(func() {})
	if ctx.Err() != nil {
		byeCtx, cancel = context.WithTimeout(context.Background(), goodbyeGrace)
	}
	defer cancel()
	// Say goodbye to all, then wait for each to close (a consumer closes
	// when it reads the goodbye): closing first could make a consumer's
	// last write fail before it has read the goodbye.
	for _, c := range done {
		c.conn.SendGoodbye(byeCtx, "producer shut down")
	}
	for _, c := range done {
		select {
		case <-c.done:
			continue
		case <-byeCtx.Done():
			if err == nil {
				err = fmt.Errorf("share: shutdown: waiting for consumers to read the goodbye: %w", byeCtx.Err())
			}
		}
		break
	}
	return errors.Join(err, e.Close())
}

// goodbyeGrace bounds the goodbyes of a Shutdown whose context ended.
const goodbyeGrace = time.Second

// Close ends the exporter at once: it stops listening and closes every
// connection without waiting for anything. It frees only the allocations
// it made that no consumer may still map; an allocation that a consumer
// may still map is never freed early: it stays allocated (and is logged)
// until the context is destroyed or the process exits. Use Shutdown to
// free everything. Close is idempotent.
func (e *Exporter) Close() error {
	var errs []error
	e.closeOnce.Do(func() {
		e.mu.Lock()
		e.closing = true
		close(e.done)
		conns := slices.Collect(maps.Keys(e.conns))
		e.mu.Unlock()
		e.ln.Close()
		e.cancel()
		for _, c := range conns {
			c.conn.Close()
		}
		e.wg.Wait()

		e.mu.Lock()
		defer e.mu.Unlock()
		for _, rec := range e.allocs {
			if rec.state == recFreed || rec.state == recFreeing {
				continue // a Retire in flight frees it
			}
			// A consumer's handle and mapping keep VMM memory alive by
			// themselves: only legacy IPC memory must outlive its mappers.
			if rec.vmm == nil && len(rec.mappers) > 0 || rec.sending > 0 {
				if rec.owned {
					e.log.Warn("share: Close leaves an allocation that a consumer may still map allocated",
						"alloc", rec.id, "base", fmt.Sprintf("%#x", uint64(rec.base)), "size", rec.size, "consumers", len(rec.mappers))
				}
				continue
			}
			if rec.owned {
				if err := e.freeMemory(rec); err != nil {
					errs = append(errs, fmt.Errorf("share: free allocation %d: %w", rec.id, err))
					continue
				}
			}
			e.dropRecLocked(rec)
		}
		for _, ev := range e.eventPool {
			if err := ev.ev.Close(); err != nil {
				errs = append(errs, err)
			}
		}
		e.eventPool = nil
		for ce := range e.cevents {
			if err := ce.ev.Close(); err != nil {
				errs = append(errs, err)
			}
			ce.ev = nil
		}
		clear(e.cevents)
	})
	return errors.Join(errs...)
}
