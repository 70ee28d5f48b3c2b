package sim

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"path/filepath"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// File names in the state directory.
const (
	registryFile   = "registry"
	violationsFile = "violations.jsonl"
	bufferPrefix   = "buf-"
)

// Registry geometry. Every process sharing a directory must agree on it; the
// header records it and openRegistry refuses a file made with another.
const (
	regMagic      = 0x314d495348534343 // "CCSHSIM1" in little-endian bytes
	regVersion    = 1
	regHeaderSize = 4096
	regSlots      = 8192 // live allocations on the whole machine
	regMappers    = 32   // processes mapping one allocation at once
	regSlotSize   = 64 + regMappers*24
	regSize       = regHeaderSize + regSlots*regSlotSize
)

// Slot states.
const (
	slotEmpty = iota
	// slotLive: the owner holds the allocation.
	slotLive
	// slotOrphan: the owner is gone (its context was destroyed or its process
	// exited) while other processes still mapped the memory. The slot, its
	// backing file and its share of device memory live on until the last
	// mapper closes or dies, as the real driver keeps memory alive for its
	// importers. Handles to it no longer open.
	slotOrphan
)

// regHeader is the first page of the registry file.
type regHeader struct {
	magic     uint64
	version   uint32
	slots     uint32
	mappers   uint32
	highWater uint32 // slots [0, highWater) have been used at least once
	topoHash  uint64
	secret    uint64 // keys the checksum of IPC handles minted for this machine
	nextID    uint64 // next global buffer id; also names backing files
}

// regSlot is one allocation on the simulated machine.
type regSlot struct {
	state uint32
	dev   uint32 // host-global device ordinal
	size  uint64 // bytes requested
	span  uint64 // bytes charged to the device (size rounded up to allocGranularity)
	id    uint64 // global buffer id, never reused in a state directory
	nonce uint64 // random; an IPC handle must carry it
	owner procID
	// ownerNS is the inode of the owner's PID namespace (0: not recorded).
	ownerNS uint32
	_       uint32
	maps    [regMappers]regMapper
}

// regMapper is one process that holds IPC mappings of a slot.
type regMapper struct {
	proc  procID
	count uint32 // mappings (one per importing context)
	ns    uint32 // inode of the mapper's PID namespace (0: not recorded)
}

// The layout is shared between processes; pin it.
var (
	_ [regSlotSize - unsafe.Sizeof(regSlot{})]struct{}
	_ [unsafe.Sizeof(regSlot{}) - regSlotSize]struct{}
	_ [regHeaderSize - unsafe.Sizeof(regHeader{})]struct{}
)

// registry is the machine-wide allocation table: a file in the state
// directory, mmap'd MAP_SHARED by every process and changed only under an
// exclusive flock. mu serialises the goroutines of this process, which share
// one open file description and so one flock.
type registry struct {
	dir string
	mu  sync.Mutex
	fd  int
	mem []byte
	hdr *regHeader
}

var errIncompatible = errors.New("incompatible registry")

