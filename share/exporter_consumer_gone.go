//go:build linux

package share

import (
	"context"
	"errors"
	"os"
	"slices"

	"github.com/seed743c36cf/cudashare/transport"
)

// This file is what happens when a consumer's connection ends (the rules
// are consumer's): what it held is voided at once, or once every process
// that held the connection has exited, which the exporter watches.

// onGone handles the end of c's connection (see consumer for the rules).
func (e *Exporter) onGone(c *consumer, err error) {
	c.conn.Close()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.deactivateLocked(c)
	c.ended = true
	if c.proc != nil {
		c.proc.lost += int(c.out)
	}
	clean := c.saidBye || c.sentBye
	var remote *transport.RemoteError
	if errors.As(err, &remote) {
		// The consumer's own word on why it leaves (PROTOCOL.md section
		// 4.1 tells one that cannot import an allocation to send code
		// 10): the operator's only clue. One per connection, as fast as
		// consumers connect: the limited logger.
		e.stats.ConsumersFailed++
		e.peerLog.Warn("share: consumer left with an error", "peer", c.peer.String(),
			"code", remote.Code, "error", remote.Message, "leases", c.out)
	} else if c.saidBye {
		e.peerLog.Debug("share: consumer said goodbye", "peer", c.peer.String(), "reason", c.byeReason)
	}
	if !clean && e.life.Err() == nil {
		e.stats.ConsumersLost++
		if !c.kicked && droppedByTransport(err) {
			// This side's transport ended it for cause, and told it why:
			// a drop, as a kick is.
			e.stats.ConsumersDropped++
			c.obs.dropped = err.Error()
			e.log.Warn("share: dropping consumer", "peer", c.peer.String(), "why", err)
		}
	}
	if e.life.Err() != nil {
		return // Close deals with what is left
	}
	if !clean && c.holdsLocked() {
		// What it holds in VMM allocations needs no wait (section 7.1).
		e.releaseVMMLocked(c)
	}
	// An offer of a VMM buffer still being sent may yet abandon a buffer
	// to it (finishLocked): keep watching it as if it had.
	mayAbandon := c.abandoned > 0 || slices.ContainsFunc(c.voided, func(v voidedOffer) bool { return v.vmm })
	switch {
	case mayAbandon && !c.unwatchable && !e.holdersGoneLocked(c):
		// It holds nothing now, but its process is served last while it
		// lives (procWatch.abandoned): keep watching it.
	case clean || !c.holdsLocked() || e.holdersGoneLocked(c):
		e.dropLocked(c)
	case c.unwatchable:
		e.log.Warn("share: consumer lost without a goodbye; the processes holding its connection could not be watched, so the allocations it may map stay allocated until the producer exits",
			"peer", c.peer.String(), "err", err, "allocations", len(c.allocs), "leases", c.out)
	default:
		e.log.Warn("share: consumer lost without a goodbye; its leases and mappings end when its process exits",
			"peer", c.peer.String(), "err", err, "allocations", len(c.allocs), "leases", c.out)
	}
}

// droppedByTransport reports whether err, what ended a consumer's
// connection, is this side's transport dropping the consumer for cause:
// messages left unread past the write timeout, half a frame held past the
// frame timeout, or a frame that breaks the protocol. Not an error the
// consumer sent (ErrRemote), nor its going away.
func droppedByTransport(err error) bool {
	if err == nil || errors.Is(err, transport.ErrRemote) {
		return false
	}
	for _, cause := range [...]error{transport.ErrWriteTimeout, transport.ErrTimeout, transport.ErrMalformed,
		transport.ErrFrameTooLarge, transport.ErrUnknownMessage, transport.ErrUnexpectedMessage, transport.ErrCredit,
		transport.ErrNotSupported} {
		if errors.Is(err, cause) {
			return true
		}
	}
	return false
}

// holdersGoneLocked reports whether every process known to have held c's
// connection has exited.
func (e *Exporter) holdersGoneLocked(c *consumer) bool {
	if c.unwatchable {
		return false
	}
	for _, w := range c.watches {
		if !w.exited {
			return false
		}
	}
	return true
}

// dropLocked voids every lease and mapping of c and forgets it.
func (e *Exporter) dropLocked(c *consumer) {
	if c.dropped {
		return
	}
	c.dropped = true
	delete(e.conns, c)
	for i := range c.slots {
		if b := c.slots[i].b; b != nil {
			c.slots[i].b = nil
			if c.slots[i].sent {
				e.stats.Releases++
			} else {
				// Still being sent: finishLocked counts it.
				c.voided = append(c.voided, voidedOffer{seq: uint64(c.slots[i].gen)<<32 | uint64(i)})
			}
			e.unleaseLocked(b)
		}
	}
	c.addOut(-int(c.out))
	c.slots, c.freeSlots = nil, nil
	for rec := range c.allocs {
		delete(rec.mappers, c)
	}
	c.allocs = nil
	// Its stream-ordered releases' GPU work is done if it said goodbye
	// (a consumer waits for it first) or its processes exited; else the
	// buffers it released still wait for it, and its events close after.
	gone := c.saidBye || c.sentBye || e.holdersGoneLocked(c)
	for _, ce := range c.events {
		if gone {
			e.killEventLocked(ce)
		} else {
			ce.orphan = true
			e.unrefEventLocked(ce, 0)
		}
	}
	e.unwatchLocked(c)
	e.notifyLocked(&e.changed)
}

