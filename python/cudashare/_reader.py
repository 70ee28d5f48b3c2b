"""The consumer's reading side: the background reader thread, the
hand-over of the socket between it and next(), and the producer's messages
(offers, retire, goodbye, errors) as they arrive. A mixin of Consumer, whose
state (_consumer.py) it shares; split out by idea, not to be used alone."""

import os
import select
import socket
import time
import weakref

from . import _wire as wire, _errors as errors
from ._errors import Closed, CudashareError, ProducerGone, ProducerRestarting, ProtocolError
from ._lease import Lease
from ._releases import LeaseRef

import logging

log = logging.getLogger("cudashare")
_MISSING = object()

MAX_EVENTS = 4096          # distinct producer events cached per connection (PROTOCOL.md §4)
RELEASE_DELAY = 100e-6     # how long a release may wait to leave with others (the background tick rounds it up to TICK)
TICK = 0.002               # the background reader's tick while the application reads, or holds releases
HANDOVER = 0.002           # the background reader takes the socket when no next() ran for this long
BG_POLL = 0.05             # its poll while it reads and nothing is pending


class _Alloc:
    __slots__ = ("id", "mapping", "leases", "retired", "rel_events", "closed", "views", "dead")

    def __init__(self, alloc_id, mapping):
        self.id = alloc_id
        self.mapping = mapping
        self.leases = 0
        self.retired = False
        self.rel_events = set()
        self.closed = False
        self.views = {}  # Lease.array's: (convert, offset, size[, dtype, shape]) -> (the framework's view, its views.Pin)
        self.dead = False  # legacy IPC memory of a producer gone (set_apart): it died with it


class Reader:
    """Consumer's reading side (see _consumer.py for the design)."""

    def _read_loop(self):
        """The background reader: it reads only while no next() does, so
        that retire, goodbye and errors are handled while the application is
        busy with a batch; while the application keeps calling next(), the
        thread in next() reads the socket itself (no hop between threads)
        and this one only ticks, pushing releases older than RELEASE_DELAY."""
        lock = self._lock
        monotonic = time.monotonic
        while not self._stop and not self._eof.is_set():
            now = monotonic()
            if self._npend:
                with lock:
                    if self._npend and now - self._pend_t >= RELEASE_DELAY:
                        self._push_locked()
            if self._waiters or now - self._user_t < HANDOVER or not self._take_rtok():
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
                self._give_rtok()
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
            if self._out is not None:
                # The shm channel: the lane first, then sleep on the socket.
                more = rd.wait(timeout, self._poller)
            elif not self._poller.poll(int(timeout * 1000 + 0.999)):
                return True
            else:
                more = rd.fill(accept_fds=True)
            body = rd.next_frame()
            while body is not None:
                self._handle(wire.decode(body), len(body))
                body = rd.next_frame()
            if not more:
                self._on_eof()
                self._ended()
                return False
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
        if self._bye_received and self._bye_code == wire.GOODBYE_RESTARTING:
            self._finish(ProducerRestarting("the producer at %s restarted (its goodbye said it comes back)" % self.path))
        elif self._bye_received or self._bye_sent:
            self._finish(Closed("the producer said goodbye" if self._bye_received else "this consumer said goodbye"))
        else:
            self._finish(ProducerGone("the producer at %s went away without saying goodbye (killed or crashed)" % self.path))

    def _protocol_fail(self, err, cause=None):
        """Tells the producer why (best-effort, short timeout) and ends."""
        if not err.remote:
            try:
                frame = wire.pack([wire.ERROR, err.code, str(err)[:wire.MAX_TEXT]])
                with self._lock, self._wlock:  # _lock first: consumer._send says why
                    if self._out is not None:
                        self._send_socket(frame, 0.1)  # the socket carries errors on a shm connection
                    else:
                        self._sock.settimeout(0.1)
                        self._sock.sendall(frame)
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
                    # next() returns nothing queued after such an end:
                    # those offers are void with the connection, not
                    # leases the application leaked.
                    for l in self._queue:
                        l.released = True
                        r = self._outstanding.get(l.seq)
                        if r is not None:
                            r.void = True
                    self._queue.clear()
                    # Nor does array()'s cache keep views alive any longer:
                    # a view the application still holds keeps its lease,
                    # and through it this consumer and its mappings, as a
                    # __dlpack__ tensor does; one it dropped goes, and the
                    # consumer with it once nothing else holds it.
                    for a in self._allocs.values():
                        if a.views:
                            self._n_views -= len(a.views)
                        a.views = None
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
            code = wire.uint(m[2], "goodbye.code") if len(m) > 2 else wire.GOODBYE_DONE
            log.debug("cudashare: producer said goodbye (code %d): %s", code, reason)
            with self._lock:
                self._bye_code = code if code == wire.GOODBYE_RESTARTING else wire.GOODBYE_DONE
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
                        self._queue_locked(o, a, ev)
                        return
        fds = []
        try:
            if o.nfds:
                fds = self._rd.take_fds(o.nfds)
            if self._bye_sent or self._ended_badly():
                # Void: this consumer said goodbye, or the connection ended
                # (a write failed, in another thread) while the reader read
                # on: not a lease to return from next(), nor one to report leaked.
                return
            if o.handle_kind not in (wire.HANDLE_IPC, wire.HANDLE_VMM):
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
                if o.handle_kind == wire.HANDLE_VMM and len(fds) != 1:
                    raise wire.malformed("first offer of vmm allocation %d carries %d descriptors, want 1", o.alloc_id, len(fds))
                if o.handle_kind == wire.HANDLE_IPC and fds:
                    raise wire.malformed("ipc offer carries %d descriptors", len(fds))
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
                self._queue_locked(o, a, ev)
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass


    def _queue_locked(self, o, a, ev):
        """Makes the offer o, in allocation a with event ev, a lease that
        next() returns: bound, outstanding, queued. _lock held."""
        o._bind(self, a, ev)
        a.leases += 1
        r = self._outstanding[o.seq] = LeaseRef(o, self._dropped_cb)
        r.seq = o.seq
        r.alloc = a
        r.void = False
        self._queue.append(o)
        self._n_offers += 1
        self._n_bytes += o.size
        if self._waiters:
            self._wake()

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
        if o.alloc_size > mp.size or (mp.kind == wire.HANDLE_IPC and o.alloc_size != mp.size):
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
            if a.leases and a.views:
                self._reap_orphans()  # may close it: the last lease's release does
            if a.leases == 0 and not a.closed:
                self._close_alloc(alloc_id, a, answer=True)

    def _close_alloc(self, alloc_id, a, answer):
        """Closes a mapping once no lease and no queued GPU work is in it,
        then says closed (PROTOCOL.md §4 retire)."""
        # Releases pending leave first: closed counts only releases sent
        # before it, and their events are recorded already.
        self._push_locked()
        a.closed = True
        if a.views:
            self._n_views -= len(a.views)
        a.views = None  # the framework's views of the mapping go before it
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
            with self._lock, self._wlock:  # _lock first: consumer._send says why
                self._write(frames)
            return True
        except ProtocolError as e:
            # A producer that broke lane 1's head (_shm.py).
            self._protocol_fail(e)
            return False
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
