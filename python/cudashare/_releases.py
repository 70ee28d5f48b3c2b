"""The consumer's releases: host-ordered and stream-ordered (with one
release event per stream), queued and pushed together as PROTOCOL.md §4
allows. A mixin of Consumer, whose state (_consumer.py) it shares;
the lease's side of the consumer (_lease.py's interface) too; split out
by idea, not to be used alone."""

import logging
import time
import warnings
import weakref

from . import _backends as backends, _wire as wire
from . import _views as views
from ._views import orphans

log = logging.getLogger("cudashare")

MAX_RELEASE_STREAMS = 64   # streams with their own release event
REAP_EVERY = 0.01          # how often a waiting next() looks for leases lost with their views, credits to spare


class LeaseRef(weakref.ref):
    """The consumer's reference to a lease it handed out (or queued), in
    _outstanding: weak, so that a lease the application drops without
    release is collected, and then released by its callback (_dropped) as
    leaked. It keeps what that release needs: seq and the allocation.
    void: the lease was voided without a release (the connection ended
    with it queued): its collection is no leak. One of these per lease is
    what weakref.finalize would cost several of."""

    __slots__ = ("seq", "alloc", "void")


class Releases:
    """Consumer's releases (see _consumer.py for the design)."""

    def _release(self, lease, stream):
        """Lease.release: lease is handed out, stream as release() takes it."""
        with self._lock:
            if lease.released:
                return
            lease.released = True
            if lease._pins is not None:
                lease._unpin_locked()  # array()'s cached views stop keeping it alive
            if self._outstanding.pop(lease.seq, None) is None:
                return  # voided by a goodbye or the connection's end
            self._release_locked(lease.seq, lease._a, stream)

    def _release_many(self, leases, stream):
        """Consumer.release_many: every lease of the group in one lock, one
        event record (a stream-ordered group) and one message."""
        with self._lock:
            a_ev = self._ordered_event(stream) if stream is not None else None
            pop = self._outstanding.pop
            n = 0
            seqs = []
            for lease in leases:
                if lease.released:
                    continue
                lease.released = True
                if lease._pins is not None:
                    lease._unpin_locked()
                if pop(lease.seq, None) is None:
                    continue
                a = lease._a
                seqs.append(lease.seq)
                if a_ev is not None and not a.closed:
                    a.rel_events.add(a_ev[0])
                if not a.closed:
                    a.leases -= 1
                    if a.retired and a.leases == 0:
                        if seqs:
                            self._pend_seqs(seqs, a_ev)
                            n += len(seqs)
                            seqs = []
                        self._close_alloc(a.id, a, answer=True)
            if seqs:
                self._pend_seqs(seqs, a_ev)
                n += len(seqs)
            if n:
                self._n_releases += n
                if a_ev is not None:
                    self._n_ordered += n
                self._push_locked()

    def _pend_seqs(self, seqs, a_ev):
        if a_ev is None:
            self._pend.extend(seqs)
        else:
            p = self._pend_s.get(a_ev[1])
            if p is None:
                self._pend_s[a_ev[1]] = list(seqs)
            else:
                p.extend(seqs)
        if not self._npend:
            self._pend_t = time.monotonic()
        self._npend += len(seqs)

    def _ordered_event(self, stream):
        """(release event, stream) recorded on stream now, for releases
        ordered after the work queued there; None where releases are
        host-ordered (the simulator, no interprocess events: the stream is
        synchronized here instead, or there is none)."""
        if self._on_host:
            return None
        s = stream if type(stream) is int else backends.stream_handle(stream)
        r = self._rel_events.get(s)
        if r is None and self._rel_events_ok and len(self._rel_events) < MAX_RELEASE_STREAMS:
            r = self._rel_events[s] = self._backend.new_release_event()
        if r is None:
            self._backend.stream_sync(s)
            return None
        # Recorded now, while the caller's stream surely lives; the
        # message that names it may leave later.
        self._backend.record(r[0], s)
        return r[0], s

    def _release_locked(self, seq, a, stream):
        """Queues seq's release, stream-ordered when stream is given and
        can be, and sends what is pending once enough is; closes a retired
        allocation after its last lease."""
        a_ev = None
        if stream is not None:
            a_ev = self._ordered_event(stream)
        if a_ev is None:
            self._pend.append(seq)
        else:
            if not a.closed:
                a.rel_events.add(a_ev[0])
            self._n_ordered += 1
            p = self._pend_s.get(a_ev[1])
            if p is None:
                self._pend_s[a_ev[1]] = [seq]
            else:
                p.append(seq)
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

    def _reap_orphans(self):
        """array()'s pins keep a lease from the garbage collector while the
        application may use its view; a lease the application dropped
        without release, whose view it dropped too, is found here (when
        next() would wait with every credit held, and at a retire) and
        released as the collector would have: counted leaked, with a
        warning. The caller holds _lock."""
        for l in orphans(self._outstanding):
            self._leaked(l.seq, "was dropped without release (its array() view too)")
            self._release(l, None)

    def _dropped(self, ref):
        """LeaseRef's callback: a lease was collected unreleased (the
        weakref.finalize-style backstop; Lease has no __del__). Never an
        exception here: it runs wherever the collector does."""
        try:
            if self._closed or ref.void:
                return
            with self._lock:
                if self._outstanding.get(ref.seq) is not ref:
                    return  # released, or voided, meanwhile
                del self._outstanding[ref.seq]
                self._leaked(ref.seq, "was garbage-collected without release")
                self._release_locked(ref.seq, ref.alloc, None)
        except Exception:
            pass

    def _leaked(self, seq, how):
        """Counts and reports a lease given back for an application that
        lost it: a log line and a ResourceWarning, as the Go package's."""
        with self._lock:
            self._stats["leaked"] += 1
        log.warning("cudashare: lease %d %s; releasing it", seq, how)
        try:
            # Never an exception here (warnings made errors would end a
            # next(), or the reader at a retire).
            warnings.warn("cudashare: lease %d %s; released now" % (seq, how), ResourceWarning, stacklevel=2)
        except Exception:
            pass

    # --- the lease's side of the consumer (_lease.py names them) ---

    def _pin(self, lease, pin):
        with self._lock:
            lease._pin_locked(pin)

    def _keep_view(self, lease, key, v, pin):
        """Caches array()'s view v of lease under key (one per key),
        within views' limits; returns the view to hand out."""
        with self._lock:
            cache = lease._a.views
            if cache is None:
                return v
            have = cache.get(key)
            if have is not None:
                # Another thread made this one first: one view per key.
                if have[1].lease is not lease:
                    lease._pin_locked(have[1])
                return have[0]
            if len(cache) < views.MAX_VIEWS and self._n_views < views.MAX_VIEWS_TOTAL and not lease.released:
                cache[key] = (v, pin)
                self._n_views += 1
                lease._pin_locked(pin)  # registered, so that the release unpins
        return v

    def _wait_event(self, ev, stream):
        self._backend.wait_event(ev, stream)

    def _sync_event(self, ev):
        self._backend.sync_event(ev)

    def _copy_to_host(self, ptr, n):
        return self._backend.copy_to_host(ptr, n)
