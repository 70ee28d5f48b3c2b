//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"io"
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
	// handed out: the producer never lends more. 0 means 64; at most
	// MaxCredits.
	Credits uint32
	// Stream is the stream, of the importer's context, that is made to
	// wait on the producer's event when Next hands out a lease whose offer
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
	// DisableRing keeps the messages on the socket instead of two rings
	// in memory shared with the producer (transport.Config.DisableRing).
	DisableRing bool
	// RingSpin is how long a receive polls the ring before it sleeps
	// (transport.Config.RingSpin). 0 means the transport's default.
	RingSpin time.Duration
	// DialWait is how long Dial waits for a producer to listen at the
	// path, trying again while the socket does not exist or refuses
	// connections (a producer that is starting or restarting), within
	// Dial's context. 0 means one try: fail at once.
	DialWait time.Duration
}

// MaxCredits bounds ImporterConfig.Credits.
const MaxCredits = 1 << 16

// ImporterStats are an importer's counters.
type ImporterStats struct {
	Leases   uint64 // handed out by Next
	Released uint64 // released, by Release or on the user's behalf
	Leaked   uint64 // garbage-collected without Release (and then released)
	Held     int    // handed out and not released now
	Mappings int    // allocations this importer holds open now
	Retired  uint64 // allocations the producer retired that this importer closed
}

// importer states.
const (
	stateOpen     = iota
	stateShutting // Shutdown: no new leases, waiting for the held ones
	stateClosed
)

// Importer is the consumer side: one connection to a producer. A
// goroutine of its own receives offers, maps them (through the registry:
// one open per allocation) and queues them for Next, and answers the
// producer's retires as soon as no lease is in the allocation, whether or
// not anyone calls Next.
type Importer struct {
	dctx   *driver.Context
	dev    driver.UUID
	conn   *transport.Conn
	peer   transport.Peer
	reg    *Registry
	stream *driver.Stream
	log    *slog.Logger

	ready    chan *Lease   // mapped offers for Next, and mapping errors
	stop     chan struct{} // closed when Next must stop: producer gone, Shutdown or Close
	recvDone chan struct{}
	leaked   atomic.Uint64

	mu        sync.Mutex
	state     int
	ended     error // why no more leases come; set with stop closed
	gone      bool  // the producer is gone: nothing more is sent to it
	allocs    map[uint64]*impAlloc
	block     weak.Pointer[leaseBlock] // where new leases come from
	failed    map[uint64]error         // posix_fd allocations whose import failed
	events    map[transport.Handle]*driver.Event
	relEvs    map[*driver.Stream]*relEvent // stream-ordered releases: one event per stream
	relEvOK   bool                         // the producer honours release events
	pending   int                          // releases queued and not yet pushed
	pushAt    int                          // pending releases that are pushed at once
	pushTimer *time.Timer                  // pushes after releaseDelay
	waiters   atomic.Int32                 // goroutines waiting in Next
	held      int                          // leases handed out and not released
	heldZero  chan struct{}                // closed when held reaches 0; made by Shutdown
	stats     ImporterStats
	byeWhy    string
}

// impAlloc is an allocation this importer holds open in the registry.
type impAlloc struct {
	id      uint64
	handle  transport.Handle
	ent     *regEntry
	leases  int  // queued and handed out
	retired bool // the producer retired it: close once no lease is in it
	closed  bool // this importer's hold is dropped
}

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
	tcfg.AcceptFDs = true // posix_fd allocations (PROTOCOL.md, section 4.1)
	tcfg.Logger = log
	tcfg.WriteTimeout = cfg.WriteTimeout
	tcfg.DisableRing, tcfg.RingSpin = cfg.DisableRing, cfg.RingSpin
	if len(cfg.AllowedUIDs) > 0 {
		tcfg.AllowedUIDs = cfg.AllowedUIDs
	}
	conn, err := dialWaiting(ctx, path, tcfg, cfg.DialWait)
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
		allocs:   make(map[uint64]*impAlloc),
		failed:   make(map[uint64]error),
		events:   make(map[transport.Handle]*driver.Event),
		relEvs:   make(map[*driver.Stream]*relEvent),
		// A producer whose SO_PEERCRED pid reads 0 runs in a PID
		// namespace above this one or beside it (another container),
		// where the driver may refuse to open our events: releases
		// wait on the host instead (PROTOCOL.md, section 4.1).
		relEvOK: conn.Peer().Caps&transport.CapReleaseEvents != 0 && conn.Peer().PID != 0,
		pushAt:  max(1, int(cfg.Credits)/4),
	}
	im.pushTimer = time.AfterFunc(time.Hour, im.push)
	im.pushTimer.Stop()
	go im.recvLoop()
	return im, nil
}

