"""The consumer against a Python fake producer: the vmm data path in
the simulator's memfd layout, views, and every kind of hostile input. A
hostile producer must get an error (with the right code), never a hang or
unbounded memory, and every descriptor it sent must be closed."""

import ctypes
import fcntl
import gc
import os
import socket
import threading
import time
import warnings

import pytest

import cudashare
from cudashare import _errors as E
from conftest import connected
from fakeproducer import sim_memfd

MiB2 = 1 << 21


def nest(n):
    v = 1
    for _ in range(n):
        v = [v]
    return v


def expect_error(f, c, code):
    """The consumer fails with code and tells the producer so."""
    held = []  # what came before the fault is valid; held, so credits stay used
    with pytest.raises(cudashare.ProtocolError) as ei:
        for _ in range(8):
            held.append(c.next(timeout=5))
    assert ei.value.code == code, ei.value
    for l in held:
        l.release()
    m = f.recv_until(9)
    assert m is not None and m[1] == code, m
    c.close(timeout=0.5)


def test_vmm_data_views_and_retire(fake):
    f, c = connected(fake)
    fd = sim_memfd(MiB2, 7)
    f.offer(1, size=4096, offset=8192, kind=1, nfds=1, fds=[fd], meta={"dtype": "float32", "shape": [2, 512]})
    os.close(fd)
    f.offer(2, size=4096, offset=0, kind=1, meta={"batch": -3})  # later offers carry no fd
    a, b = c.next(timeout=5), c.next(timeout=5)
    assert bytes(a.host()) == b"\x07" * 4096 and a.read(4) == b"\x07" * 4
    assert a.view() == ("float32", (2, 512))
    assert a.__dlpack_device__() == (1, 0)
    assert a.__array_interface__["shape"] == (2, 512) and a.__array_interface__["typestr"] == "<f4"
    cap = a.__dlpack__()
    assert type(cap).__name__ == "PyCapsule"
    del cap
    gc.collect()
    assert cudashare._dlpack.live() == 0
    # Writes through one view show in the other: one mapping, cached by alloc_id.
    a.host()[0] = 9
    assert b.ptr == a.ptr - 8192 and ctypes.string_at(b.ptr + 8192, 1) == b"\x09"
    assert b.meta == {"batch": -3}  # negative integers are the application's (§2.1)
    assert c.stats()["mappings"] == 1
    f.send([5, 1])  # retire while both are held: no closed yet
    a.release()
    assert f.recv_until(4) == [4, [1]]
    b.release()
    b.release()  # idempotent
    assert f.recv_until(4) == [4, [2]]
    assert f.recv_until(6) == [6, 1]  # closed, once no lease is left
    with pytest.raises(cudashare.Closed):
        b.host()
    c.close(timeout=0.5)
    assert f.recv_until(8)[0] == 8
    assert f.recv() is None  # the consumer half-closed after its goodbye


def test_view_errors_leave_the_lease_releasable(fake):
    f, c = connected(fake)
    fd = sim_memfd(MiB2, 1)
    f.offer(1, size=64, kind=1, nfds=1, fds=[fd], meta={"dtype": "float64", "shape": [9]})
    os.close(fd)
    f.offer(2, size=64, kind=1, meta={"dtype": "float128"})
    for _ in range(2):
        with c.next(timeout=5) as l:
            with pytest.raises(cudashare.ViewError):
                l.__dlpack__()
    assert f.recv_until(4) == [4, [1]] and f.recv_until(4) == [4, [2]]
    c.close(timeout=0.5)


def test_legacy_ipc_on_sim_has_no_data(fake):
    f, c = connected(fake)
    f.offer(1)
    l = c.next(timeout=5)
    with pytest.raises(cudashare.NotSupported, match="not reachable"):
        l.read(1)
    l.release()
    assert f.recv_until(4) == [4, [1]]
    c.close(timeout=0.5)


