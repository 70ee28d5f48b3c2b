//go:build linux

package share

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// Sharing is how an Exporter shares the memory it allocates (rings and
// arenas; Register always offers the caller's memory with legacy IPC).
type Sharing uint8

const (
	// SharingAuto: VMM where the device exports POSIX file descriptors,
	// else legacy IPC.
	SharingAuto Sharing = iota
	// SharingIPC: cuMemAlloc memory shared with legacy CUDA IPC handles.
	// Consumers in sibling PID namespaces (two containers) cannot open
	// them, the memory dies with the producer, and what a lost consumer
	// may map stays allocated until its processes exit.
	SharingIPC
	// SharingVMM: cuMemCreate allocations exported as file descriptors,
	// sent once per allocation and consumer over the socket. They import
	// in any PID namespace, outlive the producer in the consumers that
	// map them, and a lost consumer never pins the producer's memory: its
	// buffers are replaced (PROTOCOL.md, section 7.1). NewExporter fails
	// with driver.ErrNotSupported where the device cannot.
	SharingVMM
)

func (s Sharing) String() string {
	switch s {
	case SharingAuto:
		return "auto"
	case SharingIPC:
		return "ipc"
	case SharingVMM:
		return "vmm"
	}
	return fmt.Sprintf("sharing(%d)", uint8(s))
}

// ParseSharing reads "auto", "ipc" or "vmm".
func ParseSharing(s string) (Sharing, error) {
	for _, v := range []Sharing{SharingAuto, SharingIPC, SharingVMM} {
		if s == v.String() {
			return v, nil
		}
	}
	return 0, fmt.Errorf("share: sharing %q: want auto, ipc or vmm", s)
}

// resolveSharing picks the exporter's sharing path, and says why.
func resolveSharing(dev *driver.Device, want Sharing) (Sharing, uint64, string, error) {
	sup, err := dev.VMMSupport()
	var gran uint64
	if err == nil && sup.VMM && sup.PosixFD {
		gran, _, err = dev.AllocationGranularity()
	}
	ok := err == nil && sup.VMM && sup.PosixFD && gran > 0
	why := fmt.Sprintf("the device supports VMM allocations exported as POSIX file descriptors (granularity %d bytes)", gran)
	if !ok {
		why = fmt.Sprintf("the device does not export VMM allocations as POSIX file descriptors (VMM %v, POSIX fd %v)", sup.VMM, sup.PosixFD)
		if err != nil {
			why = fmt.Sprintf("the device's VMM support could not be read: %v", err)
		}
	}
	switch want {
	case SharingIPC:
		return SharingIPC, 0, "legacy IPC was asked for", nil
	case SharingVMM:
		if !ok {
			return 0, 0, "", fmt.Errorf("share: sharing vmm: %s: %w", why, driver.ErrNotSupported)
		}
		return SharingVMM, gran, "VMM was asked for, and " + why, nil
	case SharingAuto:
		if ok {
			return SharingVMM, gran, why, nil
		}
		return SharingIPC, 0, why, nil
	}
	return 0, 0, "", fmt.Errorf("share: unknown %s", want)
}

// Sharing says how the exporter shares the rings and arenas it allocates,
// and why.
func (e *Exporter) Sharing() (Sharing, string) { return e.sharing, e.sharingWhy }

// vmmMem is the producer's side of a VMM allocation: its handle and its
// mapping. Each consumer gets an fd of its own (exported per consumer,
// as the driver documents).
type vmmMem struct {
	alloc *driver.Allocation
	m     *driver.Mapping
}

// roundGran rounds n up to the exporter's VMM granularity.
func (e *Exporter) roundGran(n uint64) uint64 { return (n + e.gran - 1) / e.gran * e.gran }