// --- Watching processes ------------------------------------------------------

// watchLocked adds the process pid to those watched for c, starting a
// watch if the process has none. A pid that is unknown (0: another PID
// namespace) cannot be watched.
func (e *Exporter) watchLocked(c *consumer, pid int) {
	if pid <= 0 {
		c.unwatchable = true
		e.stats.ConsumersUnwatched++
		if e.sharing == SharingVMM {
			// Its VMM allocations need no watch (PROTOCOL.md, section
			// 7.1); only registered (legacy IPC) buffers wait on one.
			e.log.Info("share: a consumer's process cannot be watched (its pid reads 0: another PID namespace); with VMM sharing the exporter's rings and arenas need no watch; registered (legacy IPC) buffers it may map are freed only after a goodbye", "peer", c.peer.String())
			return
		}
		e.log.Warn("share: a consumer's process cannot be watched (unknown pid, another PID namespace?); what it may map is freed only after a goodbye", "peer", c.peer.String())
		return
	}
	w := e.pids[pid]
	if w == nil || w.exited {
		// A new process, or one whose pid was reused.
		w = watchProcess(pid)
		e.pids[pid] = w
		ctx, stop := context.WithCancel(e.life)
		w.stop = stop
		e.wg.Add(1)
		go e.watchLoop(ctx, w)
	}
	if _, ok := w.cons[c]; !ok {
		w.cons[c] = struct{}{}
		c.watches = append(c.watches, w)
	}
	if c.proc == nil && len(c.watches) == 1 {
		c.proc = w
	}
}

// unwatchLocked detaches c from the watches of its processes; a watch ends
// with its last consumer.
func (e *Exporter) unwatchLocked(c *consumer) {
	for _, w := range c.watches {
		delete(w.cons, c)
		if len(w.cons) == 0 {
			w.stop()
			if e.pids[w.pid] == w {
				delete(e.pids, w.pid)
			}
		}
	}
	c.watches = nil
}

// watchLoop waits for w's process to exit, then settles each consumer it
// held a connection of.
func (e *Exporter) watchLoop(ctx context.Context, w *procWatch) {
	defer e.wg.Done()
	defer w.close()
	if err := w.wait(ctx); err != nil {
		return
	}
	e.mu.Lock()
	w.exited = true
	var open []*consumer
	for c := range w.cons {
		switch {
		case e.life.Err() != nil || c.dropped:
		case c.ended:
			if e.holdersGoneLocked(c) {
				e.log.Info("share: lost consumer's process exited; reclaiming its leases and mappings", "peer", c.peer.String())
				e.dropLocked(c)
			}
		case connPeerHungUp(c.conn):
			// It died holding the connection, which the kernel closed
			// first: its connection's reader is about to see the end.
		default:
			// Another process holds the connection open.
			open = append(open, c)
		}
	}
	e.mu.Unlock()
	for _, c := range open {
		e.followConnection(c)
	}
}

// followConnection finds the processes that hold c's connection now that
// the one watched has exited, and watches them. Where none can be found,
// what c may map is never freed before the producer exits.
func (e *Exporter) followConnection(c *consumer) {
	// Outside the lock: a scan of /proc takes a while on a busy machine.
	pids, err := connectionHolders(c.conn)
	e.mu.Lock()
	defer e.mu.Unlock()
	if c.dropped || e.life.Err() != nil {
		return
	}
	if err == nil && len(pids) == 0 && (c.ended || connPeerHungUp(c.conn)) {
		return // it ended meanwhile: its last holder's exit settles it
	}
	if err != nil || len(pids) == 0 {
		c.unwatchable = true
		e.stats.ConsumersUnwatched++
		e.log.Warn("share: the process that held a consumer connection exited, and the processes holding it now cannot be found; what it may map stays allocated until a goodbye or the producer exits",
			"peer", c.peer.String(), "err", err)
		return
	}
	if !c.handedOn {
		c.handedOn = true
		e.stats.ConsumersHandedOn++
	}
	e.log.Info("share: a consumer connection passed to other processes; watching them", "peer", c.peer.String(), "pids", pids)
	for _, pid := range pids {
		e.watchLocked(c, pid)
	}
}

// connectionHolders returns the processes, other than this one, that have
// a descriptor of the peer end of conn.
func connectionHolders(conn *transport.Conn) ([]int, error) {
	ino, err := connPeerSocket(conn)
	if err != nil {
		return nil, err
	}
	return socketHolders(ino, os.Getpid())
}
