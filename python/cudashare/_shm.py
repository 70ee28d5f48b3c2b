"""The shm channel of PROTOCOL.md section 2.3, the consumer's side.

When the producer agrees (the ``shm`` capability), every frame after the
handshake travels through two byte lanes in a memfd segment the producer
creates, instead of on the socket: no system call per message while both
sides are busy. The socket stays for the doorbell that wakes a side asleep
on it, descriptors, error messages and the end of the connection.

The page asks for sequentially consistent atomic loads, stores and swaps of
the control words. Python has none, so they come from libatomic (GCC's
runtime library, ``libatomic.so.1``) through ctypes: its ``__atomic_*_N``
functions are the C11 atomics on a raw address. Where it cannot be loaded,
``available()`` says why and the consumer does not ask for the shm channel.

A consumer asks for the shm channel only when told to (``connect(shm=True)``,
``CUDASHARE_SHM=1``): measured on two H100s (32 cores), a Python consumer
made as many handoffs through the shm channel as on the socket, with or without a
torch op per batch, because its bound is the interpreter, not the system
calls; and the Go producer polls a lane between messages, so each Python
consumer on the shm channel costs it about twice the CPU per batch. On a host
with few, busy cores, where every wake-up of the socket costs a context
switch, the shm channel did 1.5x the socket's handoffs (bench/RESULTS.md).

A consumer is always the dialer: it reads lane 0 and writes lane 1. The
words in the segment belong to a peer that may lie: a tail or head that
could make this side read or write outside the segment, or go backwards,
fails the connection (``malformed``), and bytes are copied out of the lane
before anything decodes them.
"""

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import socket
import stat
import struct

from . import _errors as errors, _wire as wire
from ._errors import ProtocolError

LANE_SIZE = 65536
CTL_PAGE = 4096
SEG_SIZE = CTL_PAGE + 2 * LANE_SIZE
CTL_STEP = 256
TAIL, HEAD, SLEEPING = 0, 128, 136

_SEQ_CST = 5  # __ATOMIC_SEQ_CST
_string_at = ctypes.string_at
_memmove = ctypes.memmove

_atomics = None
_reason = None


def _load():
    """Loads libatomic once; returns (load8, store8, xchg8, load4, xchg4)
    or None, with _reason saying why."""
    global _atomics, _reason
    if _atomics is not None or _reason is not None:
        return _atomics
    names = [ctypes.util.find_library("atomic"), "libatomic.so.1"]
    lib = None
    for n in names:
        if not n:
            continue
        try:
            # PyDLL: the GIL stays held. These calls take nanoseconds;
            # releasing and taking back the GIL around each would cost more
            # than the call and hand the interpreter to another thread.
            lib = ctypes.PyDLL(n)
            _reason = None
            break
        except OSError as e:
            _reason = "libatomic: %s" % e
    if lib is None:
        _reason = _reason or "libatomic.so.1 not found (Debian: libatomic1)"
        return None
    try:
        u64, u32, vp, i = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int

        def fn(name, res, *args):
            f = getattr(lib, name)
            f.restype = res
            f.argtypes = args
            return f

        _atomics = (fn("__atomic_load_8", u64, vp, i), fn("__atomic_store_8", None, vp, u64, i),
                    fn("__atomic_exchange_8", u64, vp, u64, i), fn("__atomic_load_4", u32, vp, i),
                    fn("__atomic_exchange_4", u32, vp, u32, i))
    except AttributeError as e:
        _reason = "libatomic lacks %s" % e
        return None
    return _atomics


def available():
    """Whether this process can use the shm channel; (ok, reason)."""
    return _load() is not None, _reason or ""


def _malformed(fmt, *args):
    return wire.malformed(fmt, *args)


