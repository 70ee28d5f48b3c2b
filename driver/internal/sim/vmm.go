package sim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Virtual memory management (cuMemCreate and friends). A VMM allocation is a
// memfd: the first page is a header (vmmHeader, documented in doc.go), the
// memory follows it. Export dups the memfd, import reads the header from the
// fd alone (so an fd received over SCM_RIGHTS from any process, in any PID
// namespace, imports), and cuMemMap mmaps the data pages MAP_SHARED. The
// kernel's reference counting on the memfd then keeps the memory alive
// while any handle, fd or mapping of it exists, in any process.
const (
	vmmHeaderSize = 4096
	vmmMagic      = "CSIMVMM1"
	vmmVersion    = 1
	vmmSumOffset  = 56
	vmmMemfdName  = "cudashare-sim-vmm-"
	// vmmSeals are set at creation: no process that holds the fd can
	// shrink it (every mapping of the memory would then fault, SIGBUS, in
	// whichever process touched it), grow it, or change the seals, as no
	// process can resize a real driver's allocation. F_SEAL_WRITE is not
	// among them: the memory is written through shared mappings.
	vmmSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
	// vmmNeedSeals are the seals an import requires: without them the
	// sender could resize the memfd under the importer's mapping.
	vmmNeedSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW
	// vmmBadSeals would make the importer's writable mapping fail.
	vmmBadSeals = unix.F_SEAL_WRITE | unix.F_SEAL_FUTURE_WRITE
	// vaRegion is the index of the simulated address region that address
	// reservations come from; device regions are 0..maxDevices-1.
	vaRegion     = maxDevices
	hostPageSize = 4096
	memHandleTag = 0x4d << 56
)

// vmmHeader is the first page of an allocation's memfd, little-endian.
type vmmHeader struct {
	dev         uint32 // host-global device
	size        uint64 // bytes of memory after the header page
	gid         uint64 // global buffer id: never reused in the state directory
	slot        uint32 // registry slot charged with the memory
	handleTypes int32  // requestedHandleTypes of cuMemCreate
	creator     procID
}

func (d *Driver) encodeVMMHeader(h vmmHeader) [vmmHeaderSize]byte {
	var b [vmmHeaderSize]byte
	le := binary.LittleEndian
	copy(b[0:8], vmmMagic)
	le.PutUint32(b[8:], vmmVersion)
	le.PutUint32(b[12:], h.dev)
	le.PutUint64(b[16:], h.size)
	le.PutUint64(b[24:], h.gid)
	le.PutUint32(b[32:], h.slot)
	le.PutUint32(b[36:], uint32(h.handleTypes))
	le.PutUint32(b[40:], uint32(h.creator.pid))
	le.PutUint32(b[44:], h.creator.inst)
	le.PutUint64(b[48:], h.creator.start)
	le.PutUint64(b[vmmSumOffset:], d.vmmSum(&b))
	return b
}

func (d *Driver) vmmSum(b *[vmmHeaderSize]byte) uint64 {
	h := uint64(fnvOffset64)
	for i := range ipcSecretSize {
		h = (h ^ uint64(byte(d.secret>>(8*i)))) * fnvPrime64
	}
	for _, c := range b[:vmmSumOffset] {
		h = (h ^ uint64(c)) * fnvPrime64
	}
	return h
}

// errNotVMM is the cause of every refused import: the fd is not a VMM
// allocation of this simulated machine, or not one that is safe to map.
var errNotVMM = errors.New("not a VMM allocation of the simulator")

