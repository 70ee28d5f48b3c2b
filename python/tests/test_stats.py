"""Consumer.stats(): what an operator asks of a consumer now, against the
Python fake producer: leases held, allocations mapped and their bytes,
time waited in next(), and the message path."""

import os

import pytest

import cudashare
from conftest import connected
from fakeproducer import sim_memfd

MiB2 = 1 << 21


def test_stats_held_mapped_waited(fake):
    f, c = connected(fake)
    s = c.stats()
    assert s["held"] == 0 and s["mapped"] == 0 and s["mapped_bytes"] == 0
    assert s["path"] in ("shm", "socket") and s["wait_seconds"] == 0
    # Nothing offered: next() waits, and says so.
    with pytest.raises(cudashare.Timeout):
        c.next(timeout=0.05)
    waited = c.stats()["wait_seconds"]
    assert waited > 0
    fd = sim_memfd(MiB2, 7)
    f.offer(1, size=4096, offset=0, kind=1, nfds=1, fds=[fd])
    os.close(fd)
    f.offer(2, size=4096, offset=4096, kind=1)
    a, b = c.next(timeout=5), c.next(timeout=5)
    s = c.stats()
    assert s["held"] == 2 and s["mapped"] == 1 and s["mapped_bytes"] == MiB2, s
    assert s["handoffs"] == 2 and s["wait_seconds"] >= waited
    a.release()
    b.release()
    assert c.stats()["held"] == 0
    c.close(timeout=0.5)
