//go:build linux

package transport

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A shm connection (CapShm, PROTOCOL.md section 2.3) carries its frames
// through the shm channel, a segment of memory the two processes share:
// one lane (a circular queue of bytes) each way, written by one side and
// read by the other, with no system call while both sides are awake. The
// socket stays: it carries descriptors, the doorbell that wakes a reader
// asleep on it, error messages, and the end of the connection.
//
// The segment is a memfd the listener creates, seals against shrinking and
// growing, and sends with its hello-ack. Its first page holds the two lanes'
// control blocks; the data of lane 0 (listener to dialer) and then of lane 1
// (dialer to listener) follow, laneSize bytes each.
const (
	laneSize   = 64 << 10 // the data of one lane
	shmCtlPage = 4096
	shmSegSize = shmCtlPage + 2*laneSize

	// Offsets within a lane's control block (lane 0's at 0, lane 1's at
	// laneCtlStep): the writer's count of bytes ever written, and on
	// another cache line the reader's count of bytes ever read and its
	// sleeping word.
	laneCtlStep  = 256
	laneTail     = 0
	laneHead     = 128
	laneSleeping = 136

	shmSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
)

// shmSeg is one connection's mapping of the segment.
type shmSeg struct {
	mem     []byte
	in, out lane
}

// lane is one lane as one side sees it. pos is this side's own count,
// the tail of a lane it writes or the head of one it reads: it is kept
// here and only published to the segment, whose copy the peer could
// change. seen is, for a lane this side writes, the peer's head when last
// read: it may only grow.
type lane struct {
	tail, head *uint64
	sleeping   *uint32
	data       []byte
	pos, seen  uint64
}

func word64(mem []byte, off int) *uint64 { return (*uint64)(unsafe.Pointer(&mem[off])) }
func word32(mem []byte, off int) *uint32 { return (*uint32)(unsafe.Pointer(&mem[off])) }

// newShmSeg creates a segment, as a listener does, and returns it with
// the memfd to send; the caller closes the memfd once it is sent.
func newShmSeg() (*shmSeg, int, error) {
	fd, err := unix.MemfdCreate("cudashare-shm", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, fmt.Errorf("memfd_create: %w", err)
	}
	seg, err := func() (*shmSeg, error) {
		if err := unix.Ftruncate(fd, shmSegSize); err != nil {
			return nil, fmt.Errorf("ftruncate: %w", err)
		}
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, shmSeals); err != nil {
			return nil, fmt.Errorf("seal: %w", err)
		}
		return mapShm(fd, false)
	}()
	if err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("transport: shm segment: %w", err)
	}
	return seg, fd, nil
}