// readVMMHeader reads and checks the header of an fd that claims to be a
// VMM allocation of this machine. The error says what is wrong with it,
// for ExplainImport.
func (d *Driver) readVMMHeader(fd int) (vmmHeader, error) {
	// The seals first, the size after: once F_SEAL_SHRINK is on, the size
	// read can only be the size the mapping will see.
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return vmmHeader{}, fmt.Errorf("%w: the descriptor is not a memfd (F_GET_SEALS: %w)", errNotVMM, err)
	}
	if seals&vmmNeedSeals != vmmNeedSeals {
		return vmmHeader{}, fmt.Errorf("%w: the memfd is not sealed against shrinking and growing (seals %#x): its sender could resize it under the mapping", errNotVMM, seals)
	}
	if seals&vmmBadSeals != 0 {
		return vmmHeader{}, fmt.Errorf("%w: the memfd is sealed against writing (seals %#x)", errNotVMM, seals)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return vmmHeader{}, fmt.Errorf("%w: fstat: %w", errNotVMM, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size < vmmHeaderSize {
		return vmmHeader{}, fmt.Errorf("%w: mode %#o, %d bytes: no %d-byte header", errNotVMM, st.Mode, st.Size, vmmHeaderSize)
	}
	var b [vmmHeaderSize]byte
	if n, err := unix.Pread(fd, b[:], 0); err != nil || n != vmmHeaderSize {
		return vmmHeader{}, fmt.Errorf("%w: read the header: %d bytes, %v", errNotVMM, n, err)
	}
	le := binary.LittleEndian
	if string(b[0:8]) != vmmMagic || le.Uint32(b[8:]) != vmmVersion {
		return vmmHeader{}, fmt.Errorf("%w: header magic %q, version %d", errNotVMM, b[0:8], le.Uint32(b[8:]))
	}
	if le.Uint64(b[vmmSumOffset:]) != d.vmmSum(&b) {
		return vmmHeader{}, fmt.Errorf("%w: bad header checksum (an allocation of another state directory?)", errNotVMM)
	}
	h := vmmHeader{
		dev: le.Uint32(b[12:]), size: le.Uint64(b[16:]), gid: le.Uint64(b[24:]), slot: le.Uint32(b[32:]),
		handleTypes: int32(le.Uint32(b[36:])),
		creator:     procID{pid: int32(le.Uint32(b[40:])), inst: le.Uint32(b[44:]), start: le.Uint64(b[48:])},
	}
	if int(h.dev) >= len(d.m.devices) || h.slot >= regSlots {
		return vmmHeader{}, fmt.Errorf("%w: header names device %d, registry slot %d", errNotVMM, h.dev, h.slot)
	}
	// Exactly the header and the memory, as created: the seals keep it so.
	if uint64(st.Size)-vmmHeaderSize != h.size {
		return vmmHeader{}, fmt.Errorf("%w: the memfd has %d bytes, its header says %d of memory after %d", errNotVMM, st.Size, h.size, vmmHeaderSize)
	}
	return h, nil
}

// vmmState is a process's VMM objects. Guarded by Driver.mu.
type vmmState struct {
	handles    map[api.MemHandle]*vmmHandle // released ones stay, to name a reuse
	lastHandle uint64
	resv       []*vaResv           // sorted by base
	holds      map[uint64]*vmmHold // by global id
}

// vmmHandle is a CUmemGenericAllocationHandle of this process.
type vmmHandle struct {
	fd       int // the memfd; -1 once released
	hdr      vmmHeader
	released bool
}

// vaResv is an address range from cuMemAddressReserve.
type vaResv struct{ base, size uint64 }

// vmmHold counts this process's handles and mappings of one allocation: the
// process holds the allocation's memory, for device memory accounting, while
// the count is not zero. The creator holds the registry slot as its owner,
// other processes as mappers.
type vmmHold struct {
	slot    int
	owner   bool
	counted bool // the registry slot still described the allocation when the hold began
	refs    int
}

// vmmMap is what a memObj that is a cuMemMap mapping adds.
type vmmMap struct {
	gid     uint64
	access  map[int]int32 // host-global device -> CUmemAccess_flags
	foreign bool          // another process created the allocation
}

func (v *vmmState) init() {
	if v.handles == nil {
		v.handles = make(map[api.MemHandle]*vmmHandle)
		v.holds = make(map[uint64]*vmmHold)
	}
}

// hold counts one more handle or mapping of the allocation described by h.
// mu held; takes the registry lock.
func (d *Driver) hold(h vmmHeader, creating bool) {
	if v := d.vmm.holds[h.gid]; v != nil {
		v.refs++
		return
	}
	v := &vmmHold{slot: int(h.slot), owner: creating, refs: 1}
	d.vmm.holds[h.gid] = v
	if creating {
		v.counted = true
		return
	}
	if d.reg.lock() != nil {
		return
	}
	defer d.reg.unlock()
	l := d.live()
	d.reg.sweepSlot(v.slot, l)
	if s := d.reg.slot(v.slot); s.state != slotEmpty && s.id == h.gid {
		v.counted = d.reg.addMapper(v.slot, l)
	}
}

// unhold undoes one hold. mu held; takes the registry lock.
func (d *Driver) unhold(gid uint64) {
	v := d.vmm.holds[gid]
	if v == nil {
		return
	}
	if v.refs--; v.refs > 0 {
		return
	}
	delete(d.vmm.holds, gid)
	if !v.counted || d.reg.lock() != nil {
		return
	}
	defer d.reg.unlock()
	if s := d.reg.slot(v.slot); s.state == slotEmpty || s.id != gid {
		return
	}
	if v.owner {
		d.reg.disown(v.slot)
	} else {
		d.reg.dropMapper(v.slot, d.self)
	}
}

// handle resolves a CUmemGenericAllocationHandle. A released one is recorded
// as a violation of kind, naming call. mu held.
func (d *Driver) vmmHandle(h api.MemHandle, call, kind string) (*vmmHandle, api.Result) {
	v := d.vmm.handles[h]
	if v == nil {
		return nil, api.ErrorInvalidValue
	}
	if v.released {
		d.violate(kind, fmt.Sprintf("%s: handle %#x (global %d) was released", call, uint64(h), v.hdr.gid))
		return nil, api.ErrorInvalidValue
	}
	return v, api.Success
}

func (d *Driver) newHandle(fd int, hdr vmmHeader, creating bool) api.MemHandle {
	d.vmm.init()
	d.vmm.lastHandle++
	h := api.MemHandle(memHandleTag | uint64(d.self.inst&0xff)<<48 | d.vmm.lastHandle)
	d.vmm.handles[h] = &vmmHandle{fd: fd, hdr: hdr}
	d.hold(hdr, creating)
	return h
}

// checkProp validates a CUmemAllocationProp for cuMemCreate and
// cuMemGetAllocationGranularity: a pinned allocation on a device. It returns
// the host-global device.
func (d *Driver) checkProp(prop *api.MemAllocationProp) (int, api.Result) {
	if prop == nil || prop.Type != api.MemAllocationTypePinned || prop.Win32HandleMetaData != 0 {
		return 0, api.ErrorInvalidValue
	}
	switch prop.Location.Type {
	case api.MemLocationTypeDevice:
	case api.MemLocationTypeHost:
		// Host VMM allocations exist in CUDA 12.2+; the sim has none.
		return 0, api.ErrorNotSupported
	default:
		return 0, api.ErrorInvalidValue
	}
	if _, ok := d.device(api.Device(prop.Location.ID)); !ok {
		return 0, api.ErrorInvalidDevice
	}
	const known = api.MemHandleTypePosixFileDescriptor | api.MemHandleTypeWin32 | api.MemHandleTypeWin32Kmt | api.MemHandleTypeFabric
	if prop.RequestedHandleTypes&^known != 0 {
		return 0, api.ErrorInvalidValue
	}
	return d.visible[prop.Location.ID], api.Success
}

// MemGetAllocationGranularity implements api.API: 2 MiB, minimum and
// recommended alike, as an H200 reports (measured, GPU.md). No current
// context is needed (unverified). A device out of range is
// CUDA_ERROR_INVALID_DEVICE (unverified: the page lists only
// CUDA_ERROR_INVALID_VALUE). Allocation type 0 (INVALID) and location type
// 0 (INVALID) are accepted: driver 580 on an H100 answers CUDA_SUCCESS for
// each (measured; the page says CUDA_ERROR_INVALID_VALUE). The sim reads
// them as a pinned allocation and a device location, the location's id
// still checked (unverified).
func (d *Driver) MemGetAllocationGranularity(granularity *uint64, prop *api.MemAllocationProp, option int32) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if granularity == nil || prop == nil || (option != api.MemAllocGranularityMinimum && option != api.MemAllocGranularityRecommended) {
		return api.ErrorInvalidValue
	}
	p := *prop
	if p.Type == 0 { // CU_MEM_ALLOCATION_TYPE_INVALID
		p.Type = api.MemAllocationTypePinned
	}
	if p.Location.Type == api.MemLocationTypeInvalid {
		p.Location.Type = api.MemLocationTypeDevice
	}
	if _, r := d.checkProp(&p); r != api.Success {
		return r
	}
	*granularity = allocGranularity
	return api.Success
}