def test_gc_releases_and_counts(fake):
    f, c = connected(fake)
    f.offer(1)
    l = c.next(timeout=5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del l
        gc.collect()
    assert any("garbage-collected" in str(x.message) for x in w)
    assert c.stats()["leaked"] == 1
    assert f.recv_until(4) == [4, [1]]
    c.close(timeout=0.5)


def test_producer_goodbye_then_eof(fake):
    f, c = connected(fake)
    f.offer(1)
    f.send([8, "done"])
    f.conn.shutdown(socket.SHUT_WR)
    l = c.next(timeout=5)  # what came before the goodbye is still delivered
    l.release()
    with pytest.raises(cudashare.Closed):
        c.next(timeout=5)
    assert list(c) == []
    c.close(timeout=0.5)


def test_close_says_goodbye_and_voids_held_leases(fake):
    f, c = connected(fake)
    f.offer(1)
    l = c.next(timeout=5)
    c.close(timeout=0.5)
    c.close()  # idempotent
    assert f.recv_until(4) == [4, [1]]
    assert f.recv_until(8)[0] == 8
    assert f.recv() is None
    with pytest.raises(cudashare.Closed):
        l.ptr


@pytest.mark.parametrize("name,send,code", [
    ("huge frame", lambda f: f.raw(b"\xff\xff\xff\xff"), E.FRAME_TOO_LARGE),
    ("zero frame", lambda f: f.raw(b"\0\0\0\0"), E.MALFORMED),
    ("byte 0xc1", lambda f: f.raw(b"\0\0\0\x01\xc1"), E.MALFORMED),
    ("bytes after the value", lambda f: f.raw(b"\0\0\0\x03\x91\x05\x05"), E.MALFORMED),
    ("not an array", lambda f: f.raw(b"\0\0\0\x01\x05"), E.MALFORMED),
    ("ext type", lambda f: f.raw(b"\0\0\0\x04\x92\x05\xd4\x01"), E.MALFORMED),
    ("declared array longer than the body", lambda f: f.raw(b"\0\0\0\x05\xdd\xff\xff\xff\xff"), E.MALFORMED),
    ("deep nesting", lambda f: f.send([5, 1, nest(18)]), E.MALFORMED),
    ("non-str map key", lambda f: f.send([5, 1, {1: 2}]), E.MALFORMED),
    ("negative alloc_id", lambda f: f.send([5, -1]), E.MALFORMED),
    ("unknown kind", lambda f: f.send([42]), E.UNKNOWN_MESSAGE),
    ("release from a producer", lambda f: f.send([4, [1]]), E.UNEXPECTED_MESSAGE),
    ("hello after the handshake", lambda f: f.send([1, 1, 1, 1, bytes(16), [], 0, 0]), E.UNEXPECTED_MESSAGE),
    ("offers beyond credits", lambda f: [f.offer(s) for s in range(1, 4)], E.CREDIT),
    ("duplicate seq", lambda f: [f.offer(1), f.offer(1)], E.UNEXPECTED_MESSAGE),
    ("offset beyond alloc", lambda f: f.offer(1, offset=1 << 21, size=1), E.MALFORMED),
    ("short handle", lambda f: f.offer(1, handle=b"x"), E.MALFORMED),
    ("meta too large", lambda f: f.offer(1, meta="x" * 5000), E.MALFORMED),
    ("fabric handle", lambda f: f.offer(1, kind=2), E.NOT_SUPPORTED),
    ("unknown handle kind", lambda f: f.offer(1, kind=7), E.NOT_SUPPORTED),
    ("vmm without fd", lambda f: f.offer(1, kind=1), E.MALFORMED),
    ("nfds without fds", lambda f: f.offer(1, kind=1, nfds=1), E.MALFORMED),
])
def test_hostile_input(fake, name, send, code):
    f, c = connected(fake, credits=2)
    send(f)
    expect_error(f, c, code)


def test_message_after_goodbye(fake):
    f, c = connected(fake)
    f.send([8, "bye"])
    f.send([5, 1])
    m = f.recv_until(9)  # next() may say Closed first: the goodbye came before the fault
    assert m is not None and m[1] == E.UNEXPECTED_MESSAGE, m
    with pytest.raises((cudashare.Closed, cudashare.ProtocolError)):
        c.next(timeout=5)
    c.close(timeout=0.5)


def test_descriptor_flood_is_closed(fake):
    f, c = connected(fake)
    fds = [sim_memfd(4096, 1) for _ in range(6)]
    f.offer(1, kind=1, nfds=1, fds=fds)  # more than 4 in one message
    for fd in fds:
        os.close(fd)
    expect_error(f, c, E.MALFORMED)


def test_unclaimed_descriptors_are_closed(fake):
    f, c = connected(fake)
    fd = sim_memfd(4096, 1)
    f.send([5, 1], fds=[fd, fd])  # a retire carries two: nothing claims them
    os.close(fd)
    expect_error(f, c, E.MALFORMED)


def test_fd_that_is_not_an_allocation(fake):
    f, c = connected(fake)
    r, w = os.pipe()
    f.offer(1, kind=1, nfds=1, fds=[r])
    os.close(r)
    os.close(w)
    expect_error(f, c, E.INTERNAL)


@pytest.mark.parametrize("bad, why", [
    ({"seals": 0}, "not sealed against shrinking and growing"),
    ({"seals": fcntl.F_SEAL_SHRINK}, "not sealed against shrinking and growing"),
    ({"seals": fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL}, "not sealed against shrinking and growing"),
    ({"seals": fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE}, "sealed against writing"),
    ({"length": 4096 + MiB2 + 4096}, "the memfd has"),
    ({"length": 4096 + MiB2 // 2}, "the memfd has"),
])
def test_sim_memfd_that_could_be_resized_is_refused(fake, bad, why):
    """A memfd of the simulator's layout that its sender could still shrink
    under the mapping (a SIGBUS at the next read), or of the wrong size, is
    refused before it is mapped: error 10 naming the cause, to the user
    and to the producer (PROTOCOL.md §4.1.1)."""
    f, c = connected(fake)
    fd = sim_memfd(MiB2, 1, **bad)
    f.offer(1, size=4096, kind=1, nfds=1, fds=[fd])
    with pytest.raises(cudashare.ProtocolError) as ei:
        c.next(timeout=5)
    assert ei.value.code == E.INTERNAL and why in str(ei.value), ei.value
    m = f.recv_until(9)
    assert m is not None and m[1] == E.INTERNAL and why in m[2], m
    if not bad.get("seals", fcntl.F_SEAL_SHRINK) & fcntl.F_SEAL_SHRINK:
        os.ftruncate(fd, 0)  # what a hostile producer would do next: nothing maps it
    os.close(fd)
    c.close(timeout=0.5)


def test_half_frame_times_out(fake):
    f, c = connected(fake, frame_timeout=0.3)
    f.raw(b"\0\0\x01\0\x93")
    t0 = time.monotonic()
    expect_error(f, c, E.TIMEOUT)
    assert time.monotonic() - t0 < 5


def test_producer_error_is_reported(fake):
    f, c = connected(fake)
    f.send([9, 11, "lease held too long"])
    with pytest.raises(cudashare.ProtocolError) as ei:
        c.next(timeout=5)
    assert ei.value.remote and ei.value.code == E.TIMEOUT and "held too long" in str(ei.value)
    c.close(timeout=0.5)


def test_handshake_timeout_and_refusal(fake):
    f = fake()
    with pytest.raises(cudashare.Timeout):
        cudashare.connect(f.path, backend="sim", timeout=0.3)
    f.conn, _ = f.lsock.accept()
    f.conn.close()
    f2 = fake()

    def refuse():
        f2.lsock.settimeout(5)
        f2.conn, _ = f2.lsock.accept()
        f2.conn.settimeout(5)
        f2.recv()
        f2.send([9, 12, "too many connections"])
    import threading
    t = threading.Thread(target=refuse)
    t.start()
    with pytest.raises(cudashare.ProtocolError) as ei:
        cudashare.connect(f2.path, backend="sim")
    t.join()
    assert ei.value.code == E.LIMIT and ei.value.remote


def test_refusal_before_the_hello(fake, monkeypatch):
    """A listener that refuses at once (another user, a limit) writes its
    error and closes before this side's hello is written: the write fails
    with EPIPE, and connect must still raise the listener's reason (it
    used to raise BrokenPipeError)."""
    f = fake()
    refused = threading.Event()

    def refuse():
        f.lsock.settimeout(5)
        f.conn, _ = f.lsock.accept()
        f.send([9, 2, "uid 4242 is not allowed"])
        f.conn.close()
        refused.set()
    t = threading.Thread(target=refuse)
    t.start()
    orig = cudashare._consumer.Consumer._send

    def late_send(self, msg):
        refused.wait(5)  # the listener has refused and closed
        return orig(self, msg)
    monkeypatch.setattr(cudashare._consumer.Consumer, "_send", late_send)
    with pytest.raises(cudashare.ProtocolError) as ei:
        cudashare.connect(f.path, backend="sim")
    t.join()
    assert ei.value.code == E.PEER_REFUSED and ei.value.remote and "not allowed" in str(ei.value)


def test_run_with_workers(fake):
    f, c = connected(fake, credits=4)
    got = []
    for s in range(1, 5):
        f.offer(s)
    f.send([8, "done"])
    f.conn.shutdown(socket.SHUT_WR)
    assert c.run(lambda l: got.append(l.seq), workers=3) == 4
    assert sorted(got) == [1, 2, 3, 4]
    c.close(timeout=0.5)


def test_offers_read_with_the_hello_ack(fake):
    """Messages that arrive in the same read as the hello-ack are handled
    at once, not when the next bytes arrive (they may never)."""
    f = fake()
    f.lsock.settimeout(5)

    def serve():
        f.conn, _ = f.lsock.accept()
        f.conn.settimeout(5)
        f.hello = f.recv()
        from fakeproducer import frame
        f.raw(frame([2, 1, 1, os.getpid(), os.urandom(16), [], 0, 0]) + frame(
            [3, 1, 1, 1, bytes(64), 4096, 0, 4096, bytes(16), None, None, 0]))
    import threading
    t = threading.Thread(target=serve)
    t.start()
    c = cudashare.connect(f.path, backend="sim", frame_timeout=0.5)
    t.join()
    time.sleep(1)  # past the frame timeout: a buffered whole frame is no half frame
    c.next(timeout=1).release()
    c.close(timeout=0.5)


def test_offer_with_fd_read_with_the_hello_ack(fake):
    """The first offer's descriptor may arrive in the handshake's read,
    together with the hello-ack (the Go producer offers as soon as the
    consumer is connected): it is the offer's, not a protocol error."""
    f = fake()
    f.lsock.settimeout(5)
    fd = sim_memfd(MiB2, 9)

    def serve():
        f.conn, _ = f.lsock.accept()
        f.conn.settimeout(5)
        f.hello = f.recv()
        from fakeproducer import frame
        offer = [3, 1, 1, 1, (1).to_bytes(8, "little") + bytes(56), MiB2, 0, 4096, b"\xaa" * 16, None, None, 1, 1]
        f.raw(frame([2, 1, 1, os.getpid(), os.urandom(16), [], 1, 0]) + frame(offer), fds=[fd])
    import threading
    t = threading.Thread(target=serve)
    t.start()
    c = cudashare.connect(f.path, backend="sim")
    t.join()
    os.close(fd)
    l = c.next(timeout=5)
    assert bytes(l.host()[:4]) == b"\x09" * 4
    l.release()
    c.close(timeout=0.5)


def test_offer_after_writer_side_end_is_void(fake):
    """A write that fails (a write timeout) ends the connection from the
    writing thread while the reader reads on: an offer read after that is
    void, neither handed out nor reported as a lease the application
    leaked when it is collected."""
    import gc
    import warnings
    from cudashare import ProducerGone
    f, c = connected(fake, wait=5)
    f.offer(1, size=4096)
    l = c.next(timeout=5)
    # What _send_quiet_frames does when a write times out.
    c._finish(ProducerGone("write to %s failed: timed out" % f.path))
    f.offer(2, size=4096)
    f.send([8, "bye"])  # a goodbye after it: offer 2 was read once this is
    deadline = time.monotonic() + 10
    while not c._bye_received and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert c._bye_received, "the reader did not read on"
        with pytest.raises(ProducerGone):
            c.next(timeout=1)
        assert c.stats()["offers"] == 1, c.stats()
    finally:
        l.release()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        c.close(timeout=0.5)
        del c, l
        gc.collect()
    leaked = [str(x.message) for x in w if "garbage-collected" in str(x.message)]
    assert not leaked, leaked
