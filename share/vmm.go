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

// This file is the producer's VMM allocations: made with cuMemCreate,
// exported once per consumer as a file descriptor that travels with the
// allocation's first offer (sendFD), and freed.

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