// MemCreate implements api.API. size must be a multiple of the granularity
// and flags 0 (CUDA_ERROR_INVALID_VALUE); a fabric handle type is
// CUDA_ERROR_NOT_SUPPORTED (the sim's devices report no fabric support), as
// are the Win32 types on Linux (unverified). The memory is charged to the
// device at once, in the registry, and stays charged while a live process
// holds a handle or a mapping of it; more than the device has free is
// CUDA_ERROR_OUT_OF_MEMORY. No current context is needed (unverified).
func (d *Driver) MemCreate(handle *api.MemHandle, size uint64, prop *api.MemAllocationProp, flags uint64) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if handle == nil || flags != 0 || size == 0 || size%allocGranularity != 0 {
		return api.ErrorInvalidValue
	}
	hdev, r := d.checkProp(prop)
	if r != api.Success {
		return r
	}
	if prop.RequestedHandleTypes&api.MemHandleTypeFabric != 0 {
		switch d.fabric {
		case "":
			return api.ErrorNotSupported
		case "noimex":
			return api.ErrorNotPermitted
		}
	}
	if prop.RequestedHandleTypes&^(api.MemHandleTypePosixFileDescriptor|api.MemHandleTypeFabric) != 0 {
		return api.ErrorNotSupported
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	total := d.m.devices[hdev].totalMem
	if size > total {
		return api.ErrorOutOfMemory
	}
	if d.reg.lock() != nil {
		return api.ErrorUnknown
	}
	slot, ok := d.reg.alloc(uint32(hdev), size, size, total, d.live())
	if !ok {
		d.reg.unlock()
		return api.ErrorOutOfMemory
	}
	gid := d.reg.slot(slot).id
	d.reg.unlock()
	hdr := vmmHeader{dev: uint32(hdev), size: size, gid: gid, slot: uint32(slot), handleTypes: prop.RequestedHandleTypes, creator: d.self}
	fd, err := d.newMemfd(hdr)
	if err != nil {
		if d.reg.lock() == nil {
			d.reg.disown(slot)
			d.reg.unlock()
		}
		return api.ErrorOutOfMemory
	}
	*handle = d.newHandle(fd, hdr, true)
	return api.Success
}

