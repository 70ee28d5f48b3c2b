"""The consumer's releases: host-ordered and stream-ordered (with one
release event per stream), queued and pushed together as PROTOCOL.md §4
allows. A mixin of Consumer, whose state (_consumer.py) it shares; split out
by idea, not to be used alone."""

import logging
import time
import warnings

from . import _backends as backends, _wire as wire
from ._views import orphans, unpin

log = logging.getLogger("cudashare")

MAX_RELEASE_STREAMS = 64   # streams with their own release event
REAP_EVERY = 0.01          # how often a waiting next() looks for leases lost with their views, credits to spare


class Releases:
    """Consumer's releases (see _consumer.py for the design)."""

    def _release(self, lease, stream):
        with self._lock:
            if lease.released:
                return
            lease.released = True
            ps = lease._pins
            if ps is not None:
                lease._pins = None
                unpin(lease, ps)  # array()'s cached views stop keeping it alive
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

    def _reap_orphans(self):
        """array()'s pins keep a lease from the garbage collector while the
        application may use its view; a lease the application dropped
        without release, whose view it dropped too, is found here (when
        next() would wait with every credit held, and at a retire) and
        released as the collector would have: counted leaked, with a
        warning. The caller holds _lock."""
        for l in orphans(self._outstanding):
            self._leaked(l, "was dropped without release (its array() view too)")
            try:
                # As Lease.__del__'s: never an exception here (warnings made
                # errors would end a next(), or the reader at a retire).
                warnings.warn("cudashare: lease %d was dropped without release (its array() view too); released "
                              "now" % l.seq, ResourceWarning, stacklevel=1)
            except Exception:
                pass

    def _leaked(self, lease, how="was garbage-collected without release"):
        with self._lock:
            self._stats["leaked"] += 1
        log.warning("cudashare: lease %d %s; releasing it", lease.seq, how)
        self._release(lease, None)
