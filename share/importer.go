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
	"weak"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
	"golang.org/x/sys/unix"
)

// ImporterConfig configures an Importer. The zero value is usable.
type ImporterConfig struct {
	// Credits is the most leases the importer holds at once, queued and
	// returned by Next: the producer never offers more. 0 means 64; at most
	// MaxCredits.
	Credits uint32
	// Stream is the stream, of the importer's context, that is made to
	// wait on the producer's event when Next returns a lease whose offer
	// carries one; work on it (or after it) sees the producer's writes.
	// Nil: Next synchronizes the event on the host instead.
	Stream *driver.Stream
	// Registry holds the mappings. Importers of one process may share
	// one, and then share mappings. Nil means a registry of this importer
	// alone.
	Registry *Registry
	// AllowedUIDs are the users whose producers are accepted. Empty means
	// this process's effective user only.
	AllowedUIDs []uint32
	// Logger receives leases that were garbage-collected without Release.
	// Nil means slog.Default().
	Logger *slog.Logger
	// WriteTimeout bounds how long the producer may leave this consumer's
	// messages unread (transport.Config.WriteTimeout). 0 means the
	// transport's default.
	WriteTimeout time.Duration
	// DisableShm keeps the messages on the socket instead of the shm
	// channel, memory shared with the producer (transport.Config.DisableShm).
	DisableShm bool
	// ShmSpin is how long a receive polls the shm lane before it sleeps
	// (transport.Config.ShmSpin). 0 means the transport's default.
	ShmSpin time.Duration
	// DialWait is how long Dial waits for a producer to listen at the
	// path, trying again while the socket does not exist or refuses
	// connections (a producer that is starting or restarting), within
	// Dial's context. 0 means one try: fail at once.
	DialWait time.Duration
	// Reconnect, if not nil, keeps the importer through a producer's
	// restart: when the producer vanishes, or says goodbye because it
	// restarts, the importer connects again to the producer that takes
	// its place at the path, and Next goes on with that one's leases
	// (importer_reconnect.go). Nil: the importer ends with the producer.
	// With it, Dial also waits for a first producer as long as a
	// reconnection would, unless DialWait is longer.
	Reconnect *ReconnectPolicy
}

// MaxCredits bounds ImporterConfig.Credits.
const MaxCredits = 1 << 16

// ImporterStats are an importer's counters.
type ImporterStats struct {
	Leases   uint64 // returned by Next
	Direct   uint64 // of those, read from the connection by Next itself, not queued by the background reader
	Released uint64 // released, by Release or on the user's behalf
	Leaked   uint64 // garbage-collected without Release (and then released)
	Held     int    // returned by Next and not released now
	Mappings int    // allocations this importer holds open now
	Retired  uint64 // allocations the producer retired that this importer closed
	// EventsOpened counts the producer's events opened from their handles:
	// each once, however many offers carry it.
	EventsOpened uint64
	// Reconnects counts the producers connected to after the first one
	// (ImporterConfig.Reconnect).
	Reconnects uint64
	// ReleasesDropped counts releases of leases whose producer was gone
	// (a producer replaced since): they go nowhere, since no producer
	// waits for them.
	ReleasesDropped uint64
}

// importer states.
const (
	stateOpen     = iota
	stateShutting // Shutdown: no new leases, waiting for the held ones
	stateClosed
)

