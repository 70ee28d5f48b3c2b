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
"""

import atexit
import collections
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
import weakref

from . import backends, wire, errors
from .errors import Closed, CudashareError, NotSupported, ProducerGone, ProtocolError, Timeout
from .lease import Lease

log = logging.getLogger("cudashare")
_MISSING = object()

MAX_EVENTS = 4096          # distinct producer events cached per connection (PROTOCOL.md §4)
MAX_RELEASE_STREAMS = 64   # streams with their own release event
RELEASE_DELAY = 100e-6     # how long a release may wait to leave with others (the background tick rounds it up to TICK)
TICK = 0.002               # the background reader's tick while the application reads, or holds releases
HANDOVER = 0.002           # the background reader takes the socket when no next() ran for this long
BG_POLL = 0.05             # its poll while it reads and nothing is pending


class _Alloc:
    __slots__ = ("id", "mapping", "leases", "retired", "rel_events", "closed")

    def __init__(self, alloc_id, mapping):
        self.id = alloc_id
        self.mapping = mapping
        self.leases = 0
        self.retired = False
        self.rel_events = set()
        self.closed = False


_open = weakref.WeakSet()


def _close_all(reason):
    for c in list(_open):
        try:
            c.close(reason=reason)
        except Exception:
            pass


atexit.register(_close_all, "interpreter exit")


def connect(path, device=0, credits=8, backend="auto", timeout=5.0, write_timeout=10.0,
            frame_timeout=10.0, handle_sigterm=False, wait=0.0):
    """Connects to the producer listening at path and returns a Consumer.

    device: the GPU (this process's ordinal) to map buffers on. credits: the
    most leases held at once (queued or in use). backend: "auto", "cuda" or
    "sim" (CUDASHARE_DRIVER overrides it, as for the Go binaries).
    timeout bounds the connect and handshake; wait retries a socket that is
    not there yet for that long. handle_sigterm: install a SIGTERM handler
    that says goodbye (closes every consumer) before the previous handler
    runs or the process exits 143; without it, only close(), the context
    manager and interpreter exit say goodbye.
    """
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
    c = Consumer(sock, path, device, credits, write_timeout, frame_timeout)
    try:
        c._handshake(timeout, backend)
    except BaseException:
        c._teardown()
        raise
    if handle_sigterm:
        install_sigterm_handler()
    return c


def install_sigterm_handler():
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


class Consumer:
    """A connection to one producer. Use connect() to make one."""

    def __init__(self, sock, path, device, credits, write_timeout, frame_timeout):
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
        self._user_t = 0.0       # when a next() last returned or waited
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self._events = {}        # producer's event handle bytes -> opened event
        self._rel_events = {}    # stream -> (event, handle bytes)
        self._window = credits
        self._end = None         # the exception that ended the connection
        self._bye_received = False
        self._bye_sent = False
        self._eof = threading.Event()
        self._closed = False
        self._stop = False
        self._backend = None
        self._reader = None
        self.producer = None     # the hello-ack: dict of pid, devices, caps
        self._stats = collections.Counter()
        self._n_offers = self._n_handoffs = self._n_releases = self._n_bytes = 0
        self._n_msgs = 0
        self._n_ordered = 0

    # --- setup ---

    def _send(self, msg):
        """Writes one message; raises if the write fails or times out."""
        frame = wire.pack(msg)
        with self._wlock:
            self._sock.sendall(frame)

    def _handshake(self, timeout, backend):
        self._send([wire.HELLO, wire.VERSION, wire.ROLE_CONSUMER, os.getpid(), os.urandom(16), [],
                    wire.CAP_FDS, self.credits])
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
                # The hello advertised CAP_FDS: the producer's first offer
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
        self.producer = {"pid": wire.uint(m[3], "hello-ack.pid"), "devices": devs,
                         "caps": wire.uint(m[6], "hello-ack.capabilities")}
        # PROTOCOL.md §4.1, events and PID namespaces: a producer whose
        # pid reads 0 here lives in a sibling PID namespace (or one this
        # side cannot see), where the driver refuses interprocess events:
        # release on the host instead.
        try:
            peer_pid = struct.unpack("3i", self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        except OSError:
            peer_pid = 0
        self._rel_events_ok = bool(self.producer["caps"] & wire.CAP_RELEASE_EVENTS) and peer_pid != 0
        self._sock.settimeout(self._write_timeout)
        self._backend = backends.select(backend, self.device, devs)
        self._reader = threading.Thread(target=self._read_loop, name="cudashare-reader %s" % self.path, daemon=True)
        self._reader.start()
        _open.add(self)

    # --- the reader thread ---

    def _read_loop(self):
        """The background reader: it reads only while no next() does, so
        that retire, goodbye and errors are handled while the application is
        busy with a batch; while the application keeps calling next(), the
        thread in next() reads the socket itself (no hop between threads)
        and this one only ticks, pushing releases older than RELEASE_DELAY."""
        rtok = self._rtok
        lock = self._lock
        monotonic = time.monotonic
        while not self._stop and not self._eof.is_set():
            now = monotonic()
            if self._npend:
                with lock:
                    if self._npend and now - self._pend_t >= RELEASE_DELAY:
                        self._push_locked()
            if self._waiters or now - self._user_t < HANDOVER or not rtok.acquire(False):
                time.sleep(TICK)
                continue
            try:
                # Read until a next() wants to (it waits while this holds
                # the socket; what arrives is queued and wakes it).
                while not self._stop and self._pump(TICK if self._npend else BG_POLL):
                    if self._waiters or monotonic() - self._user_t < HANDOVER:
                        break
                    if self._npend:
                        with lock:
                            if self._npend and monotonic() - self._pend_t >= RELEASE_DELAY:
                                self._push_locked()
            finally:
                rtok.release()
            self._wake()

    def _pump(self, timeout, user=False):
        """Reads what the socket has, waiting up to timeout seconds for it;
        handles every whole frame. The caller holds _rtok; user: it is a
        next(), which does not wait with a lease queued. Returns False
        once the connection has ended (the end is recorded for next())."""
        rd = self._rd
        try:
            # Frames first: earlier reads may have buffered whole messages
            # that no later read will announce.
            body = rd.next_frame()
            while body is not None:
                self._handle(wire.decode(body), len(body))
                body = rd.next_frame()
            rd.check_partial(time.monotonic())
            if self._queue and (user or self._waiters):
                return True
            if not self._poller.poll(int(timeout * 1000 + 0.999)):
                return True
            if not rd.fill(accept_fds=True):
                self._on_eof()
                self._ended()
                return False
            body = rd.next_frame()
            while body is not None:
                self._handle(wire.decode(body), len(body))
                body = rd.next_frame()
            return True
        except ProtocolError as e:
            self._protocol_fail(e)
        except CudashareError as e:
            self._protocol_fail(ProtocolError(errors.INTERNAL, str(e)), cause=e)
        except OSError as e:
            if not self._stop:
                if self._bye_received or self._bye_sent:
                    self._on_eof()
                else:
                    self._finish(ProducerGone("connection to %s failed: %s" % (self.path, e)))
        self._ended()
        return False

    def _ended(self):
        self._rd.close_fds()
        self._eof.set()
        self._wake()

    def _on_eof(self):
        if self._bye_received or self._bye_sent:
            self._finish(Closed("the producer said goodbye" if self._bye_received else "this consumer said goodbye"))
        else:
            self._finish(ProducerGone("the producer at %s went away without saying goodbye (killed or crashed)" % self.path))

    def _protocol_fail(self, err, cause=None):
        """Tells the producer why (best-effort, short timeout) and ends."""
        if not err.remote:
            try:
                self._sock.settimeout(0.1)
                self._send([wire.ERROR, err.code, str(err)[:wire.MAX_TEXT]])
            except OSError:
                pass
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._finish(err)
        return err

    def _finish(self, err):
        with self._lock:
            if self._end is None:
                self._end = err
                if not isinstance(err, Closed):
                    # next() hands out nothing queued after such an end:
                    # those offers are void with the connection, not
                    # leases the application leaked.
                    for l in self._queue:
                        l.released = True
                    self._queue.clear()
            self._wake()

    def _wake(self):
        """Wakes one thread waiting in next() (it wakes the next one). Any
        thread; a wake nobody takes only makes a later wait loop once."""
        if self._waiters:
            try:
                self._sig.release()
            except RuntimeError:
                pass  # released already, not yet taken

    def _handle(self, m, body_len=None):
        kind = m[0]
        if type(kind) is not int or kind < 0:
            kind = wire.uint(kind, "kind")
        if self._bye_received:
            raise ProtocolError(errors.UNEXPECTED_MESSAGE, "message kind %d after the producer's goodbye" % kind)
        if kind == wire.OFFER:
            self._on_offer(Lease.parse(m, body_len))
        elif kind == wire.RETIRE:
            wire.need(m, 2, "retire")
            self._on_retire(wire.uint(m[1], "retire.alloc_id"))
        elif kind == wire.GOODBYE:
            wire.need(m, 2, "goodbye")
            reason = wire.text(m[1], "goodbye.reason")
            log.debug("cudashare: producer said goodbye: %s", reason)
            with self._lock:
                self._bye_received = True
                self._wake()
        elif kind == wire.ERROR:
            wire.need(m, 3, "error")
            raise ProtocolError(wire.uint(m[1], "error.code"), wire.text(m[2], "error.message"), remote=True)
        elif kind in (wire.HELLO, wire.HELLO_ACK, wire.RELEASE, wire.CLOSED, wire.CREDIT):
            raise ProtocolError(errors.UNEXPECTED_MESSAGE, "message kind %d from a producer" % kind)
        else:
            raise ProtocolError(errors.UNKNOWN_MESSAGE, "unknown message kind %d" % kind)

    def _on_offer(self, o):
        """o: the offer, parsed into the Lease it becomes."""
        if not o.nfds and not self._bye_sent:
            # The common case, in one lock: an allocation mapped already,
            # an event opened already (or none).
            eh = o.event_handle
            ev = None if eh is None else self._events.get(eh, _MISSING)
            if ev is not _MISSING:
                with self._lock:
                    out = self._outstanding
                    a = self._allocs.get(o.alloc_id)
                    if (a is not None and a.mapping.kind == o.handle_kind and len(out) < self._window
                            and o.seq not in out and self._end is None):
                        self._check_mapped(o, a, ())
                        o._bind(self, a, ev)
                        a.leases += 1
                        out[o.seq] = weakref.ref(o)
                        self._queue.append(o)
                        self._n_offers += 1
                        self._n_bytes += o.size
                        if self._waiters:
                            self._wake()
                        return
        fds = []
        try:
            if o.nfds:
                fds = self._rd.take_fds(o.nfds)
            if self._bye_sent or self._ended_badly():
                # Void: this consumer said goodbye, or the connection ended
                # (a write failed, in another thread) while the reader read
                # on: not a lease to hand out, nor one to report leaked.
                return
            if o.handle_kind not in (wire.HANDLE_CUDA_IPC, wire.HANDLE_POSIX_FD):
                raise ProtocolError(errors.NOT_SUPPORTED, "offer of handle kind %d, which this consumer does not import" % o.handle_kind)
            with self._lock:
                if len(self._outstanding) >= self._window:
                    raise ProtocolError(errors.CREDIT, "offer beyond the %d credits granted" % self._window)
                if o.seq in self._outstanding:
                    raise ProtocolError(errors.UNEXPECTED_MESSAGE, "offer of seq %d, which is outstanding already" % o.seq)
                a = self._allocs.get(o.alloc_id)
            if a is not None:
                self._check_mapped(o, a, fds)
            else:
                if o.handle_kind == wire.HANDLE_POSIX_FD and len(fds) != 1:
                    raise wire.malformed("first offer of posix_fd allocation %d carries %d descriptors, want 1", o.alloc_id, len(fds))
                if o.handle_kind == wire.HANDLE_CUDA_IPC and fds:
                    raise wire.malformed("cuda_ipc offer carries %d descriptors", len(fds))
                mapping = self._backend.open(o, fds)  # closes the descriptor
                fds = []
                a = _Alloc(o.alloc_id, mapping)
                self._stats["mappings"] += 1
            ev = None
            if o.event_handle is not None:
                ev = self._events.get(o.event_handle)
                if ev is None and o.event_handle not in self._events:
                    if len(self._events) >= MAX_EVENTS:
                        raise ProtocolError(errors.LIMIT, "more than %d distinct producer events" % MAX_EVENTS)
                    ev = self._backend.open_event(o.event_handle)
                    self._events[o.event_handle] = ev
            with self._lock:
                self._allocs[o.alloc_id] = a  # so that the end closes its mapping
                if self._ended_badly():
                    return  # void: the connection ended meanwhile
                o._bind(self, a, ev)
                a.leases += 1
                self._outstanding[o.seq] = weakref.ref(o)
                self._queue.append(o)
                self._n_offers += 1
                self._n_bytes += o.size
                if self._waiters:
                    self._wake()
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _ended_badly(self):
        """Whether the connection ended other than by a goodbye: what
        arrives after that is void."""
        end = self._end
        return end is not None and not isinstance(end, Closed)

    @staticmethod
    def _check_mapped(o, a, fds):
        """Checks an offer in an allocation mapped already (PROTOCOL.md §4.1)."""
        if a.retired:
            raise ProtocolError(errors.UNEXPECTED_MESSAGE, "offer in allocation %d after its retire" % o.alloc_id)
        mp = a.mapping
        if mp.handle != o.handle or mp.kind != o.handle_kind:
            raise wire.malformed("allocation %d offered with another handle", o.alloc_id)
        if fds:
            raise wire.malformed("offer of allocation %d, mapped already, carries %d descriptors", o.alloc_id, len(fds))
        if o.alloc_size > mp.size or (mp.kind == wire.HANDLE_CUDA_IPC and o.alloc_size != mp.size):
            raise wire.malformed("allocation %d offered with alloc_size %d, mapped with %d", o.alloc_id, o.alloc_size, mp.size)

    def _on_retire(self, alloc_id):
        with self._lock:
            a = self._allocs.get(alloc_id)
            if a is None:
                # Never mapped here: nothing to close.
                self._send_quiet([wire.CLOSED, alloc_id])
                return
            a.retired = True
            self._stats["retired"] += 1
            if a.leases == 0:
                self._close_alloc(alloc_id, a, answer=True)

    def _close_alloc(self, alloc_id, a, answer):
        """Closes a mapping once no lease and no queued GPU work is in it,
        then says closed (PROTOCOL.md §4 retire)."""
        # Releases pending leave first: closed counts only releases sent
        # before it, and their events are recorded already.
        self._push_locked()
        a.closed = True
        for ev in a.rel_events:
            self._backend.sync_event(ev)
        a.rel_events.clear()
        self._backend.close(a.mapping)
        self._allocs.pop(alloc_id, None)
        if answer:
            self._send_quiet([wire.CLOSED, alloc_id])
            self._stats["closed"] += 1

    def _send_quiet(self, msg):
        """Sends, unless the connection has ended; a write that fails after
        a goodbye is the normal end (PROTOCOL.md §4 goodbye)."""
        return self._send_quiet_frames(wire.pack(msg))

    def _send_quiet_frames(self, frames):
        if self._end is not None and not isinstance(self._end, Closed):
            return False
        try:
            with self._wlock:
                self._sock.sendall(frames)
            return True
        except OSError as e:
            if not (self._bye_received or self._bye_sent) and not self._peer_closed_with_more(e):
                self._finish(ProducerGone("write to %s failed: %s" % (self.path, e)))
            return False

    def _peer_closed_with_more(self, e):
        """Whether a write failed because the producer closed its end
        (EPIPE, ECONNRESET) and the socket still reads: what the producer
        sent before closing (an error that says why it dropped this
        consumer, PROTOCOL.md §7), or at least the end of stream. The
        reader then reads it and ends the connection with that cause; the
        failed write is only its echo. They race when a stopped consumer
        resumes with both pending (the Go transport's recvFailed). A
        closed peer nearly always reads (end of stream counts), so this
        mostly says: let the reader, which runs until the end, decide."""
        if not isinstance(e, (BrokenPipeError, ConnectionResetError)):
            return False
        p = select.poll()  # not _poller: the reader may be polling it
        try:
            p.register(self._sock.fileno(), select.POLLIN)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return False

    # --- releases ---

    def _release(self, lease, stream):
        with self._lock:
            if lease.released:
                return
            lease.released = True
            if self._outstanding.pop(lease.seq, None) is None:
                return  # voided by a goodbye or the connection's end
            a = lease._a
            ev_stream = None
            if stream is not None and not self._backend.on_host:
                s = stream if type(stream) is int else backends.stream_handle(stream)
                r = self._rel_events.get(s)
                if r is None and self._rel_events_ok and len(self._rel_events) < MAX_RELEASE_STREAMS:
                    r = self._rel_events[s] = self._backend.new_release_event()
                if r is not None:
                    # Recorded now, while the caller's stream surely
                    # lives; the message that names it may leave later.
                    self._backend.record(r[0], s)
                    if not a.closed:
                        a.rel_events.add(r[0])
                    ev_stream = s
                    self._n_ordered += 1
                else:
                    self._backend.stream_sync(s)
            if ev_stream is None:
                self._pend.append(lease.seq)
            else:
                p = self._pend_s.get(ev_stream)
                if p is None:
                    self._pend_s[ev_stream] = [lease.seq]
                else:
                    p.append(lease.seq)
            self._n_releases += 1
            n = self._npend = self._npend + 1
            if n >= self._push_at or self._waiters:
                self._push_locked()
            elif n == 1:
                self._pend_t = time.monotonic()
            if not a.closed:
                a.leases -= 1
                if a.retired and a.leases == 0:
                    self._close_alloc(a.id, a, answer=True)

    def _push_locked(self):
        """Writes the pending releases: one message per event stream and one
        for the host-ordered ones (at most 512 seqs each), in one write."""
        if not self._npend:
            return
        self._npend = 0
        out = []
        R = wire.RELEASE
        M = wire.MAX_RELEASE_SEQS
        if self._pend:
            seqs, self._pend = self._pend, []
            for i in range(0, len(seqs), M):
                out.append(wire.pack([R, seqs[i:i + M]]))
        if self._pend_s:
            groups, self._pend_s = self._pend_s, {}
            for s, seqs in groups.items():
                h = self._rel_events[s][1]
                for i in range(0, len(seqs), M):
                    out.append(wire.pack([R, seqs[i:i + M], h]))
        self._n_msgs += len(out)
        self._send_quiet_frames(b"".join(out) if len(out) > 1 else out[0])

    def _leaked(self, lease):
        with self._lock:
            self._stats["leaked"] += 1
        log.warning("cudashare: lease %d was garbage-collected without release; releasing it", lease.seq)
        self._release(lease, None)

    # --- the application's side ---

    def next(self, timeout=None):
        """Returns the next lease, waiting up to timeout seconds (None: as
        long as it takes). Raises Closed once the producer said goodbye (or
        close() was called) and nothing is queued, ProducerGone if it
        vanished, ProtocolError if the connection failed, Timeout."""
        q = self._queue
        lock = self._lock
        deadline = None
        while True:
            with lock:
                if self._closed:
                    raise Closed("this consumer is closed")
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
                    raise Closed("the producer said goodbye")
                if timeout is None:
                    left = 1.0
                else:
                    if deadline is None:
                        deadline = time.monotonic() + timeout
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Timeout("no offer within %.3gs" % timeout)
                # About to wait: what this consumer gave back leaves now.
                self._push_locked()
                self._user_t = time.monotonic()
            # The socket is free: read it here, in the caller's thread.
            if self._rtok.acquire(False):
                try:
                    self._pump(min(left, BG_POLL), user=True)
                finally:
                    self._rtok.release()
                continue
            with lock:
                self._waiters += 1
            try:
                self._sig.acquire(True, min(left, TICK))
            finally:
                with lock:
                    self._waiters -= 1

    def __iter__(self):
        while True:
            try:
                yield self.next()
            except Closed:
                return

    def run(self, fn, workers=2, count=0):
        """Runs fn(lease) on `workers` threads for every lease until the
        producer says goodbye (or count leases, if count > 0), releasing
        each after fn returns (fn may release it itself, stream-ordered).
        Returns the number of leases handled; the first exception that fn
        or the connection raised is re-raised (Closed is a clean end)."""
        done = [0]
        first = []
        lock = threading.Lock()
        stop = threading.Event()

        def work():
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

        ts = [threading.Thread(target=work, name="cudashare-worker-%d" % i, daemon=True) for i in range(workers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if first:
            raise first[0]
        return done[0]

    def grant(self, n):
        """Widens the window by n credits (a credit message)."""
        with self._lock:
            if n < 1 or self._window + n > wire.MAX_CREDITS:
                raise ValueError("grant %d: the window may not exceed %d" % (n, wire.MAX_CREDITS))
            self._window += n
            self._push_at = max(1, min(wire.MAX_RELEASE_SEQS, self._window // 4))
        self._send([wire.CREDIT, n])

    @property
    def backend(self):
        """"cuda" or "sim"."""
        return self._backend.name if self._backend else None

    @property
    def backend_reason(self):
        return self._backend.reason if self._backend else ""

    @property
    def device_uuid(self):
        return self._backend.device_uuid if self._backend else None

    def stats(self):
        """Counters: offers, handoffs, releases, ordered_releases, leaked,
        mappings, retired, closed, bytes; release_messages (releases
        leave in batches)."""
        with self._lock:
            d = dict(self._stats)
            d.update(offers=self._n_offers, handoffs=self._n_handoffs, releases=self._n_releases,
                     bytes=self._n_bytes, release_messages=self._n_msgs, ordered_releases=self._n_ordered)
            return d

    def close(self, timeout=5.0, reason="consumer closed"):
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
        self._sock.close()
        self._rd.close_fds()
        with self._lock:
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

    def __enter__(self):
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