// newMemfd makes an allocation's memfd: its size, its header, then the
// seals (vmmSeals), which every importer checks. Mode 0600, not a memfd's
// default 0777: it is memory, not a program, and nobody else's.
func (d *Driver) newMemfd(hdr vmmHeader) (int, error) {
	fd, err := unix.MemfdCreate(vmmMemfdName+strconv.FormatUint(hdr.gid, 10), unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, err
	}
	b := d.encodeVMMHeader(hdr)
	if err := errors.Join(unix.Ftruncate(fd, int64(vmmHeaderSize+hdr.size)), unix.Fchmod(fd, 0o600)); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if _, err := unix.Pwrite(fd, b[:], 0); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, vmmSeals); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// MemRelease implements api.API. The memory lives on while mappings, other
// handles or exported fds of it exist. Strict: releasing a handle twice is
// CUDA_ERROR_INVALID_VALUE and a "double-release" violation (the real
// driver's behaviour is undefined).
func (d *Driver) MemRelease(handle api.MemHandle) api.Result {
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	v, r := d.vmmHandle(handle, "cuMemRelease", kindDoubleRelease)
	if r != api.Success {
		return r
	}
	unix.Close(v.fd)
	v.fd, v.released = -1, true
	d.unhold(v.hdr.gid)
	return api.Success
}