// Importer is the consumer side: one connection to a producer. Offers are
// mapped through the registry (one open per allocation). While the
// application keeps calling Next, the goroutine in Next reads the
// connection itself and returns the offer it reads, with no other
// goroutine involved; once Next has not been called for a moment, a
// goroutine of the importer's own reads instead, queueing offers for Next
// and answering the producer's retires as soon as no lease is in the
// allocation, whether or not anyone calls Next (importer_read.go).
type Importer struct {
	dctx   *driver.Context
	dev    driver.UUID
	conn   *transport.Conn // the current producer's; replaced (under mu, with rd's token) by a reconnection
	peer   transport.Peer
	reg    *Registry
	stream *driver.Stream
	log    *slog.Logger

	ready    chan *Lease   // mapped offers for Next, and mapping errors
	stop     chan struct{} // closed when Next must stop: producer gone, Shutdown or Close
	recvDone chan struct{} // closed when the connection's end has been read
	bgDone   chan struct{} // closed when the background reader has returned
	leaked   atomic.Uint64

	// The reading (importer_read.go): whoever holds rd's token reads the
	// connection, into msg, and sets readDone at its end. rd counts the
	// goroutines waiting in Next.
	rd       handover
	msg      transport.Message
	readDone bool

	mu        sync.Mutex
	state     int
	ended     error // why no more leases come; set with stop closed
	gone      bool  // the producer is gone: nothing more is sent to it
	allocs    map[uint64]*impAlloc
	block     weak.Pointer[leaseBlock] // where new leases come from
	failed    map[uint64]error         // vmm allocations whose import failed
	events    map[transport.Handle]*driver.Event
	relEvs    map[*driver.Stream]*relEvent // stream-ordered releases: one event per stream
	relEvOK   atomic.Bool                  // the producer honours release events; replaced by a reconnection
	pending   int                          // releases queued and not yet pushed
	pushAt    int                          // pending releases that are pushed at once
	pushTimer *time.Timer                  // pushes after releaseDelay
	heldZero  chan struct{}                // closed when held reaches 0; made by Shutdown
	stats     ImporterStats                // but for the counters below
	byeWhy    string
	byeCode   transport.GoodbyeCode

	// Reconnection (importer_reconnect.go).
	path      string
	tcfg      transport.Config
	policy    *ReconnectPolicy
	session   uint64                 // the current producer's, or one of our own when it names none: part of every registry key
	life      context.Context        // ends with the importer: a reconnection's dial
	endLife   context.CancelFunc     // called by endLocked
	up        chan struct{}          // while reconnecting: closed when a producer is back, or the importer ends
	reconDone chan struct{}          // closed when the reconnecting goroutine has returned; nil if none ran
	lost      map[*impAlloc]struct{} // mappings of producers gone that leases are still in
	stale     []*driver.Event        // gone producers' events that a Next may have been using: destroyed by close
	connNow   atomic.Pointer[transport.Conn]

	// Updated without mu: by handOut (see there), and around the uses of
	// the producer's events (importer_end.go). held goes down with mu
	// held, and is read with mu held where it decides something.
	ending    atomic.Bool   // set by endLocked before anything else
	held      atomic.Int64  // leases returned (or being returned) and not released
	handed    atomic.Uint64 // ImporterStats.Leases
	waitNanos atomic.Int64  // time spent in Next waiting for an offer, once timing (importer_snapshot.go)
	timing    atomic.Bool   // set by the first Snapshot
	direct    atomic.Uint64 // ImporterStats.Direct
	evUse     atomic.Int64  // Nexts and WaitOns that may use a producer's event without mu (useEvent)
	evClosing atomic.Bool   // close wants the producer's events destroyed
	evFreed   atomic.Bool   // they were (freeEvents)
}

// impAlloc is an allocation this importer holds open in the registry.
type impAlloc struct {
	id      uint64
	handle  transport.Handle
	ent     *regEntry
	leases  int  // queued and returned
	retired bool // the producer retired it: close once no lease is in it
	closed  bool // this importer's hold is dropped
	// lost: its producer is gone (and maybe replaced since): nothing
	// about it is sent any more. Set with mu held; loaded without it by
	// Next and Ptr.
	lost atomic.Bool
}

// dead reports whether a's memory died with its producer: legacy IPC
// memory is freed when the producer exits; a VMM import keeps its own.
func (a *impAlloc) dead() bool { return a.lost.Load() && a.ent.vmm == nil }