class Segment:
    """A dialer's mapping of the segment a producer sent with its hello-ack.
    Mapped with libc's mmap, not Python's (which keeps a duplicate of the
    descriptor open as long as the mapping), and unmapped only when the
    last reference to it goes, so never under a thread that uses it."""

    def __init__(self, fd):
        """Checks fd as PROTOCOL.md 2.3 says (a regular file of exactly
        SEG_SIZE bytes, sealed against shrinking and growing: else the
        producer could shrink it under the mapping and make every access
        fault) and maps it; the caller closes fd. The seals first, the
        size after: a producer that shrank the segment after a look at its
        size, and sealed it then, would pass both; once it is sealed, the
        size read is the size mapped."""
        self.base = None
        at = _load()
        if at is None:
            raise ProtocolError(errors.INTERNAL, "the shm segment arrived, but this process has no atomics: %s" % _reason)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise _malformed("the shm segment is not sealed against shrinking and growing (F_GET_SEALS: %s)", e)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        if seals & want != want:
            raise _malformed("the shm segment is not sealed against shrinking and growing (seals %#x)", seals)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != SEG_SIZE:
            raise _malformed("the shm segment: mode %o, %d bytes, want a regular file of %d",
                             st.st_mode, st.st_size, SEG_SIZE)
        libc = _libc()
        p = libc.mmap(None, SEG_SIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if p is None or p == ctypes.c_void_p(-1).value:
            e = ctypes.get_errno()
            raise ProtocolError(errors.INTERNAL, "mmap of the shm segment: %s" % os.strerror(e))
        self.base = p
        self._at = at
        self._munmap = libc.munmap

    def lanes(self):
        """(lane 0 to read, lane 1 to write). Each keeps the segment; the
        segment keeps neither (no cycle: it goes with the last of them)."""
        return LaneIn(self, self.base, self._at), LaneOut(self, self.base, self._at)

    def close(self):
        """Unmaps the segment. The caller excludes every user of its lanes
        (each checks, under the lock that the caller holds, that it is
        still mapped); idempotent."""
        b = self.base
        if b is not None:
            self.base = None  # first: nothing checks a mapped segment that is going
            self._munmap(b, SEG_SIZE)

    __del__ = close


def _unmapped():
    return OSError(errno.EBADF, "the shm segment is unmapped: the connection is closed")


_libc_fns = None


def _libc():
    global _libc_fns
    if _libc_fns is None:
        libc = ctypes.CDLL(None, use_errno=True)
        mm = libc.mmap
        mm.restype = ctypes.c_void_p
        mm.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        mu = libc.munmap
        mu.restype = ctypes.c_int
        mu.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc_fns = libc
    return _libc_fns


class LaneIn:
    """Lane 0 as its reader sees it. Used by one thread at a time (the one
    that reads the connection)."""

    __slots__ = ("seg", "data", "pos", "_tail", "_head", "_sleeping", "_load8", "_store8", "_load4", "_xchg4")

    def __init__(self, seg, base, at):
        self.seg = seg  # keeps the mapping
        self.data = base + CTL_PAGE
        self.pos = 0
        self._tail, self._head, self._sleeping = base + TAIL, base + HEAD, base + SLEEPING
        self._load8, self._store8, _x8, self._load4, self._xchg4 = at

    def ready(self):
        if self.seg.base is None:
            raise _unmapped()
        return self._load8(self._tail, _SEQ_CST) != self.pos

    def read(self, room):
        """Copies out up to room bytes the producer has published; b"" if
        none."""
        if self.seg.base is None:
            raise _unmapped()
        avail = (self._load8(self._tail, _SEQ_CST) - self.pos) & wire.U64
        if avail > LANE_SIZE:
            raise _malformed("lane tail %d bytes ahead of what was read (lane of %d)", avail, LANE_SIZE)
        n = min(avail, room)
        if n <= 0:
            return b""
        at = self.pos % LANE_SIZE
        d = self.data
        if at + n <= LANE_SIZE:
            out = _string_at(d + at, n)
        else:
            k = LANE_SIZE - at
            out = _string_at(d + at, k) + _string_at(d, n - k)
        self.pos += n
        self._store8(self._head, self.pos & wire.U64, _SEQ_CST)
        return out

    def sleep(self):
        """Says this reader may sleep on the socket. A swap: ordered before
        the load of tail that follows (PROTOCOL.md 2.3)."""
        if self.seg.base is None:
            raise _unmapped()
        self._xchg4(self._sleeping, 1, _SEQ_CST)

    def wake(self):
        if self.seg.base is not None:
            self._xchg4(self._sleeping, 0, _SEQ_CST)


class LaneOut:
    """Lane 1 as its writer sees it; the caller holds the write lock."""

    __slots__ = ("seg", "data", "pos", "seen", "_tail", "_head", "_sleeping", "_load8", "_xchg8", "_load4", "_xchg4")

    def __init__(self, seg, base, at):
        self.seg = seg  # keeps the mapping
        self.data = base + CTL_PAGE + LANE_SIZE
        self.pos = 0
        self.seen = 0
        c = base + CTL_STEP
        self._tail, self._head, self._sleeping = c + TAIL, c + HEAD, c + SLEEPING
        self._load8, _s8, self._xchg8, self._load4, self._xchg4 = at

    def write(self, b, off=0):
        """Copies as much of b[off:] as there is room for and publishes it;
        returns how much (0: the lane is full)."""
        if self.seg.base is None:
            raise _unmapped()
        head = self._load8(self._head, _SEQ_CST)
        if ((head - self.seen) & wire.U64) > LANE_SIZE or ((self.pos - head) & wire.U64) > LANE_SIZE:
            raise _malformed("lane head moved from %d to %d, with %d written", self.seen, head, self.pos)
        self.seen = head
        n = min(LANE_SIZE - (self.pos - head), len(b) - off)
        if n <= 0:
            return 0
        at = self.pos % LANE_SIZE
        d = self.data
        if at + n <= LANE_SIZE:
            _memmove(d + at, b[off:off + n] if off or n < len(b) else b, n)
        else:
            k = LANE_SIZE - at
            _memmove(d + at, b[off:off + k], k)
            _memmove(d, b[off + k:off + n], n - k)
        self.pos += n
        # A swap, not a store: ordered before the load of sleeping in asleep().
        self._xchg8(self._tail, self.pos & wire.U64, _SEQ_CST)
        return n

    def asleep(self):
        """Whether the producer sleeps on the socket and needs the doorbell;
        true once per sleep."""
        if self.seg.base is None:
            raise _unmapped()
        return self._load4(self._sleeping, _SEQ_CST) != 0 and self._xchg4(self._sleeping, 0, _SEQ_CST) != 0



SOCK_FRAME_MAX = 4096      # only doorbells and error messages are frames on the socket
MAX_QUEUED_FDS = 8         # those of the offer being read and of the next (PROTOCOL.md 2.3)
TAKE_FDS_READS = 16        # socket reads an offer's descriptors may take (each up to a page of doorbells)
BELL = b"\0\0\0\0"          # the doorbell: a frame header of length 0
_unpack_len = struct.Struct(">I").unpack_from


class ShmReader(wire.FrameReader):
    """The reading side of a shm connection, a wire.FrameReader whose
    frames come from lane 0 (next_frame, close_fds, fds, eof as there);
    doorbells, descriptors, an error and the end come from the socket,
    which is non-blocking. It holds at most one frame and one read of the
    lane, one socket frame and MAX_QUEUED_FDS descriptors."""

    def __init__(self, sock, lane_in, leftover, frame_timeout):
        super().__init__(sock, frame_timeout)
        self.lane = lane_in
        self.sbuf = bytearray(leftover)  # socket bytes not yet taken (after the hello-ack)
        self.sock_end = False  # the socket reached its end (the lane may still hold bytes)
        self._socket_frames()

    def pull(self):
        """Copies what lane 0 holds (as much as fits) into the buffer;
        returns how many bytes."""
        if self.pos:
            del self.buf[:self.pos]
            self.pos = 0
        room = 4 + wire.FRAME_CAP + LANE_SIZE - len(self.buf)
        if room <= 0:
            return 0
        data = self.lane.read(room)
        if data:
            self.buf += data
        return len(data)

    def wait(self, timeout, poller):
        """Brings bytes from the lane, waiting up to timeout seconds: when
        it is empty, sleeps on the socket at once (PROTOCOL.md 2.3) and takes
        what that brings. Returns False once the connection has ended: the
        socket's end, with the lane read to its end.

        It does not poll the lane first, as the Go side does: a Python
        thread that polls holds the interpreter from every other thread of
        the application, and on two H100s polling gained nothing here (the
        interpreter, not the system calls, is a Python consumer's bound)."""
        if self.pull():
            return True
        if self.sock_end:
            self.eof = True
            return False
        r = self.lane
        r.sleep()
        try:
            if r.ready():
                self.pull()
                return True
            if poller.poll(int(timeout * 1000 + 0.999)):
                self.read_socket()
        finally:
            r.wake()
        if self.pull():
            return True
        if self.sock_end:
            self.eof = True
            return False
        return True

    def read_socket(self):
        """One read of the socket, without waiting: doorbells (ignored),
        descriptors (queued), an error message (raised), its end. Returns
        False if nothing was there."""
        try:
            data, anc, flags, _ = self.sock.recvmsg(4 + SOCK_FRAME_MAX, socket.CMSG_SPACE(wire.MAX_FDS * 4))
        except (BlockingIOError, InterruptedError):
            return False
        except ConnectionResetError:
            # A producer that closed with our doorbells unread: the end
            # (AF_UNIX reports it so), and the lane is still read to its end.
            self.sock_end = True
            return True
        self.fds.extend(wire.received_fds(anc, flags, len(self.fds), MAX_QUEUED_FDS))
        if not data:
            self.sock_end = True
            return True
        self.sbuf += data
        self._socket_frames()
        return True

    def _socket_frames(self):
        b = self.sbuf
        while len(b) >= 4:
            (n,) = _unpack_len(b, 0)
            if n == 0:
                del b[:4]
                continue
            if n > SOCK_FRAME_MAX:
                raise wire.malformed("a frame of %d bytes on the socket of a shm connection, where only "
                                     "doorbells, descriptors and errors go", n)
            if len(b) < 4 + n:
                return
            m = wire.decode(bytes(b[4:4 + n]))
            del b[:4 + n]
            kind = m[0]
            if kind == wire.ERROR:
                wire.need(m, 3, "error")
                raise ProtocolError(wire.uint(m[1], "error.code"), wire.text(m[2], "error.message"), remote=True)
            raise ProtocolError(errors.UNEXPECTED_MESSAGE, "message kind %r on the socket of a shm connection, "
                                "where only doorbells, descriptors and errors go" % (kind,))

    def take_fds(self, n):
        """Claims the first n queued descriptors for an offer read from the
        lane; they left on the socket before it, so the socket is read
        without waiting until they are there."""
        reads = 0
        while len(self.fds) < n and not self.sock_end and reads < TAKE_FDS_READS:
            # Bounded: a producer that sends doorbells without the
            # descriptors it declared must not hold this thread.
            reads += 1
            if not self.read_socket():
                break
        if n > len(self.fds):
            raise wire.malformed("offer declares %d descriptors, %d arrived", n, len(self.fds))
        fds, self.fds = self.fds[:n], self.fds[n:]
        return fds

    def check_partial(self, now):
        """Raises a timeout error if half a frame has waited too long.
        Descriptors may wait here for their offer: they come first."""
        self.check_frame_age(now)
