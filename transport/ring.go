//go:build linux

package transport

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A ring connection (CapRing, PROTOCOL.md section 2.3) carries its frames
// through a segment of memory the two processes share: one ring of bytes
// each way, written by one side and read by the other, with no system call
// while both sides are awake. The socket stays: it carries descriptors, the
// doorbell that wakes a reader asleep on it, error messages, and the end of
// the connection.
//
// The segment is a memfd the listener creates, seals against shrinking and
// growing, and sends with its hello-ack. Its first page holds the two rings'
// control blocks; the data of ring 0 (listener to dialer) and then of ring 1
// (dialer to listener) follow, ringSize bytes each.
const (
	ringSize    = 64 << 10 // the data of one ring
	ringCtlPage = 4096
	ringSegSize = ringCtlPage + 2*ringSize

	// Offsets within a ring's control block (ring 0's at 0, ring 1's at
	// ringCtlStep): the writer's count of bytes ever written, and on
	// another cache line the reader's count of bytes ever read and its
	// sleeping word.
	ringCtlStep  = 256
	ringTail     = 0
	ringHead     = 128
	ringSleeping = 136

	ringSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
)

// ringSeg is one connection's mapping of the segment.
type ringSeg struct {
	mem     []byte
	in, out ringHalf
}

// ringHalf is one ring as one side sees it. pos is this side's own count,
// the tail of a ring it writes or the head of one it reads: it is kept
// here and only published to the segment, whose copy the peer could
// change. seen is, for a ring this side writes, the peer's head when last
// read: it may only grow.
type ringHalf struct {
	tail, head *uint64
	sleeping   *uint32
	data       []byte
	pos, seen  uint64
}

func word64(mem []byte, off int) *uint64 { return (*uint64)(unsafe.Pointer(&mem[off])) }
func word32(mem []byte, off int) *uint32 { return (*uint32)(unsafe.Pointer(&mem[off])) }

// newRingSeg creates a segment, as a listener does, and returns it with
// the memfd to send; the caller closes the memfd once it is sent.
func newRingSeg() (*ringSeg, int, error) {
	fd, err := unix.MemfdCreate("cudashare-ring", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, fmt.Errorf("memfd_create: %w", err)
	}
	seg, err := func() (*ringSeg, error) {
		if err := unix.Ftruncate(fd, ringSegSize); err != nil {
			return nil, fmt.Errorf("ftruncate: %w", err)
		}
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, ringSeals); err != nil {
			return nil, fmt.Errorf("seal: %w", err)
		}
		return mapRing(fd, false)
	}()
	if err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("transport: ring segment: %w", err)
	}
	return seg, fd, nil
}