// newOwnedLocked allocates size bytes that the exporter owns, in the
// exporter's sharing path, and records them. mu held: the driver calls
// take 0.1-0.3 ms on a GPU, and run at setup or when a lost consumer's
// buffers are replaced, never per handoff.
func (e *Exporter) newOwnedLocked(size uint64) (*allocRec, error) {
	if e.sharing != SharingVMM {
		p, err := e.dctx.Alloc(size)
		if err != nil {
			return nil, fmt.Errorf("share: %w", err)
		}
		fail := func(err error) (*allocRec, error) {
			if ferr := e.dctx.Free(p); ferr != nil {
				err = errors.Join(err, ferr)
			}
			return nil, fmt.Errorf("share: %w", err)
		}
		bufID, err := e.dctx.BufferID(p)
		if err != nil {
			return fail(err)
		}
		h, err := e.dctx.IpcGetMemHandle(p)
		if err != nil {
			return fail(err)
		}
		return e.newRecLocked(p, size, bufID, h, true), nil
	}
	size = e.roundGran(size)
	a, err := e.dctx.MemCreate(size, driver.MemCreateOptions{Exportable: true})
	if err != nil {
		return nil, fmt.Errorf("share: VMM allocation of %d bytes: %w", size, err)
	}
	m, err := e.dctx.Map(a)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("share: map a VMM allocation of %d bytes: %w", size, err), a.Close())
	}
	rec := e.newRecLocked(m.Ptr(), size, 0, driver.IpcMemHandle{}, true)
	rec.kind = transport.HandleVMM
	rec.vmm = &vmmMem{alloc: a, m: m}
	// The handle bytes of a vmm offer name the allocation only
	// (PROTOCOL.md, section 4.1): its id, which is never reused.
	binary.LittleEndian.PutUint64(rec.handle[:8], rec.id)
	return rec, nil
}

// freeMemory frees an allocation the exporter owns. A VMM allocation may
// be freed while consumers map it: their handles and mappings keep it.
func (e *Exporter) freeMemory(rec *allocRec) error {
	if v := rec.vmm; v != nil {
		return errors.Join(v.m.Close(), v.alloc.Close())
	}
	return e.dctx.Free(rec.base)
}

// exportFD exports rec's allocation for one consumer.
func (rec *allocRec) exportFD() (*os.File, error) {
	f, err := rec.vmm.alloc.ExportFD()
	if err != nil {
		return nil, fmt.Errorf("share: export allocation %d as a file descriptor: %w", rec.id, err)
	}
	return f, nil
}

// releaseVMMLocked voids what a consumer lost without a goodbye held in
// VMM allocations, without waiting for its processes to exit: its own
// handles and mappings keep the memory alive for it, so the producer need
// only never write again the buffers it held (abandonLocked). It no
// longer counts as mapping them. mu held.
func (e *Exporter) releaseVMMLocked(c *consumer) {
	for i := range c.slots {
		s := &c.slots[i]
		b := s.b
		if b == nil || b.rec.kind != transport.HandleVMM {
			continue
		}
		s.b = nil
		c.freeSlots = append(c.freeSlots, uint32(i))
		c.addOut(-1)
		e.unmapLeaseLocked(c, b)
		if !s.sent {
			// Still being sent: the consumer may read b only if the send
			// delivers it, which finishLocked learns (a send that fails
			// queued nothing, and b stays the producer's to offer).
			c.voided = append(c.voided, voidedOffer{seq: uint64(s.gen)<<32 | uint64(i), vmm: true})
			continue
		}
		e.stats.Releases++
		e.abandonForLocked(c, b)
		e.unleaseLocked(b)
	}
	for rec := range c.allocs {
		if rec.kind == transport.HandleVMM {
			delete(c.allocs, rec)
			delete(rec.mappers, c)
		}
	}
	e.notifyLocked(&e.changed)
	e.notifyLocked(&e.creditWait)
}

// abandonForLocked abandons b to the lost consumer c, which may read it,
// and counts it against c and its process (served last while it lives).
// mu held.
func (e *Exporter) abandonForLocked(c *consumer, b *Buffer) {
	c.abandoned++
	if c.proc != nil {
		c.proc.abandoned++
	}
	e.abandonLocked(b)
}

// abandonLocked gives b up for good: a lost consumer may still read it, so
// it is never written again. A ring gets fresh memory in its place; an
// arena keeps the range out of use until the arena is retired. mu held.
func (e *Exporter) abandonLocked(b *Buffer) {
	if b.abandoned {
		return
	}
	b.abandoned = true
	e.stats.Abandoned++
	if r := b.ring; r != nil && !b.rec.quarantined && b.rec.state == recLive && !e.closing {
		e.quarantineLocked(r, b.rec)
	}
	if a := b.arena; a != nil {
		a.lost = append(a.lost, span{b.off, b.span})
		e.log.Warn("share: an arena range is given up to a lost consumer that may still read it; it stays out of use until the arena is retired",
			"alloc", b.rec.id, "offset", b.off, "bytes", b.span, "lost", a.lostBytes(), "arena", b.rec.size)
		// An Alloc waiting for room looks whether it may still come.
		e.notifyLocked(&a.room)
	}
}