// MemExportToShareableHandle implements api.API for
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: *shareableHandle (an int)
// receives a new fd, close-on-exec, that the caller owns. An allocation made
// without that handle type is CUDA_ERROR_INVALID_VALUE (unverified); a
// fabric handle is CUDA_ERROR_NOT_SUPPORTED. Strict: exporting a released
// handle is a "use-after-release" violation.
func (d *Driver) MemExportToShareableHandle(shareableHandle unsafe.Pointer, handle api.MemHandle, handleType int32, flags uint64) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if shareableHandle == nil || flags != 0 {
		return api.ErrorInvalidValue
	}
	switch handleType {
	case api.MemHandleTypePosixFileDescriptor:
	case api.MemHandleTypeFabric, api.MemHandleTypeWin32, api.MemHandleTypeWin32Kmt:
		return api.ErrorNotSupported
	default:
		return api.ErrorInvalidValue
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	v, r := d.vmmHandle(handle, "cuMemExportToShareableHandle", kindUseAfterRelease)
	if r != api.Success {
		return r
	}
	if v.hdr.handleTypes&handleType == 0 {
		return api.ErrorInvalidValue
	}
	fd, err := unix.FcntlInt(uintptr(v.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return api.ErrorOutOfMemory
	}
	*(*int32)(shareableHandle) = int32(fd)
	return api.Success
}

// MemImportFromShareableHandle implements api.API for
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: osHandle is the fd, which the
// caller keeps (close it after the import). An open fd that is not a VMM
// allocation of this simulated machine is CUDA_ERROR_UNKNOWN, as driver 580
// on an H100 answers for an fd of /dev/null (measured; the page lists
// CUDA_ERROR_INVALID_VALUE); a fabric handle CUDA_ERROR_NOT_SUPPORTED
// (unverified). So is a memfd with the right header that is not sealed
// against shrinking and growing, or not exactly the header and the memory
// in size: mapping it would let its sender make every access fault
// (SIGBUS) by shrinking it. ExplainImport says which check failed. Each
// import makes a new handle, to be released on its own.
func (d *Driver) MemImportFromShareableHandle(handle *api.MemHandle, osHandle uintptr, handleType int32) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if handle == nil {
		return api.ErrorInvalidValue
	}
	switch handleType {
	case api.MemHandleTypePosixFileDescriptor:
	case api.MemHandleTypeFabric, api.MemHandleTypeWin32, api.MemHandleTypeWin32Kmt:
		return api.ErrorNotSupported
	default:
		return api.ErrorInvalidValue
	}
	fd := int(int32(osHandle))
	if uint64(osHandle) > 1<<31-1 || fd < 0 {
		return api.ErrorInvalidValue
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	hdr, err := d.readVMMHeader(fd)
	if err != nil {
		return api.ErrorUnknown
	}
	if hdr.handleTypes&api.MemHandleTypePosixFileDescriptor == 0 {
		return api.ErrorInvalidValue
	}
	own, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return api.ErrorOutOfMemory
	}
	*handle = d.newHandle(own, hdr, false)
	return api.Success
}