// openShmSeg maps the segment a listener sent, as a dialer does, after
// checking what a listener could get wrong to hurt it: its size, and seals
// without which the listener could shrink it under the mapping and make
// every later access fault. The seals first, the size after: a listener
// that shrank the segment after a look at its size, and sealed it then,
// would pass both; once it is sealed, the size read is the size mapped.
func openShmSeg(fd int) (*shmSeg, error) {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&(unix.F_SEAL_SHRINK|unix.F_SEAL_GROW) != unix.F_SEAL_SHRINK|unix.F_SEAL_GROW {
		return nil, malformed("the shm segment is not sealed against shrinking and growing (seals %#x, %v)", seals, err)
	}
	var st unix.Stat_t
	if err := shmSegFstat(fd, &st); err != nil {
		return nil, fmt.Errorf("%w: the shm segment: fstat: %w", ErrHandshake, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != shmSegSize {
		return nil, malformed("the shm segment: mode %#o, %d bytes, want a regular file of %d", st.Mode, st.Size, shmSegSize)
	}
	seg, err := mapShm(fd, true)
	if err != nil {
		return nil, fmt.Errorf("%w: the shm segment: %w", ErrHandshake, err)
	}
	return seg, nil
}

// shmSegFstat is unix.Fstat; a test stands in for a listener that
// resizes the segment right after the dialer's fstat.
var shmSegFstat = unix.Fstat

func mapShm(fd int, dialer bool) (*shmSeg, error) {
	mem, err := unix.Mmap(fd, 0, shmSegSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap: %w", err)
	}
	half := func(i int) lane {
		ctl := i * laneCtlStep
		data := shmCtlPage + i*laneSize
		return lane{
			tail:     word64(mem, ctl+laneTail),
			head:     word64(mem, ctl+laneHead),
			sleeping: word32(mem, ctl+laneSleeping),
			data:     mem[data : data+laneSize : data+laneSize],
		}
	}
	s := &shmSeg{mem: mem, in: half(1), out: half(0)}
	if dialer {
		s.in, s.out = half(0), half(1)
	}
	return s, nil
}

func (s *shmSeg) unmap() { unix.Munmap(s.mem) }

// ready reports whether the lane this side reads has bytes to read (or
// a tail the peer broke, which read reports).
func (h *lane) ready() bool { return atomic.LoadUint64(h.tail) != h.pos }

// read copies what the peer has written, as much as fits, into p.
func (h *lane) read(p []byte) (int, error) {
	avail := atomic.LoadUint64(h.tail) - h.pos
	if avail > laneSize {
		return 0, malformed("lane tail %d bytes ahead of what was read (lane of %d)", int64(avail), laneSize)
	}
	n := min(int(avail), len(p))
	if n == 0 {
		return 0, nil
	}
	at := int(h.pos % laneSize)
	k := copy(p[:n], h.data[at:])
	copy(p[k:n], h.data)
	h.pos += uint64(n)
	atomic.StoreUint64(h.head, h.pos)
	return n, nil
}

// peerHead loads the peer's head of a lane this side writes, and checks
// it: a head only grows, and never past what was written (seen <= head <=
// pos; seen never lags pos by more than the lane). A peer whose head
// breaks that, by going backwards or beyond, or by flipping between
// values, has broken the lane's rules. The caller owns the write side.
func (h *lane) peerHead() (uint64, error) {
	head := atomic.LoadUint64(h.head)
	// Unsigned: a head behind seen wraps around to more than pos-seen.
	if head-h.seen > h.pos-h.seen {
		return 0, malformed("lane head moved from %d to %d, with %d written", h.seen, head, h.pos)
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
func (h *lane) write(b []byte) (int, error) {
	if laneSize-int(h.pos-h.seen) < len(b) {
		if _, err := h.peerHead(); err != nil {
			return 0, err
		}
	}
	n := min(laneSize-int(h.pos-h.seen), len(b))
	if n == 0 {
		return 0, nil
	}
	at := int(h.pos % laneSize)
	k := copy(h.data[at:], b[:n])
	copy(h.data, b[k:n])
	h.pos += uint64(n)
	// A swap, not a store: see sleep.
	atomic.SwapUint64(h.tail, h.pos)
	return n, nil
}

// flushed reports whether the peer has read everything written, and
// fails if its head broke the rules (peerHead).
func (h *lane) flushed() (bool, error) {
	head, err := h.peerHead()
	return head == h.pos, err
}

// sleep and wake set and clear this side's sleeping word on the lane it
// reads. A reader sets it, then looks at the ring once more, before it
// waits on the socket; a writer that publishes bytes and then finds it set
// rings the doorbell. Each side's store must be ordered before its load of
// the other word, so that one of the two sees the other: the reader its
// bytes, or the writer its sleep. Go's atomics are sequentially consistent,
// except under the race detector, whose stores only release and loads only
// acquire: a store and a later load may pass each other there, both sides
// miss, and the reader sleeps on bytes that are in the lane (this hung
// handoffs with one credit under -race). A swap is a read-modify-write,
// which orders both ways in every build; on amd64 it is the instruction a
// store is anyway.
func (h *lane) sleep() { atomic.SwapUint32(h.sleeping, 1) }
func (h *lane) wake()  { atomic.StoreUint32(h.sleeping, 0) }

// asleep reports, once per sleep, whether the peer reading this lane
// sleeps and so needs the doorbell.
func (h *lane) asleep() bool {
	return atomic.LoadUint32(h.sleeping) != 0 && atomic.CompareAndSwapUint32(h.sleeping, 1, 0)
}