// Producer describes the producer this importer is connected to.
func (im *Importer) Producer() transport.Peer { return im.peer }

// Registry returns the registry holding the importer's mappings.
func (im *Importer) Registry() *Registry { return im.reg }

// Ring reports whether the connection's messages go through rings in
// memory shared with the producer (both sides allow it) rather than on
// its socket.
func (im *Importer) Ring() bool { return im.conn.Ring() }

// Stats returns the importer's counters.
func (im *Importer) Stats() ImporterStats {
	im.mu.Lock()
	defer im.mu.Unlock()
	s := im.stats
	s.Leaked = im.leaked.Load()
	s.Held = im.held
	for _, a := range im.allocs {
		if !a.closed {
			s.Mappings++
		}
	}
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
func (im *Importer) Next(ctx context.Context) (*Lease, error) {
	return im.NextOn(ctx, im.stream)
}

// NextOn is Next with the lease made ready on stream s instead of the
// importer's stream: s waits on the producer's event, so work queued on s
// after NextOn returns sees the producer's writes (nil: the host waits).
// A pool gives each worker a stream of its own this way, so that their
// GPU work overlaps. Lease.Stream returns s.
func (im *Importer) NextOn(ctx context.Context, s *driver.Stream) (*Lease, error) {
	if err := ctx.Err(); err != nil {
		// A loop bounded by its context must end even while leases keep
		// arriving: the fast path below would never see it.
		return nil, err
	}
	var l *Lease
	select {
	case l = <-im.ready:
	default:
		// About to wait for the producer: what was released must reach
		// it first, or it may have no credit to offer with.
		im.push()
		im.waiters.Add(1)
		select {
		case l = <-im.ready:
			im.waiters.Add(-1)
		case <-im.stop:
			im.waiters.Add(-1)
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			im.mu.Lock()
			defer im.mu.Unlock()
			return nil, im.ended
		case <-ctx.Done():
			im.waiters.Add(-1)
			return nil, ctx.Err()
		}
	}
	{
		if l.err != nil {
			return nil, l.err
		}
		if err := im.handOut(l); err != nil {
			return nil, err
		}
		l.stream = s
		if l.ev != nil {
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
}

// handOut accounts for a lease given to the user, unless the importer has
// stopped meanwhile, in which case the lease is dropped.
func (im *Importer) handOut(l *Lease) error {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.ended != nil {
		im.dropQueuedLocked(l)
		return im.ended
	}
	l.st.out[l.idx] = heldLease{a: l.a, seq: l.seq, live: true}
	im.held++
	im.stats.Leases++
	return nil
}

// recvLoop receives the producer's messages until the connection ends.
func (im *Importer) recvLoop() {
	defer close(im.recvDone)
	var m transport.Message
	var err error
	for {
		if err = im.conn.Recv(context.Background(), &m); err != nil {
			break
		}
		switch m.Kind {
		case transport.KindOffer:
			im.onOffer(&m.Offer)
		case transport.KindRetire:
			im.onRetire(m.AllocID)
		case transport.KindGoodbye:
			im.mu.Lock()
			im.byeWhy = m.Reason
			im.mu.Unlock()
			err = io.EOF
		}
		if err != nil {
			break
		}
	}
	im.onEnd(err)
	// Nothing comes after a goodbye; closing at once lets a producer that
	// lingers after its goodbye finish.
	im.conn.Close()
}

// onOffer maps an offer and queues its lease.
func (im *Importer) onOffer(o *transport.Offer) {
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
		return
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
	select {
	case im.ready <- l:
	default:
		// Only errors can find the queue full (leases are bounded by the
		// credits): drop this one.
		im.log.Warn("share: dropping an offer error, too many queued", "err", l.err)
	}
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
			pid: im.peer.PID, inst: im.peer.InstanceID,
			src: o.Device, dst: im.dev, handle: o.Handle,
		}
		var ent *regEntry
		var err error
		switch o.HandleKind {
		case transport.HandleIPC:
			ent, err = im.reg.acquire(im.dctx, &key, o.AllocID, o.AllocSize)
		case transport.HandleFD:
			if len(o.FDs) != 1 {
				return nil, fmt.Errorf("%w: first offer of posix_fd allocation %d carries %d descriptors, want 1", transport.ErrMalformed, o.AllocID, len(o.FDs))
			}
			ent, err = im.reg.acquireFD(im.dctx, &key, o.FDs[0], o.AllocID, o.AllocSize)
		default:
			return nil, fmt.Errorf("%w: offer of allocation %d with handle kind %s, which this consumer cannot import", transport.ErrNotSupported, o.AllocID, o.HandleKind)
		}
		if err != nil && o.HandleKind == transport.HandleFD && !errors.Is(err, transport.ErrMalformed) {
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
		}
	}
	l := im.newLeaseLocked()
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

// maxFailedAllocs bounds the posix_fd allocations whose failed import an
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
	delete(im.allocs, a.id)
	if err := im.reg.release(a.ent); err != nil {
		im.log.Error("share: closing a mapping failed", "alloc", a.id, "err", err)
	}
	if a.retired {
		im.stats.Retired++
		im.sendClosedLocked(a.id)
	}
}

// sendReleaseLocked and sendClosedLocked send to the producer unless it
// is gone. Sends only queue (the connection's writer writes), so holding
// mu keeps releases and closes in order with the state they report. A
// failure means the connection failed; the receive loop sees it and ends
// the importer.
//
// Releases are queued, not written one by one: they leave together when a
// goroutine is about to wait in Next (or is waiting there), when a quarter
// of the credits are pending, or after releaseDelay at most, whichever
// comes first; a release must reach the producer soon, since its lease
// deadline runs until then.
func (im *Importer) sendReleaseLocked(seq uint64, after *relEvent) {
	if im.gone {
		return
	}
	var ev *transport.Handle
	if after != nil {
		ev = &after.h
	}
	im.sendFailed(im.conn.QueueRelease(context.Background(), ev, seq))
	im.pending++
	switch {
	case im.waiters.Load() > 0 || im.pending >= im.pushAt:
		im.pushLocked()
	case im.pending == 1:
		im.pushTimer.Reset(releaseDelay)
	}
}

// releaseDelay bounds how long a release waits to leave with others.
const releaseDelay = 100 * time.Microsecond

// push writes the queued releases.
func (im *Importer) push() {
	im.mu.Lock()
	im.pushLocked()
	im.mu.Unlock()
}

func (im *Importer) pushLocked() {
	if im.pending > 0 {
		im.pending = 0
		im.conn.Push()
	}
}

func (im *Importer) sendClosedLocked(allocID uint64) {
	if !im.gone {
		im.sendFailed(im.conn.SendClosed(context.Background(), allocID))
	}
}

func (im *Importer) sendFailed(err error) {
	if err != nil && !errors.Is(err, transport.ErrClosed) {
		im.log.Debug("share: send to the producer failed", "err", err)
	}
}

// releaseLocked ends a lease handed out by Next; after, if not nil, is the
// event recorded after the lease's last use on the GPU. mu held.
func (im *Importer) releaseLocked(a *impAlloc, seq uint64, after *relEvent) {
	if im.held--; im.held == 0 {
		im.notifyHeldLocked()
	}
	im.stats.Released++
	if a.closed {
		return // force-closed by Close
	}
	a.leases--
	im.sendReleaseLocked(seq, after)
	if a.leases == 0 && (a.retired || im.gone || im.state == stateClosed) {
		im.closeAllocLocked(a)
	}
}

// dropQueuedLocked ends a lease that was never handed out.
func (im *Importer) dropQueuedLocked(l *Lease) {
	if l.err != nil || l.a.closed {
		return
	}
	l.a.leases--
	im.sendReleaseLocked(l.seq, nil)
	if l.a.leases == 0 && (l.a.retired || im.gone || im.state != stateOpen) {
		im.closeAllocLocked(l.a)
	}
}

// drainLocked drops every queued lease.
func (im *Importer) drainLocked() {
	for {
		select {
		case l := <-im.ready:
			im.dropQueuedLocked(l)
		default:
			return
		}
	}
}

func (im *Importer) notifyHeldLocked() {
	if im.heldZero != nil {
		close(im.heldZero)
		im.heldZero = nil
	}
}

// endLocked stops Next with err.
func (im *Importer) endLocked(err error) {
	if im.ended == nil {
		im.ended = err
		close(im.stop)
	}
}

// onEnd runs when the connection has ended: the producer is gone, or
// this side closed it.
func (im *Importer) onEnd(err error) {
	im.mu.Lock()
	defer im.mu.Unlock()
	im.gone = true
	if im.state == stateOpen {
		switch {
		case err == io.EOF:
			im.endLocked(fmt.Errorf("%w (goodbye: %q): %w", ErrProducerGone, im.byeWhy, io.EOF))
		default:
			im.endLocked(fmt.Errorf("%w: %w", ErrProducerGone, err))
		}
	}
	im.drainLocked()
	// Mappings no lease is in close now; the others with their last
	// release. The producer's memory stays alive while mapped.
	for _, a := range im.allocs {
		if a.leases == 0 {
			im.closeAllocLocked(a)
		}
	}
}

// Shutdown ends the importer gracefully: Next stops handing out leases
// (offers still arriving go back to the producer), Shutdown waits within
// ctx until every lease handed out is released, closes every mapping,
// confirms the allocations the producer retired, says goodbye and closes
// the connection. Mappings are closed before the goodbye, so the producer
// may free its memory as soon as it reads it. If ctx ends first, Shutdown
// closes at once, as Close does, and returns ctx's error.
func (im *Importer) Shutdown(ctx context.Context) error {
	im.mu.Lock()
	if im.state == stateClosed {
		im.mu.Unlock()
		return nil
	}
	im.state = stateShutting
	im.endLocked(fmt.Errorf("share: importer shut down: %w", ErrClosed))
	im.drainLocked()
	for im.held > 0 {
		if im.heldZero == nil {
			im.heldZero = make(chan struct{})
		}
		w := im.heldZero
		im.mu.Unlock()
		select {
		case <-w:
		case <-ctx.Done():
			return errors.Join(ctx.Err(), im.Close())
		}
		im.mu.Lock()
	}
	im.mu.Unlock()
	return im.close(ctx, "consumer shut down")
}

// Close ends the importer without waiting for leases: every mapping is
// closed, including those of leases not yet released (their pointers are
// invalid from now on; their Release does nothing), the producer is told
// goodbye (Close waits at most a second for it to read it and hang up) and
// the connection is closed. Close is idempotent.
func (im *Importer) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	return im.close(ctx, "consumer closed")
}

