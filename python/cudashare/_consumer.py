"""The consumer side of PROTOCOL.md: connect, handshake, offers, releases,
retire/closed, goodbye.

Design: one background reader thread per connection. It reads every
message as it arrives, so that ``retire`` is answered and the producer's
errors are seen even while the application is busy with a batch and calls
nothing; offers become Lease objects in a queue that ``next()`` and
iteration take from. The queue cannot grow past the credits this consumer
granted: an offer beyond them is a ``credit`` error. Releases, ``closed``
and ``goodbye`` are written by whatever thread causes them, under one
write lock, with a write timeout, so a producer that stops reading cannot
hang the application for longer than that. Every blocking call takes a
timeout.

This file is the connection and the application's side (connect, next,
run, close); the reading side is _reader.py and the releases _releases.py,
both mixins of Consumer.
"""

import atexit
import collections
import errno
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

from . import _backends as backends, _shm as shm, _wire as wire, _errors as errors
from ._errors import Closed, CudashareError, ProducerGone, ProducerRestarting, ProtocolError, Timeout
from ._reader import BG_POLL, TICK, Reader
from ._releases import REAP_EVERY, Releases

if TYPE_CHECKING:
    from ._lease import Lease
    from ._reconnect import ReconnectPolicy

log = logging.getLogger("cudashare")

_open = weakref.WeakSet()


def _close_all(reason):
    for c in list(_open):
        try:
            c.close(reason=reason)
        except Exception:
            pass


atexit.register(_close_all, "interpreter exit")


# _STOP_WAIT bounds how long an interrupted run waits for its workers to
# finish the lease in hand.
_STOP_WAIT = 10.0


def default_socket_path() -> str:
    """The socket a producer listens at unless told otherwise, as Go's
    share.DefaultSocketPath: $XDG_RUNTIME_DIR/cudashare/cudashare.sock
    where XDG_RUNTIME_DIR is an absolute path, else
    $TMPDIR/cudashare-$UID/cudashare.sock (TMPDIR unset: /tmp), as Go's
    os.TempDir."""
    run = os.environ.get("XDG_RUNTIME_DIR", "")
    if run and os.path.isabs(run):
        return os.path.join(run, "cudashare", "cudashare.sock")
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", "cudashare-%d" % os.getuid(), "cudashare.sock")


