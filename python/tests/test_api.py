"""The package's face: its public names, connect's keyword-only options and
default path (Go's share.DefaultSocketPath), the stream kinds release()
takes (each framework's shape, as small fake classes: none of the
frameworks is installed here), and grouped leases (next_many,
release_many)."""

import gc
import os
import warnings

import pytest

import cudashare
from cudashare import _backends as backends
from conftest import connected
from fakeproducer import sim_memfd

MiB2 = 1 << 21


def test_public_names_and_private_modules():
    for name in ("connect", "Consumer", "Lease", "ReconnectPolicy", "CudashareError", "ProtocolError",
                 "ProducerGone", "Closed", "Timeout", "NotSupported", "ViewError", "DriverError",
                 "default_socket_path", "__version__"):
        assert hasattr(cudashare, name), name
    assert set(cudashare.__all__) <= set(dir(cudashare))
    # The implementation is private: no public module but __main__.
    pkg = os.path.dirname(cudashare.__file__)
    public = [f for f in os.listdir(pkg) if f.endswith(".py") and not f.startswith("_")]
    assert public == [], public
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    # A Lease is no Offer subclass: its own class, the offer parsed into it.
    assert cudashare.Lease.__mro__ == (cudashare.Lease, object)


def test_connect_options_are_keyword_only(tmp_path):
    with pytest.raises(TypeError):
        cudashare.connect(str(tmp_path / "s"), 0)  # device given by position


def test_default_socket_path_is_gos(monkeypatch):
    """share.DefaultSocketPath: $XDG_RUNTIME_DIR/cudashare/cudashare.sock
    where it is absolute, else os.TempDir()/cudashare-$UID/cudashare.sock
    (os.TempDir: $TMPDIR, else /tmp)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/42")
    assert cudashare.default_socket_path() == "/run/user/42/cudashare/cudashare.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/dir")
    monkeypatch.delenv("TMPDIR", raising=False)
    assert cudashare.default_socket_path() == "/tmp/cudashare-%d/cudashare.sock" % os.getuid()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("TMPDIR", "/var/tmp/x")
    assert cudashare.default_socket_path() == "/var/tmp/x/cudashare-%d/cudashare.sock" % os.getuid()


def test_connect_without_path_dials_the_default(monkeypatch, tmp_path):
    """No path: the listener at default_socket_path() gets the connection
    (it says nothing, so the handshake times out)."""
    import socket
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    os.mkdir(tmp_path / "cudashare")
    ln = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ln.bind(str(tmp_path / "cudashare" / "cudashare.sock"))
    ln.listen(1)
    try:
        with pytest.raises(cudashare.Timeout):
            cudashare.connect(backend="sim", timeout=0.2)
        ln.settimeout(1)
        conn, _ = ln.accept()
        conn.close()
    finally:
        ln.close()


# The stream shapes of the frameworks, as they expose them.

class TorchStream:          # torch.cuda.Stream
    cuda_stream = 0x7001


class CupyStream:           # cupy.cuda.Stream
    ptr = 0x7002


class CUstream:             # cuda.bindings' CUstream: int() of it is the handle
    def __init__(self, v):
        self.v = v

    def __int__(self):
        return self.v


class CudaCoreStream:       # cuda.core's Stream: the protocol, and a CUstream handle
    handle = CUstream(0x7003)

    def __cuda_stream__(self):
        return (0, int(self.handle))


class ProtocolOnly:         # any object with the CUDA stream protocol
    def __cuda_stream__(self):
        return (0, 0x7004)


class HandleOnly:           # cuda.core's Stream seen only through .handle
    handle = CUstream(0x7005)


class NumbaStream:          # numba.cuda's stream: handle is a ctypes c_void_p
    def __init__(self, v):
        import ctypes
        self.handle = ctypes.c_void_p(v)


def test_stream_kinds():
    sh = backends.stream_handle
    assert sh(None) == 0
    assert sh(0x7000) == 0x7000
    assert sh(TorchStream()) == 0x7001
    assert sh(CupyStream()) == 0x7002
    assert sh(CudaCoreStream()) == 0x7003
    assert sh(ProtocolOnly()) == 0x7004
    assert sh(HandleOnly()) == 0x7005
    assert sh(NumbaStream(0x7006)) == 0x7006
    assert sh(NumbaStream(None)) == 0  # ctypes' NULL: the legacy default stream


@pytest.mark.parametrize("bad", [True, "7", 7.0, object(), type("S", (), {"handle": "x"})(),
                                 type("P", (), {"__cuda_stream__": lambda self: 7})()])
def test_stream_refused(bad):
    with pytest.raises(TypeError):
        backends.stream_handle(bad)


class Ordering:
    """The sim backend as a GPU backend that records release events."""

    on_host = False

    def __init__(self, b):
        self.b = b
        self.records = []
        self.n_events = 0

    def __getattr__(self, name):
        return getattr(self.b, name)

    def new_release_event(self):
        self.n_events += 1
        return (0xE0 + self.n_events, bytes([self.n_events]) * 64)

    def record(self, ev, stream):
        self.records.append((ev, stream))

    def sync_event(self, ev):
        pass


def gpu_like(c):
    """Makes c's releases stream-ordered on the simulator."""
    rec = c._backend = Ordering(c._backend)
    c._on_host = False
    c._rel_events_ok = True
    return rec