func (im *Importer) close(ctx context.Context, reason string) error {
	im.mu.Lock()
	if im.state == stateClosed {
		im.mu.Unlock()
		<-im.recvDone
		return nil
	}
	im.state = stateClosed
	im.endLocked(fmt.Errorf("share: importer closed: %w", ErrClosed))
	im.drainLocked()
	for _, a := range im.allocs {
		im.closeAllocLocked(a)
	}
	gone := im.gone
	im.gone = true // nothing more is sent but the goodbye
	im.mu.Unlock()
	var err error
	if !gone {
		// Every mapping is closed: the goodbye lets the producer free. Stay
		// connected until the producer has read it and closed (or ctx
		// ends), so that its writes meanwhile cannot fail and lose the
		// goodbye, which would make it wait for this process to exit.
		if serr := im.conn.SendGoodbye(ctx, reason); serr == nil {
			select {
			case <-im.recvDone:
			case <-ctx.Done():
			}
		} else if !errors.Is(serr, transport.ErrClosed) && !errors.Is(serr, transport.ErrDisconnected) {
			err = serr
		}
	}
	im.conn.Close()
	im.pushTimer.Stop()
	<-im.recvDone
	im.mu.Lock()
	for h, ev := range im.events {
		if cerr := ev.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
		delete(im.events, h)
	}
	im.syncReleasesLocked()
	for s, r := range im.relEvs {
		if cerr := r.ev.Close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
		delete(im.relEvs, s)
	}
	im.mu.Unlock()
	return err
}