def connect(path: "Optional[str]" = None, *, device: int = 0, credits: int = 8, backend: str = "auto",
            timeout: float = 5.0, write_timeout: float = 10.0, frame_timeout: float = 10.0,
            handle_sigterm: bool = False, wait: float = 0.0, shm: "Optional[bool]" = None,
            allowed_uids: "Optional[Iterable[int]]" = None,
            reconnect: "Union[None, float, ReconnectPolicy]" = None) -> "Consumer":
    """Connects to the producer listening at path and returns a Consumer.

    path: the producer's socket; None: default_socket_path(), the Go
    producer's default. Every other option is a keyword.

    device: the GPU (this process's ordinal) to map buffers on. credits: the
    most leases held at once (queued or in use). backend: "auto", "cuda" or
    "sim" (CUDASHARE_DRIVER overrides it, as for the Go binaries).
    timeout bounds the connect and handshake; wait retries a socket that is
    not there yet for that long. handle_sigterm: install a SIGTERM handler
    that says goodbye (closes every consumer) before the previous handler
    runs or the process exits 143; without it, only close(), the context
    manager and interpreter exit say goodbye. shm: ask the producer for the
    shm channel (PROTOCOL.md 2.3: no system call per message while
    both sides are busy) where this process can use them; None: only if
    CUDASHARE_SHM=1 (cudashare/_shm.py says why they are not the default).
    ``stats()["shm"]`` says whether the connection has them,
    ``shm_reason`` why not. allowed_uids: the users whose listener this
    consumer accepts (PROTOCOL.md section 1; None or empty: this process's
    effective uid only): a listener of another user, who could read or
    write what it offers, is told so (peer_refused) and ProtocolError is
    raised.

    reconnect: keep going through a producer's restart, as the Go
    importer's ImporterConfig.Reconnect: seconds (the deadline; 0: none) or
    a ReconnectPolicy. When the producer vanishes, or says goodbye because
    it restarts, the consumer connects again to the producer that takes its
    place at path, and next() and iteration go on with its leases; one
    that does not come back within the deadline ends them with
    ReconnectDeadline (a ProducerGone). It also waits that long for a first
    producer. Leases of the lost producer stay valid until released where
    its memory lives on (vmm: this process's own mapping keeps it);
    legacy IPC ones raise ProducerGone. None (the default): the consumer
    ends with the producer (ProducerRestarting at a restart).
    """
    if path is None:
        path = default_socket_path()
    if reconnect is not None:
        from ._reconnect import Reconnecting, ReconnectPolicy
        policy = reconnect if isinstance(reconnect, ReconnectPolicy) else ReconnectPolicy(deadline=reconnect)
        first_wait = max(wait, policy.deadline or 365 * 86400.0)

        def dial(w):
            return connect(path, device=device, credits=credits, backend=backend, timeout=timeout,
                           write_timeout=write_timeout, frame_timeout=frame_timeout, wait=w, shm=shm,
                           allowed_uids=allowed_uids)
        c = Reconnecting(dial(first_wait), dial, policy, path)
        if handle_sigterm:
            install_sigterm_handler()
        return c
    if shm is None:
        shm = os.environ.get("CUDASHARE_SHM", "") == "1"
    path = os.fspath(path)
    if not 1 <= credits <= wire.MAX_CREDITS:
        raise ValueError("credits must be 1 to %d" % wire.MAX_CREDITS)
    deadline = time.monotonic() + max(timeout, wait)
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() + 0.02 > deadline or wait <= 0:
                raise
            time.sleep(0.02)
        except socket.timeout:
            sock.close()
            raise Timeout("connect to %s: no answer within %.1fs" % (path, timeout))
        except BaseException:
            sock.close()
            raise
    try:
        _check_listener(sock, path, allowed_uids)
    except BaseException:
        sock.close()
        raise
    c = Consumer(sock, path, device, credits, write_timeout, frame_timeout, shm)
    try:
        c._handshake(timeout, backend)
    except BaseException:
        c._teardown()
        raise
    if handle_sigterm:
        install_sigterm_handler()
    return c


def _check_listener(sock, path, allowed_uids):
    """PROTOCOL.md section 1: the listener's SO_PEERCRED uid must be an
    allowed one; a refused listener gets one peer_refused error, nothing
    else."""
    pid, uid, _gid = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    allowed = tuple(allowed_uids or ()) or (os.geteuid(),)  # none named: this user, as the Go transport
    if uid in allowed:
        return
    text = "uid %d is not allowed by dialer of %s" % (uid, path)
    log.warning("cudashare: refused the listener at %s: pid %d uid %d (allowed uids: %s)", path, pid, uid,
                ", ".join(map(str, allowed)))
    try:
        sock.settimeout(0.1)
        sock.sendall(wire.pack([wire.ERROR, errors.PEER_REFUSED, text]))
    except OSError:
        pass
    raise ProtocolError(errors.PEER_REFUSED, "the process listening at %s runs as uid %d, which this consumer "
                        "(uid %d) does not accept (allowed: %s): cudashare only connects processes of the same "
                        "user by default" % (path, uid, os.geteuid(), ", ".join(map(str, allowed))))


def install_sigterm_handler() -> None:
    """On SIGTERM, close every open consumer (goodbye), then run the previous
    handler, or exit with status 143. Call it from the main thread."""
    prev = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        _close_all("SIGTERM")
        if callable(prev):
            prev(signum, frame)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


