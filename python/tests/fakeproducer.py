"""A producer written in Python for the tests: it listens, answers the
consumer's hello, and then does what a test tells it, including what no
honest producer would (huge frames, bad msgpack, descriptor floods).

It also offers simulator-layout VMM allocations (a memfd with the
4096-byte header of driver/internal/sim/doc.go), so the data path runs
before the Go producer offers them.
"""

import array
import fcntl
import mmap
import os
import select
import socket
import struct
import tempfile
import threading
import time

import msgpack

HEADER = 4096
CAP_SHM = 8
LANE, CTL, SEG = 65536, 4096, 4096 + 2 * 65536


def frame(msg):
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def offer_msg(seq, alloc_id=1, size=4096, alloc_size=1 << 21, offset=0, kind=None, nfds=0, meta=None,
              handle=None, event=None):
    """An offer message (PROTOCOL.md section 4) of a simulator-layout allocation."""
    msg = [3, seq, alloc_id, 1, handle or alloc_id.to_bytes(8, "little") + bytes(56), alloc_size, offset, size,
           b"\xaa" * 16, event, meta, nfds]
    if kind is not None:
        msg.append(kind)
    return msg


SIM_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sim_memfd(size, fill, seals=SIM_SEALS, length=None):
    """A memfd laid out as the simulator's VMM allocation, filled with fill
    and sealed as the simulator seals it (PROTOCOL.md §4.1.1); or a bad
    one: other seals, or length bytes in all instead of the header and
    size."""
    fd = os.memfd_create("cudashare-sim-vmm-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, HEADER + size if length is None else length)
    hdr = b"CSIMVMM1" + struct.pack("<IIQQ", 1, 0, size, 1)
    os.pwrite(fd, hdr, 0)
    os.pwrite(fd, bytes([fill]) * min(size, max(0, (length or HEADER + size) - HEADER)), HEADER)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def shm_memfd(size=SEG, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW):
    """A shm segment (PROTOCOL.md 2.3), or a bad one."""
    fd = os.memfd_create("cudashare-shm-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


class FakeProducer:
    """caps with CAP_SHM: if the consumer asks for the shm channel too, the
    hello-ack carries a segment (shm_memfd(**seg)) and every later frame
    goes through it (plain stores: after each write the fake rings the
    doorbell, so the consumer's sleeping word need not be read)."""

    def __init__(self, caps=0, seg=None):
        self.seg_args = seg or {}
        self.mem = None
        self.tail0 = 0   # bytes written into lane 0
        self.head1 = 0   # bytes read from lane 1
        self.sock_end = False
        self.dir = tempfile.mkdtemp(prefix="cudashare-test-")
        os.chmod(self.dir, 0o700)
        self.path = os.path.join(self.dir, "s")
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lsock.bind(self.path)
        self.lsock.listen(1)
        self.caps = caps
        self.conn = None
        self.hello = None
        self.buf = b""

    def accept(self, timeout=5):
        self.lsock.settimeout(timeout)
        self.conn, _ = self.lsock.accept()
        self.conn.settimeout(timeout)
        self.hello = self.recv()
        ack = [2, 1, 1, os.getpid(), os.urandom(16), [b"\xaa" * 16], self.caps, 0]
        if self.caps & CAP_SHM and self.hello[6] & CAP_SHM:
            fd = shm_memfd(**self.seg_args)
            try:
                self.raw(frame(ack), [fd])
                if os.fstat(fd).st_size == SEG:
                    self.mem = mmap.mmap(fd, SEG)
            finally:
                os.close(fd)
        else:
            self.send(ack)
        return self.hello

    # --- the shm channel: lane 0 this fake writes, lane 1 it reads ---

    def word(self, off, v=None):
        if v is None:
            return struct.unpack_from("<Q", self.mem, off)[0]
        struct.pack_into("<Q", self.mem, off, v)

    def lane_write(self, data, bell=True):
        for i, b in enumerate(data):
            self.mem[CTL + (self.tail0 + i) % LANE] = b
        self.tail0 += len(data)
        self.word(0, self.tail0)
        if bell:
            self.conn.sendall(b"\0\0\0\0")

    def bell(self, fds=()):
        self.raw(b"\0\0\0\0", fds)

    def lane_read(self):
        """Whatever lane 1 holds, marked read; b"" if nothing."""
        tail = self.word(256)
        data = bytes(self.mem[CTL + LANE + (self.head1 + i) % LANE] for i in range(tail - self.head1))
        self.head1 = tail
        self.word(256 + 128, self.head1)
        return data

    def serve(self):
        """Accepts in the background (connect blocks on the handshake)."""
        t = threading.Thread(target=self.accept, daemon=True)
        t.start()
        return t

    def send(self, msg, fds=()):
        if self.mem is not None:
            if fds:
                self.bell(fds)  # descriptors go first, on a doorbell
            self.lane_write(frame(msg))
        else:
            self.raw(frame(msg), fds)

    def raw(self, data, fds=()):
        if fds:
            self.conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            self.conn.sendall(data)

    def recv(self, timeout=5):
        """The next message, or None at end of stream. On a shm
        connection: from lane 1, or an error message from the socket."""
        if self.mem is not None:
            return self._recv_shm(timeout)
        while True:
            if len(self.buf) >= 4:
                (n,) = struct.unpack(">I", self.buf[:4])
                if len(self.buf) >= 4 + n:
                    body, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
                    return msgpack.unpackb(body, raw=False)
            try:
                chunk = self.conn.recv(65536)
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            self.buf += chunk

    def _recv_shm(self, timeout):
        deadline = time.monotonic() + timeout
        sbuf = b""
        while True:
            self.buf += self.lane_read()
            if len(self.buf) >= 4:
                (n,) = struct.unpack(">I", self.buf[:4])
                if len(self.buf) >= 4 + n:
                    body, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
                    return msgpack.unpackb(body, raw=False)
            if self.sock_end:
                return None
            if select.select([self.conn], [], [], 0.005)[0]:
                try:
                    chunk = self.conn.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    self.sock_end = True  # the lane is read once more, to its end
                    continue
                sbuf += chunk
                while len(sbuf) >= 4:
                    (n,) = struct.unpack(">I", sbuf[:4])
                    if n == 0:
                        sbuf = sbuf[4:]
                        continue
                    if len(sbuf) < 4 + n:
                        break
                    return msgpack.unpackb(sbuf[4:4 + n], raw=False)  # an error, on the socket
            if time.monotonic() > deadline:
                raise TimeoutError("the consumer sent nothing for %.0fs" % timeout)

    def recv_until(self, kind):
        """Messages until one of kind (returned) or end of stream (None)."""
        while True:
            m = self.recv()
            if m is None or m[0] == kind:
                return m

    def offer(self, seq, alloc_id=1, size=4096, alloc_size=1 << 21, offset=0, kind=None, nfds=0, meta=None,
              handle=None, event=None, fds=()):
        self.send(offer_msg(seq, alloc_id, size, alloc_size, offset, kind, nfds, meta, handle, event), fds)

    def close(self):
        if self.mem is not None:
            self.mem.close()
            self.mem = None
        for s in (self.conn, self.lsock):
            if s is not None:
                s.close()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass
