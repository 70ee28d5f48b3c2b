"""The shm channel (PROTOCOL.md 2.3) on the consumer's side: against
a fake producer that speaks them, honestly and not, and against the Go
producer with and without them. A producer that breaks the shm channel gets an
error on the socket, with the right code; the consumer never hangs, reads
or writes outside the segment, or keeps a descriptor."""

import fcntl
import os
import socket
import struct
import threading
import time

import pytest

import cudashare
from cudashare import _errors as E
from cudashare import _shm as shm
from conftest import connected
from fakeproducer import CAP_SHM, LANE, frame, sim_memfd

pytestmark = pytest.mark.skipif(not shm.available()[0], reason="no shm channel here: %s" % shm.available()[1])

MiB2 = 1 << 21


def shm_fake(fake, seg=None, **kw):
    f = fake(CAP_SHM, seg)
    t = f.serve()
    c = cudashare.connect(f.path, credits=kw.pop("credits", 4), backend="sim", shm=True, **kw)
    t.join(5)
    return f, c


def offer_fd(f, seq, fill=1):
    """Offers a fresh simulator allocation (its descriptor on a doorbell)."""
    fd = sim_memfd(MiB2, fill)
    try:
        f.offer(seq, size=4096, kind=1, nfds=1, fds=[fd])
    finally:
        os.close(fd)


def failed_with(f, c, code):
    """The consumer's next() fails with code, and the producer reads that
    error on its socket."""
    with pytest.raises(cudashare.ProtocolError) as ei:
        for _ in range(8):
            c.next(timeout=5).release()
    assert ei.value.code == code, ei.value
    m = f.recv_until(9)
    assert m is not None and m[1] == code, m
    c.close(timeout=0.5)
    return ei.value


def test_offers_releases_retire_goodbye_through_the_shm_channel(fake):
    f, c = shm_fake(fake)
    assert c.stats()["shm"] and f.mem is not None
    fd = sim_memfd(MiB2, 5)
    f.offer(1, size=4096, kind=1, nfds=1, fds=[fd])  # the descriptor on a doorbell, the offer in the lane
    os.close(fd)
    f.offer(2, size=4096, offset=4096, kind=1)
    a, b = c.next(timeout=5), c.next(timeout=5)
    assert bytes(a.host()) == b"\x05" * 4096 and b.ptr == a.ptr + 4096
    a.release()
    b.release()
    released = []
    while len(released) < 2:
        m = f.recv_until(4)
        assert m is not None and len(m) == 2, m  # host-ordered: no event
        released += m[1]
    assert released == [1, 2]
    f.send([5, 1])  # retire
    assert f.recv_until(6) == [6, 1]
    f.send([8, "done"])  # goodbye, in the lane
    with pytest.raises(cudashare.Closed):
        c.next(timeout=5)
    c.close(timeout=0.5)
    assert f.recv_until(8)[0] == 8
    assert f.recv() is None  # the consumer's socket ended after its goodbye


