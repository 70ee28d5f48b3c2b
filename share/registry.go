//go:build linux

package share

import (
	"errors"
	"fmt"
	"sync"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// Registry holds the IPC mappings of one process: one open per
// allocation, whatever the number of leases and importers that use it.
//
// Opening a handle costs 70-180 µs on a real GPU and closing 35-48 µs, so
// a mapping stays open while the producer keeps the allocation (a ring of
// buffers is opened once), and is closed exactly once, when no importer
// holds it any more: importers drop their hold when the producer retires
// the allocation and no lease of theirs is in it, when the producer is
// gone, and when they close.
//
// Entries are keyed by the producer's identity (pid, the random
// instance id of its handshake and its session id, so a restarted
// producer, whose allocation ids and handles may repeat, never hits the
// mappings of the one before it), the device that holds the memory, the
// device that maps it, and the 64 handle bytes. A Registry may be shared
// by the importers of one process, which then share mappings; the driver
// lets only one context per device open a given handle, so importers on
// one device must use the same (primary) context. The zero value is not
// usable; use NewRegistry.
type Registry struct {
	mu     sync.Mutex
	byKey  map[regKey]*regEntry
	byPtr  map[ptrKey]*regEntry
	opens  uint64
	closes uint64
}

// regKey names a mapping. It is comparable so it can key a map directly:
// a cached lookup hashes it and allocates nothing.
type regKey struct {
	pid      int32
	inst     [16]byte
	session  uint64 // the producer's session (PROTOCOL.md, section 7.2): a restarted producer's ids start again
	src, dst driver.UUID
	handle   transport.Handle
}

// ptrKey names a mapped address in the context of one device.
type ptrKey struct {
	dst driver.UUID
	ptr driver.DevicePtr
}

// regEntry is one open mapping. Its fields are guarded by Registry.mu,
// except ptr and size, which never change once it is published.
type regEntry struct {
	key     regKey
	dctx    *driver.Context
	ptr     driver.DevicePtr
	size    uint64
	bufID   uint64
	allocID uint64
	refs    int
	// vmm and mapping are the import and mapping of a vmm
	// allocation; nil for legacy IPC.
	vmm     *driver.Allocation
	mapping *driver.Mapping
}

// RegistryStats counts a registry's mappings.
type RegistryStats struct {
	Mappings int    // open now
	Opens    uint64 // IpcOpenMemHandle calls, and fd imports, that mapped something
	Closes   uint64 // IpcCloseMemHandle calls, and unmaps of fd imports
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{byKey: make(map[regKey]*regEntry), byPtr: make(map[ptrKey]*regEntry)}
}

// Mappings returns the number of mappings open now.
func (r *Registry) Mappings() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.byKey)
}

// Stats returns the registry's counters.
func (r *Registry) Stats() RegistryStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return RegistryStats{Mappings: len(r.byKey), Opens: r.opens, Closes: r.closes}
}