@pytest.mark.parametrize("stream,handle", [(CudaCoreStream(), 0x7003), (TorchStream(), 0x7001),
                                          (CupyStream(), 0x7002), (ProtocolOnly(), 0x7004), (0x7000, 0x7000)])
def test_release_takes_each_stream_kind(fake, stream, handle):
    f, c = connected(fake, credits=1)
    rec = gpu_like(c)
    fd = sim_memfd(MiB2, 3)
    f.offer(1, size=4096, kind=1, nfds=1, fds=[fd])
    os.close(fd)
    c.next(timeout=5).release(stream=stream)
    assert rec.records == [(0xE1, handle)]
    m = f.recv_until(4)
    assert m == [4, [1], b"\x01" * 64], m  # ordered after the event recorded on that stream
    c.close(timeout=0.5)


def offer_n(f, n, first=1):
    fd = sim_memfd(MiB2, 5)
    for i in range(n):
        seq = first + i
        if seq == 1:
            f.offer(seq, size=4096, offset=4096 * i, kind=1, nfds=1, fds=[fd])
        else:
            f.offer(seq, size=4096, offset=4096 * i, kind=1)
    os.close(fd)


def wait_queued(c, n):
    for _ in range(500):
        if len(c._queue) >= n:
            return
        import time
        time.sleep(0.01)


def test_next_many_and_release_many_one_message(fake):
    f, c = connected(fake, credits=8)
    rec = gpu_like(c)
    offer_n(f, 6)
    wait_queued(c, 1)
    got = c.next_many(4, timeout=5)
    assert 1 <= len(got) <= 4 and [l.seq for l in got] == list(range(1, len(got) + 1))
    while len(got) < 6:
        got += c.next_many(6 - len(got), timeout=5)
    assert [l.seq for l in got] == [1, 2, 3, 4, 5, 6]
    assert c.stats()["handoffs"] == 6
    before = c.stats()["release_messages"]
    c.release_many(got, stream=TorchStream())
    assert all(l.released for l in got)
    # One event record for the group, one release message naming it.
    assert rec.records == [(0xE1, 0x7001)]
    assert f.recv_until(4) == [4, [1, 2, 3, 4, 5, 6], b"\x01" * 64]
    s = c.stats()
    assert s["release_messages"] == before + 1 and s["releases"] == 6 and s["ordered_releases"] == 6
    c.release_many(got)  # idempotent: nothing left to release
    got[0].release()
    assert c.stats()["releases"] == 6
    c.close(timeout=0.5)


def test_next_many_takes_only_whats_queued(fake):
    """It waits for the first lease only: with two queued, it returns two."""
    f, c = connected(fake, credits=8)
    offer_n(f, 2)
    wait_queued(c, 2)
    got = c.next_many(8, timeout=5)
    assert [l.seq for l in got] == [1, 2]
    with pytest.raises(cudashare.Timeout):
        c.next_many(8, timeout=0.05)
    with pytest.raises(ValueError):
        c.next_many(0)
    c.release_many(got)  # host-ordered: one message without an event
    assert f.recv_until(4) == [4, [1, 2]]
    c.close(timeout=0.5)


def test_release_many_with_a_retired_allocation(fake):
    """The group's last lease of a retired allocation closes it after the
    releases that came before it."""
    f, c = connected(fake, credits=8)
    offer_n(f, 3)
    wait_queued(c, 3)
    got = c.next_many(3, timeout=5)
    assert len(got) == 3
    f.send([5, 1])  # retire
    import time
    for _ in range(200):
        if c.stats().get("retired"):
            break
        time.sleep(0.01)
    c.release_many(got)
    assert f.recv_until(4) == [4, [1, 2, 3]]
    assert f.recv_until(6) == [6, 1]
    c.close(timeout=0.5)


def test_dropped_lease_released_by_its_weakref(fake):
    """The backstop (no __del__): a lease dropped unreleased is released
    when collected, counted leaked, with a ResourceWarning; one voided with
    the connection is no leak."""
    f, c = connected(fake, credits=2)
    offer_n(f, 1)
    l = c.next(timeout=5)
    assert not hasattr(type(l), "__del__")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        del l
        gc.collect()
    assert c.stats()["leaked"] == 1 and c.stats()["releases"] == 1
    assert any(issubclass(g.category, ResourceWarning) for g in got)
    assert f.recv_until(4) == [4, [1]]
    c.close(timeout=0.5)