// quarantineLocked replaces the ring allocation old, which holds an
// abandoned buffer, with a fresh one: each buffer of old gets a successor
// at the same offset of the new allocation, which takes its place in the
// ring at once if the buffer is free or abandoned, else when the buffer
// next comes back. Once no buffer of old is in use, old is retired (the
// producer drops its handle; the memory lives on in the lost consumer).
// If the fresh allocation fails, the ring goes on without the abandoned
// buffers. mu held.
func (e *Exporter) quarantineLocked(r *Ring, old *allocRec) {
	nr, err := e.newOwnedLocked(old.size)
	if err != nil {
		e.log.Error("share: a lost consumer holds ring buffers and no fresh memory could replace them; the ring goes on with fewer buffers",
			"alloc", old.id, "err", err)
		return
	}
	nr.ring = r
	old.quarantined = true
	e.stats.Replaced++
	// Take the free buffers out, so that each slot is in the free list
	// exactly once, as the buffer or as its successor; the others go back.
	// Ring.next takes from the free list without mu: a receive guarded
	// only by len could block, mu held, on a buffer taken in between.
	wasFree := make(map[*Buffer]bool, cap(r.free))
drain:
	for {
		select {
		case b := <-r.free:
			wasFree[b] = true
		default:
			break drain
		}
	}
	for _, x := range old.ringBufs {
		if x.gone {
			continue // left the ring already
		}
		nx := &Buffer{e: e, rec: nr, off: x.off, size: x.size, ring: r}
		nr.ringBufs = append(nr.ringBufs, nx)
		switch {
		case x.pred != nil:
			// x is the successor of a buffer of an older replaced
			// allocation, and has not entered the ring yet: nx enters
			// in its place.
			x.pred.successor, nx.pred = nx, x.pred
			x.pred, x.gone = nil, true
		case wasFree[x]:
			delete(wasFree, x)
			x.gone = true
			e.putFreeLocked(r, nx)
		case x.abandoned:
			x.gone = true
			e.putFreeLocked(r, nx)
		default:
			// Held by the producer, leased, or on its way out of the free
			// list: nx comes in when x is idle (idleLocked).
			x.successor, nx.pred = nx, x
			old.members++
		}
	}
	for x := range wasFree {
		e.putFreeLocked(r, x)
	}
	e.log.Warn("share: a lost consumer may still read ring buffers; they are never written again, and fresh memory replaces them",
		"old_alloc", old.id, "new_alloc", nr.id)
	if old.members == 0 {
		e.retireQuarantinedLocked(old)
	}
}

// memberIdleLocked runs when a buffer of a quarantined ring allocation is
// idle: its successor took its place. mu held.
func (e *Exporter) memberIdleLocked(old *allocRec) {
	if old.members--; old.members == 0 {
		e.retireQuarantinedLocked(old)
	}
}

// retireQuarantinedLocked retires a replaced ring allocation in the
// background. mu held.
func (e *Exporter) retireQuarantinedLocked(old *allocRec) {
	if old.state != recLive || e.closing {
		return
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		if err := e.retire(e.life, old); err != nil && e.life.Err() == nil {
			e.log.Warn("share: retiring a replaced ring allocation failed", "alloc", old.id, "err", err)
		}
	}()
}

// sendFD queues an offer of a VMM allocation to c. The first offer of the
// allocation to c carries an fd exported for c (each export is a new fd,
// as the driver documents); later ones carry none (PROTOCOL.md, section
// 4.1). c.sendMu keeps the fd-carrying offer ahead of the others.
//
// The offer's reservation (rec.sending) keeps rec from being freed
// meanwhile. onConn is as for send.
func (e *Exporter) sendFD(ctx context.Context, c *consumer, rec *allocRec, o *transport.Offer, m *mapping) (onConn bool, err error) {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	if m.fdSent {
		return true, c.conn.SendOffer(ctx, o)
	}
	f, err := rec.exportFD()
	if err != nil {
		return false, err
	}
	defer f.Close()
	fd := [1]int{int(f.Fd())}
	o.FDs = fd[:]
	if err := c.conn.SendOffer(ctx, o); err != nil {
		return true, err // not queued: the next offer carries it
	}
	m.fdSent = true
	return true, nil
}

// refuse says why the exporter cannot serve a consumer that
// advertised caps, or nil if it can.
func (e *Exporter) refuse(caps transport.Caps) error {
	if e.sharing == SharingVMM && caps&transport.CapVMM == 0 {
		return fmt.Errorf("%w: this producer offers VMM allocations as file descriptors; the consumer did not advertise the vmm capability (bit 0)", transport.ErrNotSupported)
	}
	return nil
}
