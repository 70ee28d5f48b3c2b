"""A consumer that outlives its producer (connect(reconnect=...)): a Go
producer killed and started again at the same path, one restarted on
purpose (SIGHUP: its goodbye says it comes back), one that never comes
back, and a consumer started before any producer."""

import os
import signal
import subprocess
import threading
import time

import pytest

import cudashare
from conftest import producer_has_sharing


def again(p, gobin, *args):
    """Starts another producer at p's path, on p's simulated machine."""
    env = dict(os.environ, CUDASHARE_DRIVER="sim", CUDASHARE_SIM_DIR=os.path.join(p.dir, "sim"))
    p.p = subprocess.Popen([gobin, "producer", "-socket", p.path, "-json", *args],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    return p


def right(lease):
    want = lease.meta["batch"] % 251 + 1
    return bytes(lease.host()) == bytes([want]) * lease.size


@pytest.fixture
def vmm(gobin):
    if not producer_has_sharing(gobin):
        pytest.skip("this producer has no -sharing flag: no VMM offers to read data from on the simulator")


def test_reconnect_after_kill_and_restart(go_producer, gobin, vmm):
    args = ("-size", "64KiB", "-sharing", "vmm")
    p = go_producer(*args)
    c = cudashare.connect(p.path, backend="sim", wait=5, reconnect=30)
    try:
        first = c.producer["session"]
        assert first, "the Go producer names its session in its hello-ack"
        held = c.next(timeout=5)
        assert right(held)
        deadline = time.monotonic() + 10
        while c.stats()["offers"] < 4:  # offers queued when the producer dies: void, never returned
            assert time.monotonic() < deadline
            time.sleep(0.005)
        old = p.p
        p.kill()
        old.communicate(timeout=5)
        while c._c._end is None:  # its reader has seen the end: the queued offers are void
            assert time.monotonic() < deadline
            time.sleep(0.005)
        again(p, gobin, *args)
        # The new producer's batches: numbered from 0 again, right, and a
        # new session; the lease held across the kill still reads right
        # (its mapping keeps the memory).
        while True:
            l = c.next(timeout=20)
            if c.stats()["reconnects"] == 1:
                break
            assert right(l)  # queued before the kill, and returned before its end was seen
            l.release()
        assert l.meta["batch"] == 0 and right(l)
        assert c.producer["session"] not in (None, first)
        l.release()
        assert right(held)
        dropped = c.stats()["releases_dropped"]
        held.release()
        assert c.stats()["releases_dropped"] == dropped + 1
        for _ in range(20):
            with c.next(timeout=5) as l:
                assert right(l)
        assert not c._old, "the lost producer's connection outlived its last lease"
        # A restart on purpose: the goodbye says it comes back.
        p.p.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while c.stats()["reconnects"] < 2:
            assert time.monotonic() < deadline, "no reconnection after the producer's SIGHUP"
            with c.next(timeout=5) as l:
                assert right(l)
        for _ in range(20):
            with c.next(timeout=5) as l:
                assert right(l)
    finally:
        c.close()
    p.kill(signal.SIGINT)
    rep, code = p.wait()
    assert code == 0 and rep["restarts"] == 1, p.err


def test_restart_without_reconnect(go_producer):
    p = go_producer("-size", "64KiB")
    with cudashare.connect(p.path, backend="sim", wait=5) as c:
        c.next(timeout=5).release()
        p.p.send_signal(signal.SIGHUP)
        with pytest.raises(cudashare.ProducerRestarting):
            for _ in range(1000):
                c.next(timeout=10).release()


def test_reconnect_deadline(go_producer):
    p = go_producer("-size", "64KiB")
    with cudashare.connect(p.path, backend="sim", wait=5, reconnect=0.3) as c:
        c.next(timeout=5).release()
        p.kill()
        with pytest.raises(cudashare.ReconnectDeadline) as e:
            for _ in range(1000):
                c.next(timeout=10).release()
        assert isinstance(e.value, cudashare.ProducerGone)


def test_consumer_before_the_producer(go_producer, gobin, tmp_path):
    p = go_producer("-size", "64KiB")
    p.kill()
    p.p.communicate(timeout=5)
    os.unlink(p.path)
    got = []

    def consume():
        with cudashare.connect(p.path, backend="sim", reconnect=30) as c:
            got.append(c.next(timeout=10).meta["batch"])
    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.05)  # not a timing: only likelier that the consumer waits first
    again(p, gobin, "-size", "64KiB")
    t.join(30)
    assert got == [0]
