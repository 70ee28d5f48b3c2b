"""A cudashare consumer written from PROTOCOL.md alone, with the msgpack
package. transport's TestPythonPeer runs it against the Go producer:

    python3 pyclient.py SOCKET_PATH

It says hello as a consumer that accepts descriptors, releases every offer,
answers every retire with closed, and exits 0 after the producer's goodbye
and end of stream. It prints what it received, one line a message.
"""

import array
import os
import socket
import struct
import sys

import msgpack

FRAME_CAP = 65536
MAX_FDS = 4


class Conn:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.buf = b""
        self.fds = []  # received, not yet claimed by an offer

    def send(self, msg):
        body = msgpack.packb(msg, use_bin_type=True)
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def fill(self):
        data, ancdata, flags, _ = self.sock.recvmsg(
            65536, socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, payload in ancdata:
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            if level != socket.SOL_SOCKET or kind != socket.SCM_RIGHTS:
                for fd in fds:
                    os.close(fd)
                raise ValueError("unexpected control message")
            self.fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise ValueError("descriptors truncated")
        if not data:
            raise EOFError("end of stream")
        self.buf += data

    def recv(self):
        while len(self.buf) < 4:
            self.fill()
        (n,) = struct.unpack(">I", self.buf[:4])
        if not 1 <= n <= FRAME_CAP:
            raise ValueError("frame of %d bytes" % n)
        while len(self.buf) < 4 + n:
            self.fill()
        body, self.buf = self.buf[4 : 4 + n], self.buf[4 + n :]
        return msgpack.unpackb(body, raw=False)


def main(path):
    c = Conn(path)
    me = bytes(range(16))
    c.send([1, 1, 2, os.getpid(), os.urandom(16), [me], 1, 4])  # hello
    ack = c.recv()
    assert ack[:3] == [2, 1, 1], ack  # hello-ack, version 1, producer
    assert all(isinstance(d, bytes) and len(d) == 16 for d in ack[5]), ack
    print("hello-ack devices=%s" % ",".join(d.hex() for d in ack[5]))
    while True:
        m = c.recv()
        kind = m[0]
        if kind == 3:  # offer
            (seq, alloc_id, gen, handle, alloc_size, offset, size, device,
             event, meta, nfds) = m[1:12]
            assert isinstance(handle, bytes) and len(handle) == 64
            assert isinstance(device, bytes) and len(device) == 16
            assert event is None or (isinstance(event, bytes) and len(event) == 64)
            assert offset + size <= alloc_size
            fds, c.fds = c.fds[:nfds], c.fds[nfds:]
            assert len(fds) == nfds
            texts = []
            for fd in fds:
                texts.append(os.pread(fd, 100, 0).decode())
                os.close(fd)
            print("offer seq=%d alloc=%d size=%d handle0=%d event=%s meta=%r fds=%r"
                  % (seq, alloc_id, size, handle[0], event is not None, meta, texts))
            c.send([4, [seq]])  # release
        elif kind == 5:  # retire
            print("retire alloc=%d" % m[1])
            c.send([6, m[1]])  # closed
        elif kind == 8:  # goodbye
            print("goodbye reason=%r" % m[1])
            try:
                c.recv()
            except EOFError:
                print("end of stream")
                return 0
            raise ValueError("message after goodbye")
        else:
            raise ValueError("unexpected message %r" % (m,))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