// acquire returns the mapping for k, opening it in dctx on first use, and
// counts one more hold on it. allocID is the producer's allocation that
// the handle is offered for, allocSize its size.
//
// A mapping found under k that was opened for another allocation id is the
// mark of a handle that now names a different allocation (the driver may
// hand out the same bytes for a new allocation at a reused address, and
// re-opening an open handle returns the old mapping): it is refused with
// ErrStaleHandle rather than handed out. So is an open that returns an
// address this registry already maps under another key, and a mapping
// smaller than the allocation.
func (r *Registry) acquire(dctx *driver.Context, k *regKey, allocID, allocSize uint64) (*regEntry, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.byKey[*k]; e != nil {
		if e.allocID != allocID {
			return nil, fmt.Errorf("%w: the handle offered for allocation %d is mapped here for allocation %d of producer pid %d",
				ErrStaleHandle, allocID, e.allocID, k.pid)
		}
		e.refs++
		return e, nil
	}
	ptr, err := dctx.IpcOpenMemHandle(driver.IpcMemHandle(k.handle))
	if err != nil {
		if errors.Is(err, driver.ErrPeerAccessUnsupported) {
			return nil, fmt.Errorf("%w: memory on %s, importer on %s: %w", ErrPeerAccessUnsupported, k.src, k.dst, err)
		}
		if errors.Is(err, driver.ErrInvalidContext) && k.pid == 0 {
			// The producer's pid reads 0: its PID namespace is not this
			// one or below it. The driver opens handles of an ancestor's
			// namespace, not a sibling's (PROTOCOL.md, section 4.1).
			return nil, fmt.Errorf("%w: %w (allocation %d; the producer's pid reads 0 here: another PID namespace); run the producer with VMM sharing (-sharing vmm, ExporterConfig.Sharing = SharingVMM)",
				ErrIPCNamespace, err, allocID)
		}
		return nil, fmt.Errorf("share: open IPC handle of allocation %d (memory on %s, importer on %s): %w", allocID, k.src, k.dst, err)
	}
	r.opens++
	// From here on the open holds one driver reference that must be
	// dropped on every error path.
	undo := func(cause error) error {
		if cerr := dctx.IpcCloseMemHandle(ptr); cerr != nil {
			cause = errors.Join(cause, fmt.Errorf("share: close the refused mapping: %w", cerr))
		}
		r.closes++
		return cause
	}
	// The buffer id only tells the two stale cases apart; 0 when the
	// driver does not give it for an IPC mapping.
	bufID, _ := dctx.BufferID(ptr)
	pk := ptrKey{dst: k.dst, ptr: ptr}
	if other := r.byPtr[pk]; other != nil {
		if other.bufID == bufID || bufID == 0 || other.bufID == 0 {
			// The driver deduplicated the open: the handle names memory
			// this registry maps for another allocation.
			return nil, undo(fmt.Errorf("%w: the handle of allocation %d opened the mapping of allocation %d of producer pid %d at %#x",
				ErrStaleHandle, allocID, other.allocID, other.key.pid, uint64(ptr)))
		}
		// The address was reused: the mapping registered there was
		// closed behind the registry's back.
		return nil, undo(fmt.Errorf("%w: allocation %d opened at %#x, where the registry still records allocation %d (buffer id %d, now %d): that mapping was closed outside the registry",
			ErrStaleHandle, allocID, uint64(ptr), other.allocID, other.bufID, bufID))
	}
	_, size, err := dctx.AddressRange(ptr)
	if err != nil {
		return nil, undo(fmt.Errorf("share: address range of the mapping of allocation %d: %w", allocID, err))
	}
	if size < allocSize {
		return nil, undo(fmt.Errorf("%w: the handle of allocation %d maps %d bytes, the allocation has %d",
			ErrStaleHandle, allocID, size, allocSize))
	}
	e := &regEntry{key: *k, dctx: dctx, ptr: ptr, size: size, bufID: bufID, allocID: allocID, refs: 1}
	r.byKey[*k] = e
	r.byPtr[pk] = e
	return e, nil
}

// acquireFD is acquire for a vmm allocation (PROTOCOL.md, section
// 4.1): k.handle is the producer's identity of the allocation, fd its
// exported descriptor, which stays the caller's to close. A second
// importer of the process that is offered the same allocation shares the
// first one's mapping.
func (r *Registry) acquireFD(dctx *driver.Context, k *regKey, fd int, allocID, allocSize uint64) (*regEntry, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.byKey[*k]; e != nil {
		if e.allocID != allocID || e.vmm == nil {
			return nil, fmt.Errorf("%w: the handle offered for allocation %d is mapped here for allocation %d of producer pid %d",
				ErrStaleHandle, allocID, e.allocID, k.pid)
		}
		e.refs++
		return e, nil
	}
	a, err := dctx.ImportFD(fd, allocSize)
	if err != nil {
		return nil, fmt.Errorf("share: import the file descriptor of allocation %d (%d bytes, memory on %s, importer on %s): %w",
			allocID, allocSize, k.src, k.dst, err)
	}
	m, err := dctx.Map(a)
	if err != nil {
		if errors.Is(err, driver.ErrPeerAccessUnsupported) {
			err = fmt.Errorf("%w: memory on %s, importer on %s: %w", ErrPeerAccessUnsupported, k.src, k.dst, err)
		}
		return nil, errors.Join(fmt.Errorf("share: map allocation %d (%d bytes, memory on %s, importer on %s): %w",
			allocID, allocSize, k.src, k.dst, err), a.Close())
	}
	r.opens++
	e := &regEntry{key: *k, dctx: dctx, ptr: m.Ptr(), size: allocSize, allocID: allocID, refs: 1, vmm: a, mapping: m}
	r.byKey[*k] = e
	r.byPtr[ptrKey{dst: k.dst, ptr: e.ptr}] = e
	return e, nil
}

// release drops one hold on e and closes the mapping with the last.
func (r *Registry) release(e *regEntry) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e.refs <= 0 {
		return fmt.Errorf("share: registry: release of allocation %d held by no one", e.allocID)
	}
	if e.refs--; e.refs > 0 {
		return nil
	}
	delete(r.byKey, e.key)
	delete(r.byPtr, ptrKey{dst: e.key.dst, ptr: e.ptr})
	r.closes++
	if e.mapping != nil {
		if err := errors.Join(e.mapping.Close(), e.vmm.Close()); err != nil {
			return fmt.Errorf("share: unmap allocation %d at %#x: %w", e.allocID, uint64(e.ptr), err)
		}
		return nil
	}
	if err := e.dctx.IpcCloseMemHandle(e.ptr); err != nil {
		return fmt.Errorf("share: close the mapping of allocation %d at %#x: %w", e.allocID, uint64(e.ptr), err)
	}
	return nil
}
