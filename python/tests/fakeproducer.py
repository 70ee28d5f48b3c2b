"""A producer written in Python for the tests: it listens, answers the
consumer's hello, and then does what a test tells it, including what no
honest producer would (huge frames, bad msgpack, descriptor floods).

It also lends simulator-layout VMM allocations (a memfd with the
4096-byte header of driver/internal/sim/doc.go), so the data path runs
before the Go producer lends them.
"""

import array
import os
import socket
import struct
import tempfile
import threading

import msgpack

HEADER = 4096


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


def sim_memfd(size, fill):
    """A memfd laid out as the simulator's VMM allocation, filled with fill."""
    fd = os.memfd_create("cudashare-sim-vmm-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, HEADER + size)
    hdr = b"CSIMVMM1" + struct.pack("<IIQQ", 1, 0, size, 1)
    os.pwrite(fd, hdr, 0)
    os.pwrite(fd, bytes([fill]) * size, HEADER)
    return fd


class FakeProducer:
    def __init__(self, caps=0):
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
        self.send([2, 1, 1, os.getpid(), os.urandom(16), [b"\xaa" * 16], self.caps, 0])
        return self.hello

    def serve(self):
        """Accepts in the background (connect blocks on the handshake)."""
        t = threading.Thread(target=self.accept, daemon=True)
        t.start()
        return t

    def send(self, msg, fds=()):
        self.raw(frame(msg), fds)

    def raw(self, data, fds=()):
        if fds:
            self.conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            self.conn.sendall(data)

    def recv(self):
        """The next message, or None at end of stream."""
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
        for s in (self.conn, self.lsock):
            if s is not None:
                s.close()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass
