"""Framing and message validation of PROTOCOL.md sections 2, 4 and 5.

Everything a producer sends is checked here before the consumer acts on
it, with bounds that hold whatever the producer does: a frame longer than
the cap is refused from its 4-byte prefix, before anything is allocated;
the receive buffer never holds more than one frame and one read; at most 4
descriptors wait for an offer, and every descriptor that is not handed on
is closed.
"""

import array
import os
import socket
import struct
import time

import msgpack

from . import _errors as errors
from ._errors import ProtocolError

VERSION = 1
ROLE_PRODUCER = 1
ROLE_CONSUMER = 2

HELLO, HELLO_ACK, OFFER, RELEASE, RETIRE, CLOSED, CREDIT, GOODBYE, ERROR = range(1, 10)

# What a goodbye's optional third element says comes next (PROTOCOL.md §4,
# goodbye); an unknown code is GOODBYE_DONE.
GOODBYE_DONE, GOODBYE_RESTARTING = 0, 1

CAP_VMM = 1
CAP_RELEASE_EVENTS = 2
CAP_FABRIC = 4
CAP_SHM = 8

HANDLE_IPC = 0
HANDLE_VMM = 1
HANDLE_FABRIC = 2

FRAME_CAP = 65536          # this receiver's cap (>= 8192)
MAX_FDS = 4
MAX_TEXT = 1024
MAX_META = 4096
MAX_DEPTH = 16
MAX_RELEASE_SEQS = 512
MAX_DEVICES = 64
MAX_CREDITS = 1048576
READ_CHUNK = 65536
U64 = (1 << 64) - 1


_unpack_len = struct.Struct(">I").unpack_from


def malformed(fmt, *args):
    return ProtocolError(errors.MALFORMED, fmt % args if args else fmt)


def pack(msg):
    """Frames one message: a big-endian uint32 length, then the msgpack body."""
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _no_ext(code, data):
    raise malformed("ext type %d in a message", code)


def decode(body):
    """Decodes one frame body into a list, checking the free-form rules
    (section 2.1): one value and nothing after it, no ext types, map keys
    str only, nesting at most 16 (the Unpacker bounds every declared
    length by the body's size)."""
    try:
        msg = _unpackb(body, raw=False, ext_hook=_no_ext, strict_map_key=False, use_list=True)
    except ProtocolError:
        raise
    except msgpack.ExtraData:
        raise malformed("bytes after the message's value")
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise malformed("not one msgpack value: %s", e)
    if type(msg) is not list or not msg:
        raise malformed("a message must be a non-empty array")
    # Only containers can break the nesting and key rules: a message of
    # scalars (an offer's fields but its meta, a retire) costs one pass.
    for x in msg:
        t = type(x)
        if t is list or t is dict:
            _check_free(x, 1)
    return msg


_unpackb = msgpack.unpackb


def _check_free(v, depth):
    # type(), not isinstance: msgpack builds exactly list, dict and str.
    if depth > MAX_DEPTH:
        raise malformed("values nest deeper than %d", MAX_DEPTH)
    if type(v) is list:
        for x in v:
            t = type(x)
            if t is list or t is dict:
                _check_free(x, depth + 1)
    else:
        for k, x in v.items():
            if type(k) is not str:
                raise malformed("map key %r, want str", k)
            t = type(x)
            if t is list or t is dict:
                _check_free(x, depth + 1)