// openRingSeg maps the segment a listener sent, as a dialer does, after
// checking what a listener could get wrong to hurt it: its size, and seals
// without which the listener could shrink it under the mapping and make
// every later access fault. The seals first, the size after: a listener
// that shrank the segment after a look at its size, and sealed it then,
// would pass both; once it is sealed, the size read is the size mapped.
func openRingSeg(fd int) (*ringSeg, error) {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&(unix.F_SEAL_SHRINK|unix.F_SEAL_GROW) != unix.F_SEAL_SHRINK|unix.F_SEAL_GROW {
		return nil, malformed("the ring segment is not sealed against shrinking and growing (seals %#x, %v)", seals, err)
	}
	var st unix.Stat_t
	if err := ringSegFstat(fd, &st); err != nil {
		return nil, fmt.Errorf("%w: the ring segment: fstat: %w", ErrHandshake, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != ringSegSize {
		return nil, malformed("the ring segment: mode %#o, %d bytes, want a regular file of %d", st.Mode, st.Size, ringSegSize)
	}
	seg, err := mapRing(fd, true)
	if err != nil {
		return nil, fmt.Errorf("%w: the ring segment: %w", ErrHandshake, err)
	}
	return seg, nil
}

// ringSegFstat is unix.Fstat; a test stands in for a listener that
// resizes the segment right after the dialer's fstat.
var ringSegFstat = unix.Fstat

func mapRing(fd int, dialer bool) (*ringSeg, error) {
	mem, err := unix.Mmap(fd, 0, ringSegSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap: %w", err)
	}
	half := func(i int) ringHalf {
		ctl := i * ringCtlStep
		data := ringCtlPage + i*ringSize
		return ringHalf{
			tail:     word64(mem, ctl+ringTail),
			head:     word64(mem, ctl+ringHead),
			sleeping: word32(mem, ctl+ringSleeping),
			data:     mem[data : data+ringSize : data+ringSize],
		}
	}
	s := &ringSeg{mem: mem, in: half(1), out: half(0)}
	if dialer {
		s.in, s.out = half(0), half(1)
	}
	return s, nil
}

func (s *ringSeg) unmap() { unix.Munmap(s.mem) }

// ready reports whether the ring this side reads has bytes to read (or
// a tail the peer broke, which read reports).
func (h *ringHalf) ready() bool { return atomic.LoadUint64(h.tail) != h.pos }

// read copies what the peer has written, as much as fits, into p.
func (h *ringHalf) read(p []byte) (int, error) {
	avail := atomic.LoadUint64(h.tail) - h.pos
	if avail > ringSize {
		return 0, malformed("ring tail %d bytes ahead of what was read (ring of %d)", int64(avail), ringSize)
	}
	n := min(int(avail), len(p))
	if n == 0 {
		return 0, nil
	}
	at := int(h.pos % ringSize)
	k := copy(p[:n], h.data[at:])
	copy(p[k:n], h.data)
	h.pos += uint64(n)
	atomic.StoreUint64(h.head, h.pos)
	return n, nil
}

// peerHead loads the peer's head of a ring this side writes, and checks
// it: a head only grows, and never past what was written (seen <= head <=
// pos; seen never lags pos by more than the ring). A peer whose head
// breaks that, by going backwards or beyond, or by flipping between
// values, has broken the ring's rules. The caller owns the write side.
func (h *ringHalf) peerHead() (uint64, error) {
	head := atomic.LoadUint64(h.head)
	// Unsigned: a head behind seen wraps around to more than pos-seen.
	if head-h.seen > h.pos-h.seen {
		return 0, malformed("ring head moved from %d to %d, with %d written", h.seen, head, h.pos)
	}
	h.seen = head
	return head, nil
}

// write copies as much of b as there is room for, and publishes it.
// The peer's head is looked at only when the room seen at the last look
// is too short for b: its word is the one line the peer writes for every
// read, and loading it pulls that line across cores, a miss per message
// (a fifth of a broadcast's CPU on an H200 host). A head that broke the
// rules meanwhile is found at the next look, or at the next flushed.
func (h *ringHalf) write(b []byte) (int, error) {
	if ringSize-int(h.pos-h.seen) < len(b) {
		if _, err := h.peerHead(); err != nil {
			return 0, err
		}
	}
	n := min(ringSize-int(h.pos-h.seen), len(b))
	if n == 0 {
		return 0, nil
	}
	at := int(h.pos % ringSize)
	k := copy(h.data[at:], b[:n])
	copy(h.data, b[k:n])
	h.pos += uint64(n)
	// A swap, not a store: see sleep.
	atomic.SwapUint64(h.tail, h.pos)
	return n, nil
}

// flushed reports whether the peer has read everything written, and
// fails if its head broke the rules (peerHead).
func (h *ringHalf) flushed() (bool, error) {
	head, err := h.peerHead()
	return head == h.pos, err
}

// sleep and wake set and clear this side's sleeping word on the ring it
// reads. A reader sets it, then looks at the ring once more, before it
// waits on the socket; a writer that publishes bytes and then finds it set
// rings the doorbell. Each side's store must be ordered before its load of
// the other word, so that one of the two sees the other: the reader its
// bytes, or the writer its sleep. Go's atomics are sequentially consistent,
// except under the race detector, whose stores only release and loads only
// acquire: a store and a later load may pass each other there, both sides
// miss, and the reader sleeps on bytes that are in the ring (this hung
// handoffs with one credit under -race). A swap is a read-modify-write,
// which orders both ways in every build; on amd64 it is the instruction a
// store is anyway.
func (h *ringHalf) sleep() { atomic.SwapUint32(h.sleeping, 1) }
func (h *ringHalf) wake()  { atomic.StoreUint32(h.sleeping, 0) }

// asleep reports, once per sleep, whether the peer reading this ring
// sleeps and so needs the doorbell.
func (h *ringHalf) asleep() bool {
	return atomic.LoadUint32(h.sleeping) != 0 && atomic.CompareAndSwapUint32(h.sleeping, 1, 0)
}
