"""A consumer that outlives its producer: connect(..., reconnect=...).

Each connection is a Consumer of its own (_consumer.py), for one producer
session (PROTOCOL.md §4 hello, §7.2): when the producer vanishes, or says goodbye
because it restarts, the connection ends as it always did, and this
wrapper dials the path again, with backoff, until a producer answers or
the deadline passes. A new producer's allocation ids and sequence numbers
start again; the new Consumer has its own allocation table, so nothing of
the old session is ever taken for the new one. The old Consumer stays
until the application has released its last lease of it (each mapping is
closed with its last lease), then is torn down.
"""

import threading
import time
from typing import Optional

from ._consumer import Consumer
from ._errors import Closed, CudashareError, ProducerGone, ReconnectDeadline, Timeout


class ReconnectPolicy:
    """How a consumer reconnects. deadline: seconds to try, from the loss
    of a producer (None or 0: no deadline, until close()). min_backoff:
    the wait after the first failed try (the first is at once), doubling
    up to max_backoff."""

    def __init__(self, deadline: Optional[float] = None, min_backoff: float = 0.01, max_backoff: float = 0.5) -> None:
        if deadline is not None and deadline < 0 or min_backoff <= 0 or max_backoff < min_backoff:
            raise ValueError("reconnect: deadline >= 0, 0 < min_backoff <= max_backoff")
        self.deadline = deadline or None
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff


class Reconnecting:
    """What connect(..., reconnect=...) returns: a Consumer's interface
    (next, iteration, run, stats, close, the context manager) over the
    connections to each producer in turn."""

    def __init__(self, first, dial, policy, path):
        self.path = path
        self._dial = dial
        self._policy = policy
        self._c = first          # the current connection; None while reconnecting
        self._old = []           # connections of producers gone that leases are still in
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closing = threading.Event()
        self._end = None         # the error that ended it: no producer came back
        self._closed = False
        self._thread = None
        self.reconnects = 0
        self._dropped = 0        # releases of leases of producers gone, torn down since
        self._last = first       # for producer, backend, ... while reconnecting

    # The current connection's description.
    @property
    def producer(self):
        return self._last.producer

    @property
    def backend(self):
        return self._last.backend

    @property
    def backend_reason(self):
        return self._last.backend_reason

    @property
    def device_uuid(self):
        return self._last.device_uuid

    @property
    def shm_reason(self):
        return self._last.shm_reason

    def next(self, timeout=None):
        """Consumer.next, across producers: a lost producer's queued leases
        are never returned; while reconnecting it waits (up to timeout)
        for the next producer's first lease."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self._reap_locked()
                if self._closed:
                    raise Closed("this consumer is closed")
                if self._end is not None:
                    raise self._end
                c = self._c
                if c is None:
                    left = 0.1 if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        raise Timeout("no offer within %.3gs (reconnecting to %s)" % (timeout, self.path))
                    self._cond.wait(min(left, 0.1))
                    continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return c.next(timeout=left)
            except ProducerGone as e:  # vanished, or restarting
                self._lost(c, e)

    def __iter__(self):
        while True:
            try:
                yield self.next()
            except Closed:
                return

    run = Consumer.run  # over self.next
    next_many = Consumer.next_many  # over self.next, then the lease's connection's queue
    release_many = Consumer.release_many  # each lease to its own connection

    def _lost(self, c, cause):
        with self._lock:
            if self._c is not c or self._closed:
                return
            self._c = None
            c._set_apart()
            # Its leases still held: their releases go nowhere.
            c._held_at_loss = len(c._outstanding)
            self._old.append(c)
            self._reap_locked()
            self._thread = threading.Thread(target=self._reconnect, args=(cause,),
                                            name="cudashare-reconnect %s" % self.path, daemon=True)
            self._thread.start()

    def _reconnect(self, cause):
        pol = self._policy
        start = time.monotonic()
        backoff = pol.min_backoff
        tries = 0
        last = cause
        while not self._closing.is_set():
            tries += 1
            try:
                c = self._dial(0.0)
            except (OSError, CudashareError) as e:
                last = e
            else:
                with self._lock:
                    if self._closed:
                        c.close(timeout=0.5)
                        return
                    self._c = self._last = c
                    self.reconnects += 1
                    self._cond.notify_all()
                return
            if pol.deadline is not None and time.monotonic() - start >= pol.deadline:
                with self._lock:
                    self._end = ReconnectDeadline("the producer at %s went away (%s), and none came back within "
                                                  "%.3gs (%d tries; last: %s)" % (self.path, cause, pol.deadline,
                                                                                 tries, last))
                    self._cond.notify_all()
                return
            wait = backoff
            if pol.deadline is not None:
                wait = max(0.0, min(wait, start + pol.deadline - time.monotonic()))
            self._closing.wait(wait)
            backoff = min(2 * backoff, pol.max_backoff)

    def _reap_locked(self):
        """Tears down the connections of producers gone whose leases are
        all released."""
        if self._old:
            keep = []
            for c in self._old:
                if c._outstanding:
                    keep.append(c)
                else:
                    self._dropped += c._held_at_loss
                    c.close(timeout=0.0)
            self._old = keep

    def grant(self, n):
        with self._lock:
            c = self._c
        if c is None:
            raise ProducerGone("reconnecting to %s" % self.path)
        c.grant(n)

    def stats(self):
        """The current connection's counters, with reconnects and
        releases_dropped (releases of leases whose producer was gone: they
        went nowhere)."""
        d = self._last.stats()
        with self._lock:
            d["reconnects"] = self.reconnects
            d["releases_dropped"] = self._dropped + sum(c._held_at_loss - len(c._outstanding) for c in self._old)
        return d

    def close(self, timeout=5.0, reason="consumer closed"):
        """Closes the current connection (goodbye) and the old ones;
        idempotent. A reconnection under way gives up."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing.set()
            self._cond.notify_all()
            c, old, self._old = self._c, self._old, []
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        with self._lock:
            c = self._c  # one the thread installed before it saw the close
        for o in old:
            o.close(timeout=0.0)
        if c is not None:
            c.close(timeout=timeout, reason=reason)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