// ExplainImport implements api.ImportExplainer: why
// MemImportFromShareableHandle refuses the fd osHandle, or nil. The
// CUresult cannot say it, and a user whose peer sent an unsealed memfd
// must be told that, not just CUDA_ERROR_UNKNOWN.
func (d *Driver) ExplainImport(osHandle uintptr, handleType int32) error {
	fd := int(int32(osHandle))
	if handleType != api.MemHandleTypePosixFileDescriptor || uint64(osHandle) > 1<<31-1 || fd < 0 {
		return nil
	}
	if d.rlock() != api.Success {
		return nil
	}
	defer d.mu.RUnlock()
	hdr, err := d.readVMMHeader(fd)
	if err != nil {
		return err
	}
	if hdr.handleTypes&api.MemHandleTypePosixFileDescriptor == 0 {
		return fmt.Errorf("allocation %d was not created exportable as a file descriptor", hdr.gid)
	}
	return nil
}

// MemAddressReserve implements api.API. size must be a non-zero multiple of
// the granularity (the page says of the host page size; the sim is
// stricter, unverified), alignment zero or a power of two, flags 0. addr is
// a hint, taken when that range is free and aligned. Reservations come from
// their own region of the simulated address space.
func (d *Driver) MemAddressReserve(ptr *api.DevicePtr, size, alignment uint64, addr api.DevicePtr, flags uint64) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if ptr == nil || size == 0 || size%allocGranularity != 0 || flags != 0 || alignment&(alignment-1) != 0 || uint64(addr)%hostPageSize != 0 {
		return api.ErrorInvalidValue
	}
	align := max(alignment, allocGranularity)
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	d.vmm.init()
	lo, hi := regionOf(vaRegion), regionOf(vaRegion)+1<<regionBits
	base := uint64(0)
	if a := uint64(addr); a != 0 && a%align == 0 && a >= lo && a+size <= hi && d.resvFree(a, size) {
		base = a
	} else {
		cur := lo
		for _, r := range d.vmm.resv {
			if cur+size <= r.base {
				break
			}
			cur = (r.base + r.size + align - 1) &^ (align - 1)
		}
		if cur+size > hi {
			return api.ErrorOutOfMemory
		}
		base = cur
	}
	r := &vaResv{base: base, size: size}
	i := sort.Search(len(d.vmm.resv), func(i int) bool { return d.vmm.resv[i].base > base })
	d.vmm.resv = append(d.vmm.resv, nil)
	copy(d.vmm.resv[i+1:], d.vmm.resv[i:])
	d.vmm.resv[i] = r
	*ptr = api.DevicePtr(base)
	return api.Success
}

func (d *Driver) resvFree(base, size uint64) bool {
	for _, r := range d.vmm.resv {
		if base < r.base+r.size && r.base < base+size {
			return false
		}
	}
	return true
}

// resvOf returns the reservation that holds [base, base+size). mu held.
func (d *Driver) resvOf(base, size uint64) *vaResv {
	for _, r := range d.vmm.resv {
		if base >= r.base && size <= r.size && base-r.base <= r.size-size {
			return r
		}
	}
	return nil
}

// vmmMaps returns the mappings that overlap [base, base+size), in order.
// mu held.
func (d *Driver) vmmMaps(base, size uint64) []*memObj {
	objs := d.space.objs
	i := sort.Search(len(objs), func(i int) bool { return objs[i].base+objs[i].size > base })
	var out []*memObj
	for ; i < len(objs) && objs[i].base < base+size; i++ {
		if objs[i].vmm != nil {
			out = append(out, objs[i])
		}
	}
	return out
}

// covering returns the mappings that exactly tile [base, base+size), or nil.
func (d *Driver) covering(base, size uint64) []*memObj {
	ms := d.vmmMaps(base, size)
	cur := base
	for _, m := range ms {
		if m.base != cur {
			return nil
		}
		cur += m.size
	}
	if cur != base+size {
		return nil
	}
	return ms
}

