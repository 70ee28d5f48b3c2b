package driver

import (
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Virtual memory management: physical allocations (cuMemCreate) that can be
// exported as POSIX file descriptors, imported in another process from the
// fd alone, and mapped into address ranges with access for chosen devices.
//
// Memory lives while any Allocation, exported fd or Mapping of it exists, in
// any process: closing the Allocation after mapping it is normal, and so is
// the exporting process exiting while importers still map the memory.

// ErrFabricUnsupported wraps ErrNotSupported: fabric handles
// (CU_MEM_HANDLE_TYPE_FABRIC, for sharing across nodes through IMEX) are
// reported by VMMSupport but not implemented here.
var ErrFabricUnsupported = fmt.Errorf("%w: fabric handles (CU_MEM_HANDLE_TYPE_FABRIC) are not implemented; only POSIX file descriptors are", ErrNotSupported)

// VMMSupport says which parts of virtual memory management a device has.
type VMMSupport struct {
	// VMM: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED.
	VMM bool
	// PosixFD: CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
	// so MemCreate with Exportable and ExportFD work.
	PosixFD bool
	// Fabric: CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED. Reported
	// only; see ErrFabricUnsupported.
	Fabric bool
}

// VMMSupport reads the device's VMM attributes.
func (dev *Device) VMMSupport() (VMMSupport, error) {
	var s VMMSupport
	for _, a := range []struct {
		attr int32
		dst  *bool
	}{
		{api.AttrVirtualMemoryManagementSupported, &s.VMM},
		{api.AttrHandleTypePosixFileDescriptorSupported, &s.PosixFD},
		{api.AttrHandleTypeFabricSupported, &s.Fabric},
	} {
		var v int32
		if err := check(dev.d.a.DeviceGetAttribute(&v, a.attr, dev.h), "cuDeviceGetAttribute"); err != nil {
			return VMMSupport{}, fmt.Errorf("%s: attribute %d: %w", dev, a.attr, err)
		}
		*a.dst = v != 0
	}
	return s, nil
}

// vmmProp is the CUmemAllocationProp of a pinned allocation on dev.
func vmmProp(dev api.Device, exportable bool) api.MemAllocationProp {
	p := api.MemAllocationProp{Type: api.MemAllocationTypePinned, Location: api.MemLocation{Type: api.MemLocationTypeDevice, ID: int32(dev)}}
	if exportable {
		p.RequestedHandleTypes = api.MemHandleTypePosixFileDescriptor
	}
	return p
}

// AllocationGranularity is cuMemGetAllocationGranularity for an exportable
// allocation on dev: sizes given to MemCreate must be multiples of min;
// recommended is the driver's advice for performance.
func (dev *Device) AllocationGranularity() (min, recommended uint64, err error) {
	p := vmmProp(dev.h, true)
	if err := check(dev.d.a.MemGetAllocationGranularity(&min, &p, api.MemAllocGranularityMinimum), "cuMemGetAllocationGranularity"); err != nil {
		return 0, 0, fmt.Errorf("%s: %w", dev, err)
	}
	if err := check(dev.d.a.MemGetAllocationGranularity(&recommended, &p, api.MemAllocGranularityRecommended), "cuMemGetAllocationGranularity"); err != nil {
		return 0, 0, fmt.Errorf("%s: %w", dev, err)
	}
	return min, recommended, nil
}

// MemCreateOptions configures MemCreate.
type MemCreateOptions struct {
	// Exportable requests CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, so that
	// ExportFD works.
	Exportable bool
	// Fabric requests CU_MEM_HANDLE_TYPE_FABRIC: MemCreate returns
	// ErrFabricUnsupported.
	Fabric bool
}

// Allocation is a CUmemGenericAllocationHandle: physical memory on a device,
// not yet addressable until mapped. Close releases the handle (cuMemRelease);
// mappings and exported fds keep the memory alive after it.
type Allocation struct {
	ctx        *Context
	h          api.MemHandle
	size       uint64
	exportable bool
	imported   bool

	mu     sync.Mutex
	closed bool
}

// Size is the allocation's size in bytes.
func (a *Allocation) Size() uint64 { return a.size }

// Context is the context the allocation was created or imported in.
func (a *Allocation) Context() *Context { return a.ctx }

func (a *Allocation) String() string {
	how := "created"
	if a.imported {
		how = "imported"
	}
	return fmt.Sprintf("VMM allocation %#x (%d bytes, %s on %s)", uint64(a.h), a.size, how, a.ctx.dev)
}

// MemCreate is cuMemCreate: size bytes of device memory on the context's
// device. size must be a multiple of the minimum AllocationGranularity.
func (c *Context) MemCreate(size uint64, opt MemCreateOptions) (*Allocation, error) {
	if opt.Fabric {
		return nil, ErrFabricUnsupported
	}
	if err := c.enter(); err != nil {
		return nil, err
	}
	defer c.exit()
	p := vmmProp(c.dev.h, opt.Exportable)
	var h api.MemHandle
	if err := check(c.a.MemCreate(&h, size, &p, 0), "cuMemCreate"); err != nil {
		return nil, fmt.Errorf("create %d bytes on %s: %w", size, c.dev, err)
	}
	return &Allocation{ctx: c, h: h, size: size, exportable: opt.Exportable}, nil
}

// Close is cuMemRelease; idempotent. The memory outlives it while a Mapping
// or an exported fd of it exists, here or in another process.
func (a *Allocation) Close() error {
	if a == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	a.closed = true
	if err := a.ctx.enter(); err != nil {
		return err
	}
	defer a.ctx.exit()
	return check(a.ctx.a.MemRelease(a.h), "cuMemRelease")
}

// handle returns the live handle; the caller holds a.mu.
func (a *Allocation) handle() (api.MemHandle, error) {
	if a.closed {
		return 0, ErrClosed
	}
	return a.h, nil
}

// ExportFD is cuMemExportToShareableHandle to a POSIX file descriptor: a
// new fd, close-on-exec, that the caller owns. Send it (SCM_RIGHTS) and close
// it; each export is a new fd, so export once per consumer. The allocation
// must have been created Exportable (or imported from an fd).
func (a *Allocation) ExportFD() (*os.File, error) {
	if !a.exportable && !a.imported {
		return nil, fmt.Errorf("export %s: created without Exportable: %w", a, ErrInvalidValue)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	h, err := a.handle()
	if err != nil {
		return nil, err
	}
	if err := a.ctx.enter(); err != nil {
		return nil, err
	}
	defer a.ctx.exit()
	fd := int32(-1)
	if err := check(a.ctx.a.MemExportToShareableHandle(unsafe.Pointer(&fd), h, api.MemHandleTypePosixFileDescriptor, 0), "cuMemExportToShareableHandle"); err != nil {
		return nil, fmt.Errorf("export %s: %w", a, err)
	}
	if fd < 0 {
		return nil, fmt.Errorf("export %s: the driver returned fd %d", a, fd)
	}
	return os.NewFile(uintptr(fd), fmt.Sprintf("cuda-vmm-%#x", uint64(h))), nil
}

// ImportFD is cuMemImportFromShareableHandle of a POSIX file descriptor
// from ExportFD, possibly of another process. fd stays the caller's: close
// it after the import. size is the allocation's size, which the fd does not
// tell the real driver: the exporter sends it along.
func (c *Context) ImportFD(fd int, size uint64) (*Allocation, error) {
	if fd < 0 {
		return nil, fmt.Errorf("import fd %d: %w", fd, ErrInvalidValue)
	}
	if err := c.enter(); err != nil {
		return nil, err
	}
	defer c.exit()
	var h api.MemHandle
	if err := check(c.a.MemImportFromShareableHandle(&h, uintptr(fd), api.MemHandleTypePosixFileDescriptor), "cuMemImportFromShareableHandle"); err != nil {
		if ex, ok := c.a.(api.ImportExplainer); ok {
			if why := ex.ExplainImport(uintptr(fd), api.MemHandleTypePosixFileDescriptor); why != nil {
				return nil, fmt.Errorf("import fd %d on %s: %w: %v", fd, c.dev, err, why)
			}
		}
		return nil, fmt.Errorf("import fd %d on %s: %w", fd, c.dev, err)
	}
	return &Allocation{ctx: c, h: h, size: size, imported: true}, nil
}

// Mapping is an allocation mapped at an address range of this process
// (cuMemAddressReserve, cuMemMap, cuMemSetAccess). Close unmaps it and frees
// the range; the memory stays while other handles, fds or mappings exist.
type Mapping struct {
	ctx  *Context
	ptr  DevicePtr
	size uint64

	mu     sync.Mutex
	closed bool
}

// Ptr is the mapping's base address, valid in this process until Close.
func (m *Mapping) Ptr() DevicePtr { return m.ptr }

// Size is the mapping's size in bytes.
func (m *Mapping) Size() uint64 { return m.size }

// Map maps all of a into a fresh address range and gives read-write access
// to the context's device and to each of peers. The allocation may be
// closed afterwards; the mapping keeps the memory. Whether a peer device may
// access memory of another device depends on the hardware (CanAccessPeer);
// GPU.md notes an unexplained failure of exactly that on two H200s.
func (c *Context) Map(a *Allocation, peers ...*Device) (*Mapping, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	h, err := a.handle()
	if err != nil {
		return nil, err
	}
	if err := c.enter(); err != nil {
		return nil, err
	}
	defer c.exit()
	var p api.DevicePtr
	if err := check(c.a.MemAddressReserve(&p, a.size, 0, 0, 0), "cuMemAddressReserve"); err != nil {
		return nil, fmt.Errorf("map %s: %w", a, err)
	}
	if err := check(c.a.MemMap(p, a.size, 0, h, 0), "cuMemMap"); err != nil {
		c.a.MemAddressFree(p, a.size)
		return nil, fmt.Errorf("map %s: %w", a, err)
	}
	desc := make([]api.MemAccessDesc, 0, 1+len(peers))
	for _, d := range append([]*Device{c.dev}, peers...) {
		desc = append(desc, api.MemAccessDesc{Location: api.MemLocation{Type: api.MemLocationTypeDevice, ID: int32(d.h)}, Flags: api.MemAccessProtReadWrite})
	}
	if err := check(c.a.MemSetAccess(p, a.size, &desc[0], uint64(len(desc))), "cuMemSetAccess"); err != nil {
		c.a.MemUnmap(p, a.size)
		c.a.MemAddressFree(p, a.size)
		return nil, fmt.Errorf("map %s: grant access to %d device(s): %w", a, len(desc), err)
	}
	return &Mapping{ctx: c, ptr: DevicePtr(p), size: a.size}, nil
}

// Close is cuMemUnmap and cuMemAddressFree; idempotent. Using the range
// afterwards is a bug (the simulator records it as "access-after-unmap").
// As with Free, the context must still be open.
func (m *Mapping) Close() error {
	if m == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	if err := m.ctx.enter(); err != nil {
		return err
	}
	defer m.ctx.exit()
	if err := check(m.ctx.a.MemUnmap(api.DevicePtr(m.ptr), m.size), "cuMemUnmap"); err != nil {
		// The range is still mapped: freeing it would fail too.
		return fmt.Errorf("unmap %#x: %w", uint64(m.ptr), err)
	}
	return check(m.ctx.a.MemAddressFree(api.DevicePtr(m.ptr), m.size), "cuMemAddressFree")
}

// Access is cuMemGetAccess: the access flags dev has on the mapping
// (0 none, 1 read, 3 read-write).
func (m *Mapping) Access(dev *Device) (int, error) {
	if err := m.ctx.enter(); err != nil {
		return 0, err
	}
	defer m.ctx.exit()
	loc := api.MemLocation{Type: api.MemLocationTypeDevice, ID: int32(dev.h)}
	var flags uint64
	err := check(m.ctx.a.MemGetAccess(&flags, &loc, api.DevicePtr(m.ptr)), "cuMemGetAccess")
	return int(flags), err
}