// relEvent is the interprocess event of one stream that stream-ordered
// releases record: recording it again only moves its completion later, so
// the producer, waiting on its latest record, waits for every earlier use.
type relEvent struct {
	ev *driver.Event
	h  transport.Handle
}

// releaseEvent returns s's release event, creating it on first use. mu
// held.
func (im *Importer) releaseEventLocked(s *driver.Stream) (*relEvent, error) {
	if r := im.relEvs[s]; r != nil {
		return r, nil
	}
	if len(im.relEvs) >= maxReleaseStreams {
		return nil, fmt.Errorf("share: stream-ordered releases on more than %d streams", maxReleaseStreams)
	}
	ev, err := im.dctx.NewEvent(driver.EventInterprocess | driver.EventDisableTiming)
	if err != nil {
		return nil, fmt.Errorf("share: create a release event: %w", err)
	}
	h, err := ev.IpcHandle()
	if err != nil {
		ev.Close()
		return nil, fmt.Errorf("share: release event handle: %w", err)
	}
	r := &relEvent{ev: ev, h: transport.Handle(h)}
	im.relEvs[s] = r
	return r, nil
}

// maxReleaseStreams bounds the streams one importer releases on, and so
// the events a producer opens for it (it refuses more than
// MaxReleaseEvents).
const maxReleaseStreams = 64

// syncReleasesLocked waits on the host for the work of every
// stream-ordered release made so far. mu held.
func (im *Importer) syncReleasesLocked() {
	for _, r := range im.relEvs {
		if err := r.ev.Synchronize(); err != nil {
			im.log.Error("share: waiting for stream-ordered releases failed", "err", err)
		}
	}
}