// MemAddressFree implements api.API. ptr and size must be those of a
// reservation. Strict: freeing a range that still has mappings is
// CUDA_ERROR_INVALID_VALUE (unverified).
func (d *Driver) MemAddressFree(ptr api.DevicePtr, size uint64) api.Result {
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	for i, r := range d.vmm.resv {
		if r.base == uint64(ptr) && r.size == size {
			if len(d.vmmMaps(r.base, r.size)) > 0 {
				return api.ErrorInvalidValue
			}
			d.vmm.resv = append(d.vmm.resv[:i], d.vmm.resv[i+1:]...)
			return api.Success
		}
	}
	return api.ErrorInvalidValue
}

// MemMap implements api.API: mmaps the allocation's memory at ptr, with no
// access until cuMemSetAccess. [ptr, ptr+size) must lie in a reservation and
// not overlap a mapping, ptr must be a multiple of the granularity, size
// not 0 and flags 0 (CUDA_ERROR_INVALID_VALUE). A non-zero offset, a size
// that is not a multiple of the granularity and a size past the
// allocation's are CUDA_ERROR_NOT_SUPPORTED: driver 580 on an H100 answers
// that for each (measured with offset 1, half a granule and one granule
// past; the page says CUDA_ERROR_INVALID_VALUE, and that offset must be 0;
// other offsets unverified). Strict: mapping a released handle is a
// "map-released" violation.
func (d *Driver) MemMap(ptr api.DevicePtr, size, offset uint64, handle api.MemHandle, flags uint64) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if size == 0 || uint64(ptr)%allocGranularity != 0 || flags != 0 {
		return api.ErrorInvalidValue
	}
	if offset != 0 || size%allocGranularity != 0 {
		return api.ErrorNotSupported
	}
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	v, r := d.vmmHandle(handle, "cuMemMap", kindMapReleased)
	if r != api.Success {
		return r
	}
	if size > v.hdr.size {
		return api.ErrorNotSupported
	}
	if d.resvOf(uint64(ptr), size) == nil || len(d.vmmMaps(uint64(ptr), size)) > 0 {
		return api.ErrorInvalidValue
	}
	data, err := unix.Mmap(v.fd, vmmHeaderSize, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return api.ErrorOutOfMemory
	}
	d.lastBufID++
	o := &memObj{
		base: uint64(ptr), size: size, span: size, hdev: int(v.hdr.dev), data: data, slot: int(v.hdr.slot),
		gid: v.hdr.gid, bufID: d.lastBufID,
		vmm: &vmmMap{gid: v.hdr.gid, access: make(map[int]int32), foreign: v.hdr.creator != d.self},
	}
	d.space.insert(o)
	d.hold(v.hdr, false)
	return api.Success
}

// MemUnmap implements api.API. [ptr, ptr+size) must be exactly covered by
// mappings (CUDA_ERROR_INVALID_VALUE otherwise, as for half of a mapping);
// the range stays reserved. A reserved range with no mapping in it at all
// is CUDA_SUCCESS, doing nothing: driver 580 on an H100 answers that
// (measured; the page says CUDA_ERROR_INVALID_VALUE). Strict: a later
// access to an unmapped range is an "access-after-unmap" violation.
func (d *Driver) MemUnmap(ptr api.DevicePtr, size uint64) api.Result {
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	if size != 0 && d.resvOf(uint64(ptr), size) != nil && len(d.vmmMaps(uint64(ptr), size)) == 0 {
		return api.Success
	}
	ms := d.covering(uint64(ptr), size)
	if ms == nil || size == 0 {
		return api.ErrorInvalidValue
	}
	for _, o := range ms {
		d.closing(o, "cuMemUnmap")
		d.unmapVMM(o)
	}
	return api.Success
}

// unmapVMM removes mapping o. mu held.
func (d *Driver) unmapVMM(o *memObj) {
	d.forget(o)
	d.space.remove(o, kindAccessAfterUnmap)
	_ = unix.Munmap(o.data)
	o.data = nil
	d.unhold(o.vmm.gid)
}