def test_goodbye_in_the_lane_then_close_with_doorbells_unread_is_a_clean_end(fake):
    """The producer sleeps on its socket (so the consumer rings doorbells it
    never reads), writes an offer and goodbye into the lane without a
    doorbell while the consumer sleeps on its socket, and closes: AF_UNIX
    reports that to the consumer as a reset, not end of stream. The lane is
    still read to its end, so the offer comes and the end is the goodbye,
    not a vanished producer."""
    f, c = shm_fake(fake, credits=1)
    struct.pack_into("<I", f.mem, 256 + 136, 1)  # lane 1's reader (the fake) sleeps
    offer_fd(f, 1)
    c.next(timeout=5).release()  # pushed at once (credits 1): into lane 1, and a doorbell
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if f.conn.recv(4, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                break
        except BlockingIOError:
            time.sleep(0.01)
    assert f.conn.recv(4, socket.MSG_PEEK) == b"\0\0\0\0"  # and it stays unread
    got = []

    def take():
        try:
            got.append(c.next(timeout=5).seq)  # the lane is empty: it sleeps on the socket
            c.next(timeout=5)
        except Exception as e:
            got.append(e)
    t = threading.Thread(target=take)
    t.start()
    time.sleep(0.3)
    f.lane_write(frame(offer_msg_2()), bell=False)
    f.lane_write(frame([8, "bye"]), bell=False)
    f.conn.close()
    f.conn = None
    t.join(10)
    assert got[0] == 2 and isinstance(got[1], cudashare.Closed) and not isinstance(got[1], cudashare.ProducerGone), got
    c.close(timeout=0.5)


def offer_msg_2():
    from fakeproducer import offer_msg
    return offer_msg(2, size=4096, kind=1)


@pytest.mark.parametrize("seg,why", [
    ({"size": 4096}, "segment"),
    # One the producer could shrink under the mapping: every later access would fault.
    ({"seals": fcntl.F_SEAL_GROW}, "sealed"),
])
def test_bad_segment_fails_the_handshake(fake, seg, why):
    f = fake(CAP_SHM, seg)
    t = f.serve()
    with pytest.raises(cudashare.ProtocolError) as ei:
        cudashare.connect(f.path, backend="sim", shm=True)
    t.join(5)
    assert ei.value.code == E.MALFORMED and why in str(ei.value)


def test_tail_beyond_the_lane_is_malformed(fake):
    f, c = shm_fake(fake)
    f.word(0, LANE + 1)  # more than a lane's worth ahead
    f.bell()
    failed_with(f, c, E.MALFORMED)


def test_tail_behind_what_was_read_is_malformed(fake):
    f, c = shm_fake(fake)
    offer_fd(f, 1)
    c.next(timeout=5).release()
    f.word(0, 1)  # backwards
    f.bell()
    failed_with(f, c, E.MALFORMED)


def test_head_moved_backwards_fails_the_release(fake):
    """The producer's word in lane 1: a head behind what it had read, or
    past what was written, could make the consumer overwrite unread bytes.
    The release does not raise; the connection fails, and next() says so."""
    f, c = shm_fake(fake, credits=1)
    offer_fd(f, 1)
    c.next(timeout=5).release()  # one release message in lane 1
    assert f.recv_until(4) == [4, [1]]
    f.offer(2, size=4096, kind=1)
    lease = c.next(timeout=5)
    f.word(256 + 128, 1 << 40)  # past what the consumer wrote
    lease.release()
    with pytest.raises(cudashare.ProtocolError) as ei:
        c.next(timeout=5)
    assert ei.value.code == E.MALFORMED and "head" in str(ei.value)
    m = f.recv_until(9)
    assert m is not None and m[1] == E.MALFORMED
    c.close(timeout=0.5)


def test_head_behind_what_was_read_fails_the_write(fake):
    f, c = shm_fake(fake)
    c.grant(1)
    assert f.recv() == [7, 1]   # the fake's head moves past it
    c.grant(1)                  # the consumer sees that head
    assert f.recv() == [7, 1]
    f.word(256 + 128, 0)        # backwards
    with pytest.raises(cudashare.ProtocolError) as ei:
        c.grant(1)
    assert ei.value.code == E.MALFORMED and "head" in str(ei.value)
    m = f.recv_until(9)
    assert m is not None and m[1] == E.MALFORMED
    c.close(timeout=0.5)


def test_write_timeout_bounds_the_whole_write(fake):
    """A producer that reads a byte now and then cannot stretch a write past
    the write timeout: it bounds the whole write, as sendall's does."""
    f, c = shm_fake(fake, write_timeout=0.5)
    while LANE - (c._out.pos - f.word(256 + 128)) > 64:  # fill lane 1, unread
        c.grant(1)
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.02):
            f.word(256 + 128, f.word(256 + 128) + 1)
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(OSError):
            c._send([8, "x" * 300])  # needs 300 bytes: 6 s at this pace
        took = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
    assert took < 3, took
    with pytest.raises(cudashare.ProducerGone):
        c.next(timeout=1)  # the connection ended with the failed write
    c.close(timeout=0.5)