// Dial connects to the exporter at path and returns an importer mapping
// into dctx, which must outlive it.
func Dial(ctx context.Context, path string, dctx *driver.Context, cfg ImporterConfig) (*Importer, error) {
	if dctx == nil {
		return nil, errors.New("share: Dial: nil context")
	}
	if cfg.Credits == 0 {
		cfg.Credits = 64
	}
	if cfg.Credits > MaxCredits {
		return nil, fmt.Errorf("share: Dial: Credits %d, limit %d", cfg.Credits, MaxCredits)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	reg := cfg.Registry
	if reg == nil {
		reg = NewRegistry()
	}
	dev := dctx.Device().UUID()
	tcfg := transport.DefaultConfig(transport.RoleConsumer)
	tcfg.Devices = []transport.UUID{dev}
	tcfg.Credits = cfg.Credits
	tcfg.AcceptVMM = true // vmm allocations (PROTOCOL.md, section 4.1)
	tcfg.Logger = log
	tcfg.WriteTimeout = cfg.WriteTimeout
	tcfg.DisableShm, tcfg.ShmSpin = cfg.DisableShm, cfg.ShmSpin
	if len(cfg.AllowedUIDs) > 0 {
		tcfg.AllowedUIDs = cfg.AllowedUIDs
	}
	pol, err := cfg.Reconnect.resolve()
	if err != nil {
		return nil, err
	}
	wait := cfg.DialWait
	if pol != nil {
		wait = max(wait, pol.firstWait())
	}
	conn, err := dialWaiting(ctx, path, tcfg, wait, pol != nil)
	if err != nil {
		return nil, err
	}
	im := &Importer{
		dctx: dctx, dev: dev, conn: conn, peer: conn.Peer(), reg: reg, stream: cfg.Stream, log: log,
		// Room for every credit, and as much again for mapping errors,
		// which are released at once and so free their credit.
		ready:    make(chan *Lease, 2*int(cfg.Credits)),
		stop:     make(chan struct{}),
		recvDone: make(chan struct{}),
		bgDone:   make(chan struct{}),
		allocs:   make(map[uint64]*impAlloc),
		failed:   make(map[uint64]error),
		events:   make(map[transport.Handle]*driver.Event),
		relEvs:   make(map[*driver.Stream]*relEvent),
		pushAt:   max(1, int(cfg.Credits)/4),
		path:     path, tcfg: tcfg, policy: pol,
		session: sessionOf(conn.Peer()),
		lost:    make(map[*impAlloc]struct{}),
	}
	im.relEvOK.Store(releaseEventsOK(conn.Peer()))
	im.life, im.endLife = context.WithCancel(context.Background())
	im.connNow.Store(conn)
	im.pushTimer = time.AfterFunc(time.Hour, im.push)
	im.pushTimer.Stop()
	im.rd.init(func() { connInterrupt(im.connNow.Load()) })
	go im.readLoop(im.recvDone, im.bgDone)
	return im, nil
}

// Producer describes the producer this importer is connected to (the
// latest one, after a reconnection).
func (im *Importer) Producer() Peer {
	im.mu.Lock()
	defer im.mu.Unlock()
	return peerOf(im.peer)
}

// Registry returns the registry holding the importer's mappings.
func (im *Importer) Registry() *Registry { return im.reg }

// Shm reports whether the connection's messages go through the shm
// channel, memory shared with the producer (both sides allow it), rather
// than on its socket.
func (im *Importer) Shm() bool {
	im.mu.Lock()
	defer im.mu.Unlock()
	return im.conn.Shm()
}

// Done returns a channel that is closed once no more leases come: the
// producer is gone (its goodbye, a drop, its death; with a reconnect
// policy, none came back within its deadline) or Shutdown or Close
// began. Leases Next already returned stay valid until released; Err says why.
func (im *Importer) Done() <-chan struct{} { return im.stop }

// Err returns nil until Done is closed, then why no more leases come: an
// error matching ErrProducerGone (and io.EOF after the producer's goodbye,
// or the producer's reason when it dropped this consumer), or ErrClosed.
func (im *Importer) Err() error {
	im.mu.Lock()
	defer im.mu.Unlock()
	return im.ended
}

// Stats returns the importer's counters.
func (im *Importer) Stats() ImporterStats {
	im.mu.Lock()
	defer im.mu.Unlock()
	s := im.stats
	s.Leaked = im.leaked.Load()
	// held also counts a lease being returned, or dropped by a Next
	// that found the importer stopping: Held is what was returned and
	// not released. direct first: it goes up after handed.
	s.Direct = im.direct.Load()
	s.Leases = im.handed.Load()
	s.Held = int(s.Leases - s.Released)
	for _, a := range im.allocs {
		if !a.closed {
			s.Mappings++
		}
	}
	s.Mappings += len(im.lost)
	return s
}

// Next waits within ctx for the next lease. The lease's memory is mapped
// and, if the offer carries an event, the importer's stream waits on it
// (or the host synchronized it) before Next returns.
//
// Once the producer is gone, Next returns an error matching
// ErrProducerGone (and io.EOF if the producer said goodbye); after
// Shutdown or Close, ErrClosed. An offer that could not be mapped gives
// its error (ErrPeerAccessUnsupported, ErrStaleHandle, ...) once, and the
// offer is handed back to the producer; the importer goes on.
//
// With ImporterConfig.Reconnect, a producer that vanishes or says goodbye
// because it restarts does not end Next: it waits, within ctx, for the
// producer that takes its place, and goes on with its leases; it never
// returns a lease of a producer already gone. If none comes back within
// the policy's deadline, Next returns an error matching
// ErrReconnectDeadline and ErrProducerGone.
func (im *Importer) Next(ctx context.Context) (*Lease, error) {
	return im.NextOn(ctx, im.stream)
}

// NextOn is Next with the lease made ready on stream s instead of the
// importer's stream: s waits on the producer's event, so work queued on s
// after NextOn returns sees the producer's writes (nil: the host waits).
// A pool gives each worker a stream of its own this way, so that their
// GPU work overlaps. Lease.Stream returns s.
func (im *Importer) NextOn(ctx context.Context, s *driver.Stream) (*Lease, error) {
	for {
		l, err := im.next(ctx, s)
		if l != nil || err != nil {
			return l, err
		}
		// A lease of a producer that was lost meanwhile: never
		// returned (its producer's writes may not be complete, or its
		// memory is gone with it). The next lease is the new producer's.
	}
}

// next is one try of NextOn: nil and no error for a lease of a lost
// producer, which it has dropped.
func (im *Importer) next(ctx context.Context, s *driver.Stream) (*Lease, error) {
	if err := ctx.Err(); err != nil {
		// A loop bounded by its context must end even while leases keep
		// arriving: the fast path below would never see it.
		return nil, err
	}
	var l *Lease
	direct := false
	select {
	case l = <-im.ready:
	default:
		var err error
		if l, direct, err = im.wait(ctx); err != nil {
			return nil, err
		}
	}
	if l.err != nil {
		return nil, l.err
	}
	if l.ev != nil {
		// Close leaves the producer's events to the last Next that may
		// wait on one (importer_end.go): this one counts before handOut
		// looks whether the importer has stopped. A reconnection leaves
		// the lost producer's events to close the same way
		// (importer_reconnect.go): it marks the allocations lost before
		// it looks at evUse, and this counts before it looks at lost.
		im.useEvent()
		defer im.doneWithEvent()
	}
	if err := im.handOut(l, direct); err != nil {
		return nil, err
	}
	if l.a.lost.Load() {
		l.Release() // counted in ReleasesDropped
		return nil, nil
	}
	l.stream = s
	if l.ev != nil {
		if eventWaiting != nil {
			eventWaiting() // a test closes the importer here
		}
		var err error
		if s != nil {
			err = s.WaitEvent(l.ev)
		} else {
			err = l.ev.Synchronize()
		}
		if err != nil {
			l.Release()
			return nil, fmt.Errorf("share: wait for the producer's event: %w", err)
		}
	}
	return l, nil
}

// wait waits for the next lease with none queued: it reads the
// connection itself while nobody else does (importer_read.go); direct says it
// did.
func (im *Importer) wait(ctx context.Context) (_ *Lease, direct bool, _ error) {
	im.rd.begin()
	defer im.rd.end()
	if im.timing.Load() {
		defer im.waited(time.Now()) // only when no lease was queued: the slow path
	}
	pushed := false
	for {
		// The token, if free, without a select of every case: this runs
		// once per handoff. readFor pushes the releases before it waits
		// for the producer.
		took := false
		select {
		case <-im.rd.tok:
			took = true
		default:
		}
		if !took {
			if !pushed {
				// About to wait for the producer: what was released must
				// reach it first, or it may have no credit to offer with.
				im.push()
				pushed = true
			}
			select {
			case l := <-im.ready:
				return l, false, nil
			case <-im.rd.tok:
				took = true
			case <-im.stop:
			case <-ctx.Done():
			}
		}
		if took {
			var l *Lease
			direct = im.readFor(ctx, &l)
			im.rd.give()
			if l != nil {
				return l, direct, nil
			}
			// The context ended, the importer stopped, or the
			// producer is gone and a reconnection is under way.
		}
		if err := ctx.Err(); err != nil {
			return nil, false, err
		}
		if im.stopped() {
			im.mu.Lock()
			defer im.mu.Unlock()
			return nil, false, im.ended
		}
		if up := im.reconnecting(); up != nil {
			// Nothing to read until a producer is back: wait for it
			// rather than take the token again and again.
			select {
			case l := <-im.ready:
				return l, false, nil
			case <-up:
			case <-im.stop:
			case <-ctx.Done():
			}
		}
	}
}

// handOut accounts for a lease given to the user, unless the importer has
// stopped meanwhile, in which case the lease is dropped. While the
// importer runs it takes no lock: mu is what a pool's workers contend on,
// and this is one of the three times a handoff would take it (with the
// offer and the release).
//
// Shutdown must never miss a lease returned: it stores ending, then
// loads held; handOut adds to held, then loads ending. The atomics are
// sequentially consistent, so at least one of the two sees the other's
// write: either Shutdown waits for this lease, or handOut drops it.
func (im *Importer) handOut(l *Lease, direct bool) error {
	im.held.Add(1)
	if handingOut != nil {
		handingOut() // a test stops the importer here
	}
	if im.ending.Load() {
		im.mu.Lock()
		defer im.mu.Unlock()
		im.unholdLocked()
		im.dropQueuedLocked(l)
		return im.ended
	}
	l.st.out[l.idx].live.Store(true)
	im.handed.Add(1)
	if direct {
		im.direct.Add(1)
	}
	return nil
}

// handingOut, if set (tests only), runs in handOut between counting the
// lease in held and looking at ending; eventWaiting, in NextOn after
// handOut, before the wait on the producer's event; closeLeavesEvents, in
// Close when it leaves the events to such a Next.
var handingOut, eventWaiting, closeLeavesEvents func()

// onOffer maps an offer and returns its lease (one with the error if it
// could not be mapped; nil if the importer is shutting down).
func (im *Importer) onOffer(o *transport.Offer) *Lease {
	// The descriptors are ours; an import keeps what it needs.
	defer func() {
		for _, fd := range o.FDs {
			unix.Close(fd)
		}
	}()
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.state != stateOpen {
		// Shutting down: hand it straight back.
		im.sendReleaseLocked(o.Seq, nil)
		return nil
	}
	l, err := im.leaseLocked(o)
	if errors.Is(err, transport.ErrMalformed) || errors.Is(err, transport.ErrNotSupported) {
		// The producer broke the protocol: nothing it sends can be trusted.
		im.conn.CloseWithError(err)
	}
	if err != nil {
		im.sendReleaseLocked(o.Seq, nil)
		l = &Lease{err: fmt.Errorf("share: offer %d of allocation %d: %w", o.Seq, o.AllocID, err)}
	}
	return l
}

// leaseLocked maps o (or finds its mapping) and builds its lease.
func (im *Importer) leaseLocked(o *transport.Offer) (*Lease, error) {
	a := im.allocs[o.AllocID]
	switch {
	case a == nil && im.failed[o.AllocID] != nil:
		// Its fd came with the first offer, whose import failed.
		return nil, im.failed[o.AllocID]
	case a == nil:
		key := regKey{
			pid: im.peer.PID, inst: im.peer.InstanceID, session: im.session,
			src: o.Device, dst: im.dev, handle: o.Handle,
		}
		var ent *regEntry
		var err error
		switch o.HandleKind {
		case transport.HandleIPC:
			ent, err = im.reg.acquire(im.dctx, &key, o.AllocID, o.AllocSize)
		case transport.HandleVMM:
			if len(o.FDs) != 1 {
				return nil, fmt.Errorf("%w: first offer of vmm allocation %d carries %d descriptors, want 1", transport.ErrMalformed, o.AllocID, len(o.FDs))
			}
			ent, err = im.reg.acquireFD(im.dctx, &key, o.FDs[0], o.AllocID, o.AllocSize)
		default:
			return nil, fmt.Errorf("%w: offer of allocation %d with handle kind %s, which this consumer cannot import", transport.ErrNotSupported, o.AllocID, o.HandleKind)
		}
		if err != nil && o.HandleKind == transport.HandleVMM && !errors.Is(err, transport.ErrMalformed) {
			if len(im.failed) >= maxFailedAllocs {
				return nil, fmt.Errorf("%w: more than %d allocations failed to import", transport.ErrLimit, maxFailedAllocs)
			}
			im.failed[o.AllocID] = err
		}
		if err != nil {
			return nil, err
		}
		a = &impAlloc{id: o.AllocID, handle: o.Handle, ent: ent}
		im.allocs[o.AllocID] = a
	case len(o.FDs) > 0:
		return nil, fmt.Errorf("%w: offer of allocation %d, mapped already, carries %d descriptors", transport.ErrMalformed, o.AllocID, len(o.FDs))
	case a.handle != o.Handle:
		return nil, fmt.Errorf("%w: allocation %d was mapped from another handle", ErrStaleHandle, o.AllocID)
	case a.retired:
		return nil, fmt.Errorf("%w: allocation %d was offered after the producer retired it", ErrStaleHandle, o.AllocID)
	}
	if o.Offset+o.Size > a.ent.size {
		return nil, fmt.Errorf("share: offer of [%d, %d) beyond the %d bytes mapped: %w",
			o.Offset, o.Offset+o.Size, a.ent.size, driver.ErrInvalidValue)
	}
	var ev *driver.Event
	if o.HasEvent {
		if ev = im.events[o.Event]; ev == nil {
			var err error
			if ev, err = im.dctx.IpcOpenEventHandle(driver.IpcEventHandle(o.Event)); err != nil {
				return nil, fmt.Errorf("share: open the producer's event: %w", err)
			}
			im.events[o.Event] = ev
			im.stats.EventsOpened++
		}
	}
	l := im.newLeaseLocked()
	h := &l.st.out[l.idx] // live once returned
	h.a, h.seq = a, o.Seq
	l.a, l.seq, l.gen, l.ptr, l.size, l.ev = a, o.Seq, o.Generation, a.ent.ptr+driver.DevicePtr(o.Offset), o.Size, ev
	if n := len(o.Meta); n > 0 {
		if n <= len(l.metaBuf) {
			l.meta = l.metaBuf[:copy(l.metaBuf[:], o.Meta)]
		} else {
			l.meta = append([]byte(nil), o.Meta...)
		}
	}
	a.leases++
	return l, nil
}

// maxFailedAllocs bounds the vmm allocations whose failed import an
// importer remembers until they are retired.
const maxFailedAllocs = 1024

// onRetire closes the allocation's mapping now if no lease is in it, else
// when the last one is released.
func (im *Importer) onRetire(allocID uint64) {
	im.mu.Lock()
	defer im.mu.Unlock()
	a := im.allocs[allocID]
	if a == nil {
		// Never mapped here (its offer failed to map): nothing to close.
		delete(im.failed, allocID)
		im.sendClosedLocked(allocID)
		return
	}
	a.retired = true
	if a.leases == 0 {
		im.closeAllocLocked(a)
	}
}

// closeAllocLocked drops this importer's hold on a's mapping (the
// registry closes it with the last hold) and, if the producer retired it,
// confirms with closed.
func (im *Importer) closeAllocLocked(a *impAlloc) {
	if a.closed {
		return
	}
	// GPU work released stream-ordered may still read the mapping: it
	// must be done before the mapping closes (and the producer is told).
	im.syncReleasesLocked()
	a.closed = true
	if im.allocs[a.id] == a {
		// Not a lost producer's: its id may name a new one's allocation.
		delete(im.allocs, a.id)
	}
	delete(im.lost, a)
	if err := im.reg.release(a.ent); err != nil {
		im.log.Error("share: closing a mapping failed", "alloc", a.id, "err", err)
	}
	if a.retired && !a.lost.Load() {
		im.stats.Retired++
		im.sendClosedLocked(a.id)
	}
}