class Consumer(Reader, Releases):
    """A connection to one producer. Use connect() to make one."""

    def __init__(self, sock, path, device, credits, write_timeout, frame_timeout, want_shm=False):
        self.path = path
        self.device = device
        self.credits = credits
        self._sock = sock
        self._rd = wire.FrameReader(sock, frame_timeout)
        self._write_timeout = write_timeout
        self._lock = threading.RLock()
        self._wlock = threading.RLock()
        self._queue = collections.deque()
        # Waiting in next(): a waiter counts itself in _waiters (under
        # _lock, after finding the queue empty) and blocks on _sig, a plain
        # lock that whoever queues a lease or ends the connection releases
        # while anyone waits. No Condition: no lock allocated per wait.
        self._sig = threading.Lock()
        self._sig.acquire()
        self._waiters = 0
        self._outstanding = {}   # seq -> weak reference to its Lease (to void them at close)
        self._allocs = {}        # alloc_id -> _Alloc
        # Releases not yet written (PROTOCOL.md §4 release; §6: an offer is
        # outstanding until its release is sent). They leave together, as
        # the Go importer's do: when a quarter of the window is pending,
        # when a next() is about to wait or waits, or after RELEASE_DELAY,
        # whichever comes first; closed, goodbye and close() push them first.
        self._pend = []          # host-ordered seqs
        self._pend_s = {}        # stream -> seqs released after its event's latest record
        self._npend = 0
        self._pend_t = 0.0
        self._push_at = max(1, min(wire.MAX_RELEASE_SEQS, credits // 4))
        # Whoever holds _rtok reads the socket: the thread waiting in
        # next() when there is one, else the background reader.
        self._rtok = threading.Lock()
        self._rtok_owner = None  # the thread that holds _rtok (_take_rtok)
        self._user_t = 0.0       # when a next() last returned or waited
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self._events = {}        # producer's event handle bytes -> opened event
        self._rel_events = {}    # stream -> (event, handle bytes)
        self._window = credits
        self._end = None         # the exception that ended the connection
        self._bye_received = False
        self._bye_code = wire.GOODBYE_DONE
        self._held_at_loss = 0   # leases held when its producer was lost (_reconnect.py)
        self._bye_sent = False
        self._eof = threading.Event()
        self._closed = False
        self._stop = False
        self._backend = None
        self._on_host = True         # the backend's, for leases (_lease.py's interface)
        self._dl_device = (1, 0)
        self._dropped_cb = self._dropped  # LeaseRef's callback, one bound method for every lease
        self._reader = None
        self.producer = None     # the hello-ack: dict of pid, devices, caps
        self._stats = collections.Counter()
        self._n_offers = self._n_handoffs = self._n_releases = self._n_bytes = 0
        self._n_msgs = 0
        self._n_ordered = 0
        self._n_views = 0        # Lease.array's cached views, over every allocation
        self._wait_s = 0.0       # seconds next() waited for an offer (_observed)
        self._reap_t = 0.0       # the last look for leases lost with their views (Releases._reap_orphans)
        # The shm channel (_shm.py), once the handshake agreed on
        # them: frames go through _out, and the socket only carries
        # doorbells (_bell_left: bytes of one not yet written), errors and
        # the end.
        self._want_shm = want_shm
        self.shm_reason = ""
        self._out = None
        self._seg = None
        self._bell_left = 0
        self._writing = False    # a lane write is under way (under _wlock)
        self._deferred = []      # frames of a write re-entered meanwhile

    # --- setup ---

    def _send(self, msg):
        """Writes one message; raises if the write fails or times out.

        Every writer holds _lock before it takes _wlock. A lane write is a
        Python loop, in which the garbage collector may run a leaked lease's
        finalizer, which takes _lock to release the lease: holding _wlock
        without _lock there could deadlock with a thread that holds _lock and
        waits for _wlock."""
        frame = wire.pack(msg)
        try:
            with self._lock, self._wlock:
                self._write(frame)
        except ProtocolError as e:
            raise self._protocol_fail(e)  # a producer that broke lane 1's head (_shm.py)
        except OSError as e:
            # After the handshake a failed write ends the connection: part of
            # the frame may have gone, and nothing after it can be read. A
            # producer that closed after saying why is left to the reader,
            # which reads the why (as _send_quiet_frames does).
            if (self._reader is not None and not (self._bye_received or self._bye_sent)
                    and not self._peer_closed_with_more(e)):
                self._finish(ProducerGone("write to %s failed: %s" % (self.path, e)))
            raise

    def _write(self, frames):
        """Writes whole frames, into the lane or on the socket; the caller
        holds _wlock. Raises OSError if the write fails or times out."""
        out = self._out
        if out is None:
            self._sock.sendall(frames)
            return
        if self._sock.fileno() < 0:
            raise BrokenPipeError(errno.EPIPE, "the connection is closed")
        if self._writing:
            # Re-entered in this thread (the only way in while _wlock is
            # held): a leaked lease's finalizer, run by the garbage
            # collector in the middle of a write, releasing it. Its frames
            # follow the outer write's, never inside one.
            self._deferred.append(frames)
            return
        self._writing = True
        try:
            self._lane_write(out, frames)
            while self._deferred:
                self._lane_write(out, self._deferred.pop(0))
        finally:
            self._writing = False
            self._deferred.clear()

    def _lane_write(self, out, frames):
        """Writes frames into lane 1, waiting while it is full: the whole
        write within the write timeout, as sendall on the socket (a
        producer that reads a byte now and then cannot stretch it)."""
        off, n, start, pause = 0, len(frames), None, 0.0
        while off < n:
            k = out.write(frames, off)
            if k:
                off += k
                pause = 0.0
                if out.asleep():
                    self._bell()
                continue
            # Full: the producer is behind, or stopped.
            if self._sock_hup():
                raise BrokenPipeError(errno.EPIPE, "the producer closed the connection and read nothing of a full lane")
            now = time.monotonic()
            if start is None:
                start = now
            elif now - start >= self._write_timeout:
                why = "the producer made too little room in a full lane within %.3gs" % self._write_timeout
                try:
                    self._send_socket(wire.pack([wire.ERROR, errors.TIMEOUT, why]), 0.1)
                except OSError:
                    pass
                raise TimeoutError(errno.ETIMEDOUT, why)
            pause = min(max(2 * pause, 10e-6), 1e-3)
            time.sleep(pause)

    def _bell(self):
        """Writes the doorbell on the socket without waiting: a socket too
        full to take it has bytes to wake the producer already. A doorbell
        cut short is finished before anything else goes on the socket."""
        left = self._bell_left or 4
        try:
            k = self._sock.send(shm.BELL[4 - left:])
        except (BlockingIOError, InterruptedError):
            k = 0
        if self._bell_left or k:
            self._bell_left = left - k

    def _send_socket(self, frame, timeout):
        """Writes a frame on the non-blocking socket of a shm connection
        (an error message), after any doorbell cut short, waiting up to
        timeout for room."""
        b = memoryview(shm.BELL[4 - self._bell_left:] + frame if self._bell_left else frame)
        self._bell_left = 0
        deadline = time.monotonic() + timeout
        fd = self._sock.fileno()
        if fd < 0:
            raise BrokenPipeError(errno.EPIPE, "the connection is closed")
        p = select.poll()
        p.register(fd, select.POLLOUT)
        while b:
            try:
                b = b[self._sock.send(b):]
                continue
            except (BlockingIOError, InterruptedError):
                pass
            left = deadline - time.monotonic()
            if left <= 0 or not p.poll(int(left * 1000 + 0.999)):
                raise TimeoutError(errno.ETIMEDOUT, "the producer's socket stayed full")

    def _sock_hup(self):
        fd = self._sock.fileno()
        if fd < 0:
            return True  # closed under us (close() in another thread)
        p = select.poll()
        p.register(fd, select.POLLOUT)
        try:
            r = p.poll(0)
        except OSError:
            return True
        return bool(r) and bool(r[0][1] & (select.POLLHUP | select.POLLERR))

    def _unmap_shm(self):
        """Unmaps the shm segment (PROTOCOL.md 2.3: a side unmaps it when it
        closes the connection). Lane 0 is touched only by the holder of
        _rtok and lane 1 only under _wlock, so with both held nothing is
        using it; each lane checks, under its lock, that the segment is
        still mapped. A reader stuck past the wait keeps the mapping, which
        then goes with the last reference to it."""
        seg = self._seg
        if seg is None or self._rtok_owner == threading.get_ident():
            # This thread reads the lane further down its stack: close() from
            # a signal handler, or a finalizer, in the middle of a read.
            return
        # _rtok first: a reader holding it may take _lock.
        if not self._rtok.acquire(True, 2.0):
            return
        try:
            with self._lock, self._wlock:
                if self._writing:
                    return  # the same, in the middle of a lane write (the locks are re-entrant)
                seg.close()
                self._seg = None
        finally:
            self._rtok.release()

    def _take_rtok(self):
        """Takes the socket to read it, without waiting; see _rtok."""
        if self._rtok.acquire(False):
            self._rtok_owner = threading.get_ident()
            return True
        return False

    def _give_rtok(self):
        self._rtok_owner = None
        self._rtok.release()

    def _take_shm(self):
        """Maps the segment that came with the hello-ack (PROTOCOL.md 2.3):
        it must be its only descriptor. Frames go through the shm channel from
        now on, and the socket turns non-blocking."""
        fds = self._rd.take_fds(len(self._rd.fds))
        try:
            if len(fds) != 1:
                raise wire.malformed("hello-ack with the shm capability and %d descriptors, want 1 (the segment)", len(fds))
            seg = shm.Segment(fds[0])
        finally:
            wire.close_fds(fds)
        rd = self._rd
        leftover = bytes(rd.buf[rd.pos:])
        inbound, self._out = seg.lanes()
        self._seg = seg
        self._rd = shm.ShmReader(self._sock, inbound, leftover, rd.frame_timeout)
        self._sock.settimeout(0.0)

    def _handshake(self, timeout, backend):
        caps = wire.CAP_VMM
        if self._want_shm:
            ok, self.shm_reason = shm.available()
            if ok:
                caps |= wire.CAP_SHM
        else:
            self.shm_reason = "not asked for (connect(shm=True) or CUDASHARE_SHM=1 asks)"
        try:
            self._send([wire.HELLO, wire.VERSION, wire.ROLE_CONSUMER, os.getpid(), os.urandom(16), [],
                        caps, self.credits])
        except (BrokenPipeError, ConnectionResetError):
            # A listener that refuses this peer (another user, a limit)
            # says why and closes at once, maybe before the hello is
            # written (PROTOCOL.md section 3): its error is read below.
            pass
        deadline = time.monotonic() + timeout
        body = None
        while body is None:
            body = self._rd.next_frame()
            if body is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout("handshake with %s: no hello-ack within %.1fs" % (self.path, timeout))
            self._sock.settimeout(left)
            try:
                # The hello advertised CAP_VMM: the producer's first offer
                # may follow the hello-ack at once, its descriptor arriving
                # in this same read. It is queued for the offer to claim
                # (check_partial closes any that none claims).
                if not self._rd.fill(accept_fds=True):
                    raise ProducerGone("%s closed the connection during the handshake" % self.path)
            except socket.timeout:
                raise Timeout("handshake with %s: no hello-ack within %.1fs" % (self.path, timeout))
        m = wire.decode(body)
        kind = wire.uint(m[0], "kind")
        if kind == wire.ERROR:
            wire.need(m, 3, "error")
            raise ProtocolError(wire.uint(m[1], "error.code"), str(m[2]), remote=True)
        if kind != wire.HELLO_ACK:
            raise self._protocol_fail(ProtocolError(errors.UNEXPECTED_MESSAGE, "kind %d before the handshake completed" % kind))
        wire.need(m, 8, "hello-ack")
        version = wire.uint(m[1], "hello-ack.version")
        if version != wire.VERSION:
            raise ProtocolError(errors.VERSION, "producer speaks version %d, this consumer %d" % (version, wire.VERSION))
        role = wire.uint(m[2], "hello-ack.role")
        if role != wire.ROLE_PRODUCER:
            raise self._protocol_fail(ProtocolError(errors.HANDSHAKE, "peer role %d, want a producer" % role))
        devs = m[5]
        if not isinstance(devs, list) or len(devs) > wire.MAX_DEVICES:
            raise self._protocol_fail(wire.malformed("hello-ack.devices: want an array of at most %d", wire.MAX_DEVICES))
        for d in devs:
            wire.binn(d, 16, "hello-ack.devices")
        # The producer's session (PROTOCOL.md §4 hello, §7.2): None when it names none,
        # an unknown session. A new producer's allocation ids start again:
        # this consumer's allocation table is this connection's alone, so
        # it never takes a new session's offer for an old mapping.
        session = wire.uint(m[8], "hello-ack.session") if len(m) > 8 else None
        self.producer = {"pid": wire.uint(m[3], "hello-ack.pid"), "devices": devs,
                         "caps": wire.uint(m[6], "hello-ack.capabilities"), "session": session or None}
        # PROTOCOL.md §4.1, events and PID namespaces: a producer whose
        # pid reads 0 here lives in a sibling PID namespace (or one this
        # side cannot see), where the driver refuses interprocess events:
        # release on the host instead.
        try:
            peer_pid = struct.unpack("3i", self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        except OSError:
            peer_pid = 0
        self._rel_events_ok = bool(self.producer["caps"] & wire.CAP_RELEASE_EVENTS) and peer_pid != 0
        if caps & wire.CAP_SHM and self.producer["caps"] & wire.CAP_SHM:
            self._take_shm()
        else:
            if caps & wire.CAP_SHM:
                self.shm_reason = "the producer did not agree"
            self._sock.settimeout(self._write_timeout)
        self._backend = backends.select(backend, self.device, devs)
        self._on_host = self._backend.on_host
        self._dl_device = self._backend.dl_device
        self._reader = threading.Thread(target=self._read_loop, name="cudashare-reader %s" % self.path, daemon=True)
        self._reader.start()
        _open.add(self)

    # --- the application's side ---

    def next(self, timeout: Optional[float] = None) -> "Lease":
        """Returns the next lease, waiting up to timeout seconds (None: as
        long as it takes). Raises Closed once the producer said goodbye (or
        close() was called) and nothing is queued, ProducerGone if it
        vanished, ProtocolError if the connection failed, Timeout."""
        q = self._queue
        lock = self._lock
        deadline = None
        waited = None  # when this call began to wait: none queued
        while True:
            with lock:
                if self._closed:
                    raise Closed("this consumer is closed")
                if waited is not None:
                    self._wait_s += time.monotonic() - waited
                    waited = None
                if q and (self._end is None or isinstance(self._end, Closed)):
                    self._n_handoffs += 1
                    self._user_t = time.monotonic()
                    lease = q.popleft()
                    if q or self._end is not None:
                        self._wake()  # the next waiter's turn
                    return lease
                if self._end is not None:
                    self._wake()
                    raise self._end
                if self._bye_received:
                    self._wake()
                    if self._bye_code == wire.GOODBYE_RESTARTING:
                        self._finish(ProducerRestarting("the producer at %s restarted (its goodbye said it comes "
                                                        "back)" % self.path))
                        raise self._end
                    raise Closed("the producer said goodbye")
                if timeout is None:
                    left = 1.0
                else:
                    if deadline is None:
                        deadline = time.monotonic() + timeout
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Timeout("no offer within %.3gs" % timeout)
                # About to wait: what this consumer gave back leaves now,
                # and a lease the application lost with its array() view
                # is given back (Releases._reap_orphans): at once with every
                # credit held, else at most every REAP_EVERY (a producer
                # may offer fewer buffers than the credits).
                if self._n_views and self._outstanding:
                    now = time.monotonic()
                    if len(self._outstanding) >= self._window or now - self._reap_t >= REAP_EVERY:
                        self._reap_t = now
                        self._reap_orphans()
                self._push_locked()
                self._user_t = waited = time.monotonic()
            # The socket is free: read it here, in the caller's thread.
            if self._take_rtok():
                try:
                    self._pump(min(left, BG_POLL), user=True)
                finally:
                    self._give_rtok()
                continue
            with lock:
                self._waiters += 1
            try:
                self._sig.acquire(True, min(left, TICK))
            finally:
                with lock:
                    self._waiters -= 1

    def next_many(self, n: int, timeout: Optional[float] = None) -> "List[Lease]":
        """Returns 1 to n leases: waits for the first as next() does (and
        raises as it does), then takes those queued already, without
        waiting for more. With release_many, a loop that takes a group of
        leases per step pays the package's per-lease costs (its lock, the
        release message) once per group."""
        if n < 1:
            raise ValueError("next_many(%d): want at least 1" % n)
        first = self.next(timeout)
        if n == 1:
            return [first]
        return first._c._take_queued(first, n - 1)

    def _take_queued(self, first, k):
        out = [first]
        q = self._queue
        if q:
            with self._lock:
                if not self._closed and (self._end is None or isinstance(self._end, Closed)):
                    while q and k:
                        out.append(q.popleft())
                        k -= 1
                    self._n_handoffs += len(out) - 1
        return out

    def release_many(self, leases: "Iterable[Lease]", stream: Any = None) -> None:
        """Releases every lease of leases as Lease.release(stream) would,
        in one message (and, stream-ordered, one event record on stream for
        the group): for a group the application finished together, e.g. what
        next_many returned. Leases released already are skipped."""
        groups = {}
        for l in leases:
            if not l.released:
                g = groups.get(l._c)
                if g is None:
                    groups[l._c] = [l]
                else:
                    g.append(l)
        for c, g in groups.items():  # one consumer, unless a reconnect came between them
            c._release_many(g, stream)

    def __iter__(self) -> "Iterator[Lease]":
        while True:
            try:
                yield self.next()
            except Closed:
                return

    def run(self, fn: "Callable[[Lease], Any]", workers: int = 2, count: int = 0) -> int:
        """Runs fn(lease) on `workers` threads for every lease until the
        producer says goodbye (or count leases, if count > 0), releasing
        each after fn returns (fn may release it itself, stream-ordered).
        Returns the number of leases handled; the first exception that fn
        or the connection raised is re-raised (Closed is a clean end)."""
        done = [0]
        first = []
        lock = threading.Lock()
        stop = threading.Event()

        ended = [threading.Event() for _ in range(workers)]

        def work(i):
            try:
                loop()
            finally:
                ended[i].set()

        def loop():
            while not stop.is_set():
                try:
                    lease = self.next(timeout=0.2)
                except Timeout:
                    continue
                except Closed:
                    return
                except BaseException as e:
                    with lock:
                        first.append(e)
                    stop.set()
                    return
                if lease._a.dead:
                    # Its producer went away, and its legacy IPC memory with
                    # it, since next() handed it out: fn never gets it.
                    lease.release()
                    continue
                try:
                    fn(lease)
                except BaseException as e:
                    with lock:
                        first.append(e)
                    stop.set()
                finally:
                    lease.release()
                with lock:
                    done[0] += 1
                    if count and done[0] >= count:
                        stop.set()

        ts = [threading.Thread(target=work, args=(i,), name="cudashare-worker-%d" % i, daemon=True)
              for i in range(workers)]
        started = 0
        try:
            for t in ts:
                # Counted first: start() runs the thread and then waits for
                # it, and a signal may interrupt that wait.
                started += 1
                t.start()
            for t in ts:
                t.join()
        except BaseException:
            # Interrupted in the caller's thread (KeyboardInterrupt, or a
            # signal handler's exception): stop the workers and wait for
            # them, so that none reads a lease while the caller closes the
            # mappings. Not with join: in CPython 3.11 a join interrupted
            # this way marks the thread stopped, and a second returns at
            # once. Bounded, for a worker stuck in fn.
            stop.set()
            deadline = time.monotonic() + _STOP_WAIT
            for ev in ended[:started]:
                while True:
                    try:
                        ev.wait(max(0.0, deadline - time.monotonic()))
                        break
                    except BaseException:
                        # A second interrupt (a signal sent twice): the
                        # workers must still stop before the caller closes
                        # the mappings under them.
                        if time.monotonic() >= deadline:
                            break
            raise
        if first:
            raise first[0]
        return done[0]

    def grant(self, n: int) -> None:
        """Widens the window by n credits (a credit message)."""
        with self._lock:
            if n < 1 or self._window + n > wire.MAX_CREDITS:
                raise ValueError("grant %d: the window may not exceed %d" % (n, wire.MAX_CREDITS))
            self._window += n
            self._push_at = max(1, min(wire.MAX_RELEASE_SEQS, self._window // 4))
            # Written under _lock: every writer takes _lock before _wlock
            # (_send says why).
            self._send([wire.CREDIT, n])

    @property
    def backend(self) -> Optional[str]:
        """"cuda" or "sim"."""
        return self._backend.name if self._backend else None

    @property
    def backend_reason(self) -> str:
        return self._backend.reason if self._backend else ""

    @property
    def device_uuid(self) -> Optional[bytes]:
        return self._backend.device_uuid if self._backend else None

    def stats(self) -> "Dict[str, Any]":
        """Counters: offers, handoffs, releases, ordered_releases, leaked,
        mappings, retired, closed, bytes; release_messages (releases
        leave in batches)."""
        with self._lock:
            d = dict(self._stats)
            d.update(offers=self._n_offers, handoffs=self._n_handoffs, releases=self._n_releases,
                     bytes=self._n_bytes, release_messages=self._n_msgs, ordered_releases=self._n_ordered,
                     shm=self._out is not None)
            d.update(self._observed())
            return d

    def close(self, timeout: float = 5.0, reason: str = "consumer closed") -> None:
        """Says goodbye and closes; idempotent. Leases still held are
        released first (their views become invalid: finish using them
        before), every mapping is closed, then goodbye is sent and the
        write side half-closed; it waits up to timeout for the producer to
        close, then closes the socket."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clean = self._end is None or isinstance(self._end, Closed)
            self._wake()
        _open.discard(self)
        try:
            if clean and self._reader is not None:
                with self._lock:
                    self._push_locked()
                    held = list(self._outstanding)
                    for ref in self._outstanding.values():
                        l = ref()
                        if l is not None:
                            l.released = True
                    for l in self._queue:
                        l.released = True
                    self._queue.clear()
                    for i in range(0, len(held), wire.MAX_RELEASE_SEQS):
                        self._send_quiet([wire.RELEASE, held[i:i + wire.MAX_RELEASE_SEQS]])
                    self._outstanding.clear()
                    for alloc_id, a in list(self._allocs.items()):
                        self._close_alloc(alloc_id, a, answer=False)
                    if self._send_quiet([wire.GOODBYE, reason[:wire.MAX_TEXT]]):
                        self._bye_sent = True
                        try:
                            self._sock.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass
                self._eof.wait(timeout)
        finally:
            self._teardown()

    def _set_apart(self):
        """Once the producer is gone and another takes its place
        (_reconnect.py): no mapping outlives its last lease, and legacy IPC
        leases, whose memory died with the producer, say so."""
        with self._lock:
            for seq, ref in list(self._outstanding.items()):
                l = ref()
                if l is None or l.released:
                    # Voided with the queue at the connection's end: never
                    # given to the application, so never released.
                    del self._outstanding[seq]
                    if not ref.alloc.closed:
                        ref.alloc.leases -= 1
            for alloc_id, a in list(self._allocs.items()):
                if a.mapping.kind == wire.HANDLE_IPC:
                    a.dead = True
                a.retired = True
                if a.leases == 0 and not a.closed:
                    self._close_alloc(alloc_id, a, answer=False)

    def _teardown(self):
        self._stop = True
        self._closed = True
        _open.discard(self)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(2.0)
        self._unmap_shm()
        self._sock.close()
        self._rd.close_fds()
        with self._lock:
            # Whatever the end (a clean close released them above; a
            # producer that vanished or broke the protocol did not), no
            # lease outlives its mapping: released, ptr and views refuse.
            for ref in self._outstanding.values():
                l = ref()
                if l is not None:
                    l.released = True
            self._outstanding.clear()
            b = self._backend
            if b is not None:
                for alloc_id, a in list(self._allocs.items()):
                    try:
                        self._close_alloc(alloc_id, a, answer=False)
                    except CudashareError:
                        pass
                for ev in self._events.values():
                    if ev is not None:
                        b.destroy_event(ev)
                for ev, _h in self._rel_events.values():
                    b.destroy_event(ev)
                self._events.clear()
                self._rel_events.clear()
                b.shutdown()
            if self._end is None:
                self._end = Closed("this consumer is closed")
            self._wake()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            if not self._closed:
                self.close(timeout=0.5, reason="consumer garbage-collected")
        except Exception:
            pass


def _observed_stats(c):
    """What an operator asks of a consumer now (Consumer.stats): leases
    held, allocations mapped and their bytes, seconds waited in next(), and
    the message path ("shm" or "socket"). The caller holds c._lock."""
    maps = [a for a in c._allocs.values() if not a.closed]
    return {
        "held": len(c._outstanding),
        "mapped": len(maps),
        "mapped_bytes": sum(getattr(a.mapping, "size", 0) or 0 for a in maps),
        "wait_seconds": c._wait_s,
        "path": "shm" if c._out is not None else "socket",
    }


Consumer._observed = _observed_stats