func openRegistry(dir string, topoHash uint64) (*registry, error) {
	path := filepath.Join(dir, registryFile)
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	r := &registry{dir: dir, fd: fd}
	if err := r.init(topoHash); err != nil {
		r.close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return r, nil
}

func (r *registry) init(topoHash uint64) error {
	if err := flock(r.fd, unix.LOCK_EX); err != nil {
		return err
	}
	defer flock(r.fd, unix.LOCK_UN)
	var st unix.Stat_t
	if err := unix.Fstat(r.fd, &st); err != nil {
		return err
	}
	switch st.Size {
	case 0:
		if err := unix.Ftruncate(r.fd, regSize); err != nil {
			return err
		}
	case regSize:
	default:
		return fmt.Errorf("%w: size %d, want %d (ResetState the directory)", errIncompatible, st.Size, regSize)
	}
	mem, err := unix.Mmap(r.fd, 0, regSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	r.mem = mem
	r.hdr = (*regHeader)(unsafe.Pointer(&mem[0]))
	h := r.hdr
	if h.magic == 0 {
		var b [8]byte
		if _, err := rand.Read(b[:]); err != nil {
			return err
		}
		h.version, h.slots, h.mappers = regVersion, regSlots, regMappers
		h.topoHash, h.secret, h.nextID = topoHash, binary.LittleEndian.Uint64(b[:]), 1
		h.magic = regMagic // last: a crash before this leaves a file that re-initialises
		return nil
	}
	if h.magic != regMagic || h.version != regVersion || h.slots != regSlots || h.mappers != regMappers {
		return fmt.Errorf("%w: made by another version of the sim (ResetState the directory)", errIncompatible)
	}
	if h.topoHash != topoHash {
		return fmt.Errorf("%w: made for another topology; every process sharing a state directory needs the same %s", errIncompatible, EnvTopology)
	}
	return nil
}

func flock(fd, how int) error {
	for {
		err := unix.Flock(fd, how)
		if err != unix.EINTR {
			return err
		}
	}
}

func (r *registry) lock() error {
	r.mu.Lock()
	if err := flock(r.fd, unix.LOCK_EX); err != nil {
		r.mu.Unlock()
		return err
	}
	return nil
}

func (r *registry) unlock() {
	_ = flock(r.fd, unix.LOCK_UN)
	r.mu.Unlock()
}

func (r *registry) close() {
	if r.mem != nil {
		_ = unix.Munmap(r.mem)
		r.mem, r.hdr = nil, nil
	}
	if r.fd >= 0 {
		_ = unix.Close(r.fd)
		r.fd = -1
	}
}

// The methods below require the lock.

func (r *registry) slot(i int) *regSlot {
	return (*regSlot)(unsafe.Pointer(&r.mem[regHeaderSize+i*regSlotSize]))
}

func (r *registry) bufferPath(id uint64) string {
	return filepath.Join(r.dir, fmt.Sprintf("%s%016x", bufferPrefix, id))
}

// used is the device memory charged on dev by every process.
func (r *registry) used(dev uint32) uint64 {
	var n uint64
	for i := 0; i < int(r.hdr.highWater); i++ {
		if s := r.slot(i); s.state != slotEmpty && s.dev == dev {
			n += s.span
		}
	}
	return n
}

// sweep applies process exit to every slot: dead mappers unmapped, dead
// owners' allocations orphaned, orphans without mappers released.
func (r *registry) sweep(l *liveness) {
	for i := 0; i < int(r.hdr.highWater); i++ {
		r.sweepSlot(i, l)
	}
}

func (r *registry) sweepSlot(i int, l *liveness) {
	s := r.slot(i)
	if s.state == slotEmpty {
		return
	}
	for j := range s.maps {
		if m := &s.maps[j]; m.count != 0 && !l.aliveIn(m.proc, m.ns) {
			*m = regMapper{}
		}
	}
	if s.state == slotLive && !l.aliveIn(s.owner, s.ownerNS) {
		s.state = slotOrphan
	}
	r.releaseIfUnmapped(i)
}

// liveMappers sweeps slot i and returns the processes other than self that
// still map it.
func (r *registry) liveMappers(i int, l *liveness) []procID {
	r.sweepSlot(i, l)
	var out []procID
	for _, m := range r.slot(i).maps {
		if m.count != 0 && m.proc != l.self {
			out = append(out, m.proc)
		}
	}
	return out
}

// alloc claims a slot for a new allocation of span bytes on dev, whose total
// is total. It returns false when the device (or the registry) is full even
// after dead processes are swept.
func (r *registry) alloc(dev uint32, size, span, total uint64, l *liveness) (int, bool) {
	swept := false
	if r.used(dev)+span > total {
		r.sweep(l)
		swept = true
		if r.used(dev)+span > total {
			return -1, false
		}
	}
	i := r.emptySlot()
	if i < 0 && !swept {
		r.sweep(l)
		i = r.emptySlot()
	}
	if i < 0 {
		return -1, false
	}
	s := r.slot(i)
	*s = regSlot{dev: dev, size: size, span: span, id: r.hdr.nextID, nonce: mrand.Uint64() | 1, owner: l.self, ownerNS: selfNS()}
	r.hdr.nextID++
	s.state = slotLive
	return i, true
}

func (r *registry) emptySlot() int {
	for i := 0; i < int(r.hdr.highWater); i++ {
		if r.slot(i).state == slotEmpty {
			return i
		}
	}
	if r.hdr.highWater < regSlots {
		r.hdr.highWater++
		return int(r.hdr.highWater) - 1
	}
	return -1
}

// addMapper counts one more mapping of slot i by self. It returns false when
// the mapper table is full of live processes.
func (r *registry) addMapper(i int, l *liveness) bool {
	s := r.slot(i)
	free := -1
	for j := range s.maps {
		m := &s.maps[j]
		if m.count != 0 && m.proc == l.self {
			m.count++
			return true
		}
		if m.count == 0 && free < 0 {
			free = j
		}
	}
	if free < 0 {
		r.sweepSlot(i, l)
		for j := range s.maps {
			if s.maps[j].count == 0 {
				free = j
				break
			}
		}
	}
	if free < 0 {
		return false
	}
	s.maps[free] = regMapper{proc: l.self, count: 1, ns: selfNS()}
	return true
}

// dropMapper counts one mapping of slot i by self less, releasing an orphan
// that nobody maps any more.
func (r *registry) dropMapper(i int, self procID) {
	s := r.slot(i)
	for j := range s.maps {
		if m := &s.maps[j]; m.count != 0 && m.proc == self {
			if m.count--; m.count == 0 {
				*m = regMapper{}
			}
			break
		}
	}
	r.releaseIfUnmapped(i)
}

// disown ends the owner's hold on slot i: the slot is released, or orphaned
// while other processes map it.
func (r *registry) disown(i int) {
	r.slot(i).state = slotOrphan
	r.releaseIfUnmapped(i)
}

func (r *registry) releaseIfUnmapped(i int) {
	s := r.slot(i)
	if s.state != slotOrphan {
		return
	}
	for _, m := range s.maps {
		if m.count != 0 {
			return
		}
	}
	// Unlinking is enough: mappings still open in this process keep the
	// pages until they are unmapped.
	_ = unix.Unlink(r.bufferPath(s.id))
	*s = regSlot{}
}

// mapBuffer maps the backing file of a buffer, creating it (sparse) first
// when create is set.
func mapBuffer(path string, size uint64, create bool) ([]byte, error) {
	flags := unix.O_RDWR | unix.O_CLOEXEC | unix.O_NOFOLLOW
	if create {
		flags |= unix.O_CREAT | unix.O_EXCL
	}
	fd, err := unix.Open(path, flags, 0o600)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	if create {
		if err := unix.Ftruncate(fd, int64(size)); err != nil {
			_ = unix.Unlink(path)
			return nil, err
		}
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil && create {
		_ = unix.Unlink(path)
	}
	return mem, err
}