def uint(v, field):
    """A protocol integer field: non-negative, at most 64 bits, any encoding."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise malformed("%s: %r is not an integer", field, v)
    if v < 0:
        raise malformed("%s: negative integer", field)
    return v


def binn(v, n, field):
    if not isinstance(v, bytes) or len(v) != n:
        raise malformed("%s: want bin(%d), got %r", field, n, type(v).__name__)
    return v


def text(v, field):
    if not isinstance(v, str):
        raise malformed("%s: want str", field)
    if len(v.encode()) > MAX_TEXT:
        raise malformed("%s: longer than %d bytes", field, MAX_TEXT)
    return v


def need(msg, n, name):
    if len(msg) < n:
        raise malformed("%s: %d elements, want at least %d", name, len(msg), n)


def _u64(v, field):
    # uint() and the 64-bit bound in one test on the common path.
    if type(v) is int and 0 <= v <= U64:
        return v
    uint(v, field)
    raise malformed("%s: more than 64 bits", field)


OFFER_FIELDS = ("seq", "alloc_id", "generation", "handle", "alloc_size", "offset", "size", "device_uuid",
                "event_handle", "meta", "nfds", "handle_kind", "received_ns")


def parse_offer(cls, m, body_len=None):
    """m: a decoded offer (section 4). Returns an instance of cls, made
    without calling its __init__, with OFFER_FIELDS set: the consumer's
    Lease has those slots, so an offer is parsed straight into the lease
    the application gets. body_len: the frame body's size, when known: a
    body of at most MAX_META bytes cannot hold a larger meta, so the meta
    is measured only in larger frames."""
    if len(m) < 12:
        need(m, 12, "offer")
    o = cls.__new__(cls)
    o.seq = _u64(m[1], "offer.seq")
    o.alloc_id = _u64(m[2], "offer.alloc_id")
    o.generation = _u64(m[3], "offer.generation")
    h = m[4]
    o.handle = h if type(h) is bytes and len(h) == 64 else binn(h, 64, "offer.handle")
    o.alloc_size = _u64(m[5], "offer.alloc_size")
    o.offset = _u64(m[6], "offer.offset")
    o.size = _u64(m[7], "offer.size")
    if o.offset + o.size > o.alloc_size:
        raise malformed("offer: offset %d + size %d beyond alloc_size %d", o.offset, o.size, o.alloc_size)
    u = m[8]
    o.device_uuid = u if type(u) is bytes and len(u) == 16 else binn(u, 16, "offer.device_uuid")
    e = m[9]
    o.event_handle = None if e is None else (e if type(e) is bytes and len(e) == 64 else binn(e, 64, "offer.event_handle"))
    o.meta = m[10]
    if (body_len is None or body_len > MAX_META) and len(msgpack.packb(o.meta, use_bin_type=True)) > MAX_META:
        raise malformed("offer.meta: more than %d bytes", MAX_META)
    n = m[11]
    if not (type(n) is int and 0 <= n <= MAX_FDS):
        if uint(n, "offer.nfds") > MAX_FDS:
            raise malformed("offer.nfds: %d, limit %d", n, MAX_FDS)
    o.nfds = n
    if len(m) > 12:
        k = m[12]
        o.handle_kind = k if type(k) is int and 0 <= k <= 0xff else uint(k, "offer.handle_kind")
    else:
        o.handle_kind = HANDLE_IPC
    o.received_ns = _monotonic_ns()
    return o


_monotonic_ns = time.monotonic_ns


def received_fds(anc, flags, pending, limit, accept_fds=True):
    """The descriptors that came with one recvmsg (its ancillary data and
    flags), with pending already queued and at most limit in all. Anything
    wrong (another kind of control message, a truncated one, descriptors
    not advertised for, too many) closes every one of them and raises."""
    got = []
    bad = None
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
            got.extend(a)
        else:
            bad = malformed("control message (%d, %d) that is not SCM_RIGHTS", level, kind)
    if flags & socket.MSG_CTRUNC:
        bad = malformed("more than %d descriptors with one message", MAX_FDS)
    elif got and not accept_fds:
        bad = ProtocolError(errors.UNEXPECTED_MESSAGE, "%d descriptors, and this consumer did not advertise fds" % len(got))
    elif pending + len(got) > limit:
        bad = malformed("%d descriptors pending, limit %d", pending + len(got), limit)
    if bad is not None:
        close_fds(got)
        raise bad
    return got


def close_fds(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class FrameReader:
    """Reads frames and the descriptors that come with them from a socket.

    It holds at most one frame and one read (FRAME_CAP + 4 + READ_CHUNK
    bytes) and at most MAX_FDS descriptors, whatever the peer sends.
    ``frame_timeout`` bounds how long half a frame may wait (section 7).
    """

    def __init__(self, sock, frame_timeout=10.0):
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0   # where the unread part of buf starts
        self.fds = []  # received, not yet claimed by an offer
        self.frame_timeout = frame_timeout
        self.partial_since = None
        self.eof = False

    def close_fds(self):
        fds, self.fds = self.fds, []
        close_fds(fds)

    def take_fds(self, n):
        """Claims the first n queued descriptors for an offer (section 5)."""
        if n > len(self.fds):
            raise malformed("offer declares %d descriptors, %d arrived", n, len(self.fds))
        fds, self.fds = self.fds[:n], self.fds[n:]
        return fds

    def next_frame(self):
        """Returns the next whole frame body in the buffer, or None."""
        buf, pos = self.buf, self.pos
        have = len(buf) - pos
        if have < 4:
            return None
        (n,) = _unpack_len(buf, pos)
        if n == 0:
            raise malformed("frame of length 0")
        if n > FRAME_CAP:
            raise ProtocolError(errors.FRAME_TOO_LARGE, "frame of %d bytes, cap %d" % (n, FRAME_CAP))
        if have < 4 + n:
            return None
        self.partial_since = None
        end = pos + 4 + n
        body = buf[pos + 4:end]
        if end == len(buf):
            buf.clear()
            self.pos = 0
        else:
            self.pos = end
        return body

    def fill(self, accept_fds):
        """One recvmsg: appends what arrived. Returns False at end of stream."""
        if self.pos:
            del self.buf[:self.pos]  # frames read already
            self.pos = 0
        want = min(READ_CHUNK, 4 + FRAME_CAP - len(self.buf)) if len(self.buf) < 4 + FRAME_CAP else 1
        data, anc, flags, _ = self.sock.recvmsg(max(want, 1), socket.CMSG_SPACE(MAX_FDS * 4))
        self.fds.extend(received_fds(anc, flags, len(self.fds), MAX_FDS, accept_fds))
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def check_partial(self, now):
        """Raises a timeout error if half a frame has waited too long;
        checks descriptors that no frame can claim (section 5)."""
        if len(self.buf) == self.pos and self.fds:
            raise malformed("%d descriptors arrived with no message to claim them", len(self.fds))
        self.check_frame_age(now)

    def check_frame_age(self, now):
        """Raises a timeout error if half a frame has waited too long."""
        if len(self.buf) == self.pos:
            self.partial_since = None
            return
        if self.partial_since is None:
            self.partial_since = now
        elif now - self.partial_since > self.frame_timeout:
            raise ProtocolError(errors.TIMEOUT, "half a frame held for more than %.0fs" % self.frame_timeout)