func (d *Driver) accessLocation(loc api.MemLocation) (int, api.Result) {
	if loc.Type != api.MemLocationTypeDevice {
		return 0, api.ErrorInvalidValue
	}
	if _, ok := d.device(api.Device(loc.ID)); !ok {
		return 0, api.ErrorInvalidDevice
	}
	return d.visible[loc.ID], api.Success
}

// MemSetAccess implements api.API. [ptr, ptr+size) must be exactly covered
// by mappings, desc and count non-zero, each location a device of this
// process and each flag NONE, READ or READWRITE (all
// CUDA_ERROR_INVALID_VALUE). A location id past the last device is
// CUDA_ERROR_INVALID_VALUE, as driver 580 on an H100 answers (measured; the
// page lists CUDA_ERROR_INVALID_DEVICE, which cuMemGetAccess does return
// for it). A device without peer access to the memory's device is
// CUDA_ERROR_NOT_SUPPORTED (unverified). Every check passes before any
// access changes.
func (d *Driver) MemSetAccess(ptr api.DevicePtr, size uint64, desc *api.MemAccessDesc, count uint64) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if desc == nil || count == 0 || count > 1<<16 || size == 0 {
		return api.ErrorInvalidValue
	}
	ds := unsafe.Slice(desc, count)
	if r := d.lock(); r != api.Success {
		return r
	}
	defer d.mu.Unlock()
	ms := d.covering(uint64(ptr), size)
	if ms == nil {
		return api.ErrorInvalidValue
	}
	devs := make([]int, len(ds))
	for i, a := range ds {
		hdev, r := d.accessLocation(a.Location)
		if r == api.ErrorInvalidDevice {
			return api.ErrorInvalidValue
		}
		if r != api.Success {
			return r
		}
		switch a.Flags {
		case api.MemAccessProtNone, api.MemAccessProtRead, api.MemAccessProtReadWrite:
		default:
			return api.ErrorInvalidValue
		}
		for _, o := range ms {
			if hdev != o.hdev && !d.m.links[hdev][o.hdev].access {
				return api.ErrorNotSupported
			}
		}
		devs[i] = hdev
	}
	for i, a := range ds {
		for _, o := range ms {
			if a.Flags == api.MemAccessProtNone {
				delete(o.vmm.access, devs[i])
			} else {
				o.vmm.access[devs[i]] = a.Flags
			}
		}
	}
	return api.Success
}

// MemGetAccess implements api.API: the flags that cuMemSetAccess gave the
// location for the mapping that holds ptr.
func (d *Driver) MemGetAccess(flags *uint64, location *api.MemLocation, ptr api.DevicePtr) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if flags == nil || location == nil {
		return api.ErrorInvalidValue
	}
	if r := d.rlock(); r != api.Success {
		return r
	}
	defer d.mu.RUnlock()
	hdev, r := d.accessLocation(*location)
	if r != api.Success {
		return r
	}
	o := d.space.find(uint64(ptr))
	if o == nil || o.vmm == nil {
		return api.ErrorInvalidValue
	}
	*flags = uint64(o.vmm.access[hdev])
	return api.Success
}

// vmmAccessible says whether the calling thread may touch mapping o: its
// current context's device was given access. With no current context (an
// async call on an explicit stream), any access given will do. mu held.
func (d *Driver) vmmAccessible(o *memObj) bool {
	if c := d.threads.get(gettid()); c != nil {
		return o.vmm.access[c.hdev] != 0
	}
	return len(o.vmm.access) > 0
}

// vmmTeardown is process exit for VMM objects: mappings unmapped, handles
// closed, holds dropped. mu held; the registry still open.
func (d *Driver) vmmTeardown() {
	for _, o := range append([]*memObj(nil), d.space.objs...) {
		if o.vmm != nil {
			d.unmapVMM(o)
		}
	}
	for _, v := range d.vmm.handles {
		if !v.released {
			unix.Close(v.fd)
			v.fd, v.released = -1, true
			d.unhold(v.hdr.gid)
		}
	}
	d.vmm.resv = nil
}