def test_declared_descriptors_that_never_come_fail_in_bounded_time(fake):
    """An offer that declares a descriptor, then only doorbells: the search
    for it is bounded, and the offer is malformed."""
    f, c = shm_fake(fake)
    stop = threading.Event()

    def bells():
        while not stop.is_set():
            try:
                f.conn.sendall(b"\0\0\0\0" * 1024)
            except OSError:
                return
    f.lane_write(frame([3, 1, 1, 1, bytes(64), MiB2, 0, 4096, b"\xaa" * 16, None, None, 1, 1]), bell=False)
    t = threading.Thread(target=bells, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(cudashare.ProtocolError) as ei:
            c.next(timeout=5)
        assert time.monotonic() - t0 < 3
    finally:
        stop.set()
        t.join(5)
    assert ei.value.code == E.MALFORMED and "descriptor" in str(ei.value)
    c.close(timeout=0.5)


def test_close_unmaps_and_later_writes_fail(fake):
    def mapped():
        with open("/proc/self/maps") as m:
            return sum("cudashare-shm" in l for l in m)
    before = mapped()
    f, c = shm_fake(fake)
    assert mapped() == before + 2  # the fake's mapping and the consumer's
    c.close(timeout=0.5)
    assert mapped() == before + 1
    with pytest.raises(OSError):
        c.grant(1)


def test_writers_hold_the_consumer_lock(fake):
    """Every lane write runs with _lock held before _wlock: a leaked
    lease's finalizer that the garbage collector runs inside the write then
    takes _lock again in the same thread, instead of waiting for a thread
    that holds _lock and waits for _wlock (a deadlock)."""
    f, c = shm_fake(fake)
    out = c._out
    held = []

    class Watch:
        def write(self, b, off=0):
            held.append(c._lock._is_owned())
            return out.write(b, off)

        def asleep(self):
            return out.asleep()
    c._out = Watch()
    c.grant(1)                     # the application's write
    offer_fd(f, 1)
    c.next(timeout=5).release()    # a release, pushed by next() below or the tick
    with c._lock:
        c._push_locked()
    c._protocol_fail(cudashare.ProtocolError(E.MALFORMED, "test"))  # the error goes on the socket
    c._out = out
    assert held and all(held), held
    c.close(timeout=0.5)


def test_half_a_frame_in_the_lane_times_out(fake):
    f, c = shm_fake(fake, frame_timeout=0.5)
    f.lane_write(struct.pack(">I", 100) + b"\x93" * 10)
    t0 = time.monotonic()
    failed_with(f, c, E.TIMEOUT)
    assert time.monotonic() - t0 < 10


def test_zero_length_frame_in_the_lane_is_malformed(fake):
    """Doorbells are for the socket; in the lane a zero length is not a frame."""
    f, c = shm_fake(fake)
    f.lane_write(b"\0\0\0\0")
    failed_with(f, c, E.MALFORMED)


def test_descriptor_flood_on_doorbells_is_bounded(fake):
    """Descriptors may come before their offer, but no more than those of
    two offers wait; every one received is closed."""
    f, c = shm_fake(fake)
    for _ in range(3):
        fds = [sim_memfd(4096, 0) for _ in range(4)]
        f.bell(fds)
        for fd in fds:
            os.close(fd)
    failed_with(f, c, E.MALFORMED)


def test_offer_on_the_socket_of_a_shm_connection_is_unexpected(fake):
    f, c = shm_fake(fake)
    f.raw(frame([3, 1, 1, 1, bytes(64), MiB2, 0, 4096, b"\xaa" * 16, None, None, 0, 1]))
    failed_with(f, c, E.UNEXPECTED_MESSAGE)


def test_big_frame_on_the_socket_of_a_shm_connection_is_malformed(fake):
    """Only doorbells and errors go on the socket: a long frame there is
    refused from its header, before it is buffered."""
    f, c = shm_fake(fake)
    f.raw(struct.pack(">I", 1 << 20))
    failed_with(f, c, E.MALFORMED)


def test_error_on_the_socket_ends_the_connection(fake):
    f, c = shm_fake(fake)
    f.raw(frame([9, E.TIMEOUT, "you were too slow"]))
    with pytest.raises(cudashare.ProtocolError) as ei:
        c.next(timeout=5)
    assert ei.value.remote and ei.value.code == E.TIMEOUT and "too slow" in str(ei.value)
    c.close(timeout=0.5)


def test_shm_full_past_the_write_timeout(fake):
    """A producer that never reads lane 1: the consumer's writes wait the
    write timeout, as on a full socket, then fail, and it says why on the
    socket."""
    f, c = shm_fake(fake, write_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(OSError):
        for _ in range(LANE):  # about 6 bytes per credit message: the lane fills long before
            c.grant(1)
    assert time.monotonic() - t0 < 10
    m = f.recv_until(9)  # read from the socket: lane 1 is full of credits
    assert m is not None and m[1] == E.TIMEOUT, m
    c.close(timeout=0.5)


def test_shm_false_stays_on_the_socket(fake):
    f, c = connected(fake, caps=CAP_SHM, shm=False)
    assert not c.stats()["shm"] and f.mem is None and "not asked" in c.shm_reason
    c.close(timeout=0.5)


@pytest.mark.parametrize("env,want", [("", False), ("0", False), ("1", True)])
def test_shm_by_default_only_with_the_environment(fake, monkeypatch, env, want):
    """Not the default (_shm.py says why); CUDASHARE_SHM=1 makes them so."""
    monkeypatch.setenv("CUDASHARE_SHM", env)
    f, c = connected(fake, caps=CAP_SHM)
    assert c.stats()["shm"] == want and (f.mem is not None) == want
    c.close(timeout=0.5)


def test_go_producer_with_and_without_the_shm_channel(go_producer):
    for want in (True, False):
        p = go_producer("-count", "300", "-size", "64KiB", "-sharing", "vmm")
        with cudashare.connect(p.path, backend="sim", wait=5, shm=want) as c:
            assert c.stats()["shm"] == want
            n = 0
            for lease in c:
                with lease:
                    assert lease.meta["batch"] == n and lease.read(1)[0] == n % 251 + 1
                    n += 1
        rep, code = p.wait()
        assert n == 300 and code == 0 and rep["releases"] == 300 and rep["allocations_left"] == 0, p.err


def test_write_reentered_by_a_finalizer_does_not_interleave(fake):
    """The garbage collector may run a leaked lease's finalizer in the
    middle of a lane write, in the writing thread, and that release pushes
    a message: it goes after the frame being written, never inside it."""
    f, c = shm_fake(fake)
    out = c._out
    entered = []

    class Interrupted:
        def write(self, b, off=0):
            if not entered:
                entered.append(1)
                c._send_quiet([7, 5])  # what the finalizer's push would write
            return out.write(b, off)

        def asleep(self):
            return out.asleep()

    c._out = Interrupted()
    c.grant(3)
    assert entered and f.recv() == [7, 3] and f.recv() == [7, 5]
    c._out = out
    c.close(timeout=0.5)


def test_close_in_the_middle_of_a_lane_write_keeps_the_mapping(fake):
    """close() from a signal handler (or anything else that runs in the
    writing thread) while a lane write is under way: the locks are
    re-entrant, so close() gets in, but it must not unmap the segment under
    the write, which then goes on (it used to crash the process)."""
    f, c = shm_fake(fake)
    out = c._out
    closed = []

    class Interrupted:
        def write(self, b, off=0):
            if not closed:
                closed.append(1)
                c.close(timeout=0.1)  # what the SIGTERM handler does, in this thread
            return out.write(b, off)

        def asleep(self):
            return out.asleep()
    c._out = Interrupted()
    try:
        c.grant(1)
    except OSError:
        pass  # the doorbell after it may find the socket closed
    assert closed and c._seg is not None  # left to the garbage collector


def test_close_in_the_middle_of_a_read_returns_promptly(fake):
    """close() in the thread that reads the lane (a signal handler during
    next()): it cannot wait for that thread to let go of the socket, so it
    neither waits nor unmaps."""
    f, c = shm_fake(fake)
    rd = c._rd
    real = rd.wait
    took = []

    def wait(timeout, poller):
        if not took:
            t0 = time.monotonic()
            c.close(timeout=0.1)
            took.append(time.monotonic() - t0)
        return real(timeout, poller)
    rd.wait = wait
    with pytest.raises(cudashare.Closed):
        c.next(timeout=2)
    assert took and took[0] < 1.5, took
    assert c._seg is not None


def test_shm_calls_after_unmap_raise(fake):
    f, c = shm_fake(fake)
    out, rin = c._out, c._rd.lane
    c.close(timeout=0.5)
    assert c._seg is None
    for call in (lambda: out.write(b"x"), out.asleep, rin.ready, lambda: rin.read(10), rin.sleep):
        with pytest.raises(OSError):
            call()


@pytest.mark.parametrize("shm_on", [False, True])
def test_failed_write_leaves_the_producers_error_to_the_reader(fake, shm_on):
    """The producer says why and closes; a write of the application's fails
    before the reader has read the why: the end is the producer's error,
    not a vanished producer."""
    f, c = (shm_fake(fake) if shm_on else connected(fake))
    c._user_t = time.monotonic() + 1e6  # the background reader stays off the socket
    time.sleep(0.1)
    assert c._rtok.acquire(timeout=2)
    try:
        why = [9, E.TIMEOUT, "dropped: too slow"]
        if shm_on:
            f.raw(frame(why))  # errors go on the socket of a shm connection
        else:
            f.send(why)
        f.conn.close()
        f.conn = None
        time.sleep(0.05)
        with pytest.raises(OSError):
            for _ in range(LANE):
                c.grant(1)
    finally:
        c._rtok.release()
    with pytest.raises(cudashare.ProtocolError) as ei:
        c.next(timeout=2)
    assert ei.value.remote and ei.value.code == E.TIMEOUT
    c.close(timeout=0.2)


def test_segment_shrunk_between_checks(monkeypatch):
    """A producer that sends an unsealed segment of the right size, shrinks
    it to nothing just after the consumer's fstat and then seals it, passes
    a look at the size followed by one at the seals: the consumer would map
    a segment with no pages and die of SIGBUS at its first access. The
    seals come first: once sealed, the size read is the size mapped."""
    fd = os.memfd_create("cudashare-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, shm.SEG_SIZE)
        real = os

        class HostileOS:
            """os, whose fstat lets the producer act right after it."""
            def __getattr__(self, name):
                return getattr(real, name)

            def fstat(self, f):
                st = real.fstat(f)
                if f == fd:
                    real.ftruncate(fd, 0)
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                return st

        monkeypatch.setattr(shm, "os", HostileOS())
        try:
            seg = shm.Segment(fd)
        except cudashare.ProtocolError as e:
            assert e.code == E.MALFORMED and "sealed" in str(e), e
        else:
            size = real.fstat(fd).st_size
            seg.close()  # untouched: every access would fault
            pytest.fail("the consumer mapped a segment that now has %d bytes: its first access dies of SIGBUS" % size)
    finally:
        os.close(fd)
