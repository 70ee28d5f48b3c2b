"""The DLPack capsule protocol on the sim backend (kDLCPU), with a fake
framework that consumes capsules through the CPython C API as torch does:
PyCapsule_GetPointer("dltensor"), rename to "used_dltensor", deleter when
its tensor dies. No leak of slots, leases or memory."""

import ctypes
import gc
import os
import tracemalloc
import weakref

import pytest

import cudashare
from cudashare import _dlpack as dlpack
from fakeproducer import sim_memfd
from test_fake_producer import MiB2, connected

_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))
_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
_USED = ctypes.create_string_buffer(b"used_dltensor")


def consume(cap):
    p = _GetPointer(cap, b"dltensor")
    assert _SetName(cap, _USED) == 0
    return p, dlpack.DLManagedTensor.from_address(p)


def lease_of(fake, meta=None, size=4096):
    f, c = connected(fake)
    fd = sim_memfd(MiB2, 5)
    f.offer(1, size=size, offset=8192, kind=1, nfds=1, fds=[fd], meta=meta or {"batch": 1})
    os.close(fd)
    return f, c, c.next(timeout=5)


def test_capsule_contents_and_consumed_protocol(fake):
    f, c, l = lease_of(fake, {"dtype": "float32", "shape": [2, 3, 4]})
    base = dlpack.live()
    cap = l.__dlpack__()
    assert type(cap).__name__ == "PyCapsule" and _IsValid(cap, b"dltensor")
    p, mt = consume(cap)
    t = mt.dl_tensor
    assert t.data == l.ptr and (t.device.device_type, t.device.device_id) == (dlpack.K_DL_CPU, 0)
    assert t.ndim == 3 and [t.shape[i] for i in range(3)] == [2, 3, 4] and not t.strides
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1) and t.byte_offset == 0
    del cap
    gc.collect()
    assert dlpack.live() == base + 1  # consumed: the capsule's end does not delete; the "tensor" holds it
    w = weakref.ref(l)
    l.release()
    del l
    gc.collect()
    assert w() is not None  # the tensor keeps the Lease object alive (its memory is the producer's again)
    mt.deleter(p)  # the tensor dies after the release: safe
    mt.deleter(p)  # a second call is ignored
    gc.collect()
    assert w() is None and dlpack.live() == base
    assert f.recv_until(4) == [4, [1]]
    c.close(timeout=0.5)


def test_unconsumed_capsule_deletes_itself(fake):
    f, c, l = lease_of(fake)
    base = dlpack.live()
    cap = l.__dlpack__()
    t = dlpack.DLManagedTensor.from_address(_GetPointer(cap, b"dltensor")).dl_tensor
    assert t.ndim == 1 and t.shape[0] == 4096 and (t.dtype.code, t.dtype.bits) == (1, 8)
    assert dlpack.live() == base + 1
    del cap, t
    assert dlpack.live() == base
    l.release()
    c.close(timeout=0.5)


def test_no_leak_and_slots_reused(fake):
    f, c, l = lease_of(fake, {"dtype": "uint8", "shape": [64, 64]})
    # Another module changing ctypes.pythonapi's shared prototypes does not matter.
    ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    for _ in range(200):  # warm: slots, templates
        p, mt = consume(l.__dlpack__())
        mt.deleter(p)
        l.__dlpack__()  # dropped unconsumed
    gc.collect()
    slots = len(dlpack._addr)
    tracemalloc.start()
    snap = tracemalloc.take_snapshot()
    for i in range(5000):
        cap = l.__dlpack__()
        if i % 2:
            p, mt = consume(cap)
            del cap
            mt.deleter(p)
        else:
            del cap
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap, "filename"))
    tracemalloc.stop()
    assert grown < 64 * 1024, grown
    assert len(dlpack._addr) == slots and dlpack.live() == 0
    held = [l.__dlpack__() for _ in range(100)]  # many at once: more slots, then all back
    assert dlpack.live() == 100
    del held
    assert dlpack.live() == 0
    l.release()
    c.close(timeout=0.5)


def test_released_lease_refuses_dlpack(fake):
    f, c, l = lease_of(fake)
    l.release()
    try:
        l.__dlpack__()
    except cudashare.Closed:
        pass
    else:
        raise AssertionError("no Closed")
    assert dlpack.live() == 0
    c.close(timeout=0.5)


class FakeTensor:
    """What a framework's from_dlpack returns: it takes the capsule through
    the DLPack protocol, as torch does, and calls the deleter when it dies."""

    made = 0

    def __init__(self, obj, stream=None):
        FakeTensor.made += 1
        cap = obj.__dlpack__(stream=stream)
        self.p, mt = consume(cap)
        t = mt.dl_tensor
        self.data = t.data
        self.shape = tuple(t.shape[i] for i in range(t.ndim))
        self.dtype = (t.dtype.code, t.dtype.bits)
        self.deleter = mt.deleter

    def data_ptr(self):
        return self.data

    def __del__(self):
        self.deleter(self.p)


def fake_from_dlpack(obj):
    return FakeTensor(obj)


def other_from_dlpack(obj):
    return FakeTensor(obj)


class FakeCopy:
    """A converter's result that is a copy (as jaxlib makes of a buffer it
    finds unaligned): another address, the bytes of the moment."""

    def __init__(self, obj):
        t = FakeTensor(obj)
        self.bytes = ctypes.string_at(t.data, 8)
        self.buf = ctypes.create_string_buffer(self.bytes)

    def data_ptr(self):
        return ctypes.addressof(self.buf)


class Opaque:
    """A converter's result whose address this package cannot read."""

    def __init__(self, obj):
        self.t = FakeTensor(obj)


def offer_range(f, c, seq, first=False, meta=None, offset=8192, size=4096, fill=5):
    """Offers seq in allocation 1 (the first offer brings its memfd) and
    returns the lease."""
    if first:
        fd = sim_memfd(MiB2, fill)
        f.offer(seq, size=size, offset=offset, kind=1, nfds=1, fds=[fd], meta=meta or {"batch": seq})
        os.close(fd)
    else:
        f.offer(seq, size=size, offset=offset, kind=1, meta=meta or {"batch": seq})
    return c.next(timeout=5)


def test_array_is_made_once_per_range_and_reused(fake):
    f, c = connected(fake)
    base, made = dlpack.live(), FakeTensor.made
    l1 = offer_range(f, c, 1, first=True)
    v1 = l1.array(fake_from_dlpack, None)
    assert isinstance(v1, FakeTensor) and v1.data == l1.ptr and v1.shape == (4096,) and v1.dtype == (1, 8)
    assert l1.array(fake_from_dlpack, None) is v1
    l1.release()
    # The next lease of the same range gets the same view: no capsule, no
    # framework call.
    l2 = offer_range(f, c, 2)
    assert l2.array(fake_from_dlpack, None) is v1 and FakeTensor.made == made + 1
    # Another converter, size, or dtype and shape, is another view.
    v2 = l2.array(other_from_dlpack, None)
    assert v2 is not v1 and v2.data == v1.data
    l2.release()
    l3 = offer_range(f, c, 3, size=2048)
    v3 = l3.array(fake_from_dlpack, None)
    assert v3 is not v1 and v3.shape == (2048,) and v3.data == v1.data
    l3.release()
    l4 = offer_range(f, c, 4, meta={"batch": 4, "dtype": "float32", "shape": [4, 8]})
    v4 = l4.array(fake_from_dlpack, None)
    assert v4 is not v1 and v4.shape == (4, 8) and v4.dtype == (2, 32)
    assert l4.array(fake_from_dlpack, None) is v4
    l4.release()
    assert dlpack.live() == base + 4 and FakeTensor.made == made + 4
    assert c._n_views == 4
    # Retire, with a released lease still referenced: the consumer drops
    # its views before it unmaps, and their slots return.
    del v1, v2, v3, v4, l1, l2, l3
    f.send([5, 1])
    assert f.recv_until(6) == [6, 1]
    gc.collect()
    assert dlpack.live() == base and c._n_views == 0
    assert l4.released
    c.close(timeout=0.5)


def test_array_keeps_its_lease_until_release(fake):
    """A view in use keeps its lease from the garbage collector (which
    would release it under the view), as a tensor of __dlpack__ does; after
    the release it keeps nothing."""
    f, c = connected(fake)
    v = offer_range(f, c, 1, first=True).array(fake_from_dlpack, None)  # the lease is a temporary
    gc.collect()
    assert c.stats().get("leaked", 0) == 0 and c.stats()["releases"] == 0
    (w,) = [r for r in c._outstanding.values()]
    l = w()
    assert l is not None and not l.released and v.data == l.ptr
    l.release()
    del l
    gc.collect()
    assert w() is None  # released: the cached view no longer holds it
    l2 = offer_range(f, c, 2)
    assert l2.array(fake_from_dlpack, None) is v
    w2 = weakref.ref(l2)
    del l2
    gc.collect()
    assert w2() is not None and c.stats().get("leaked", 0) == 0  # pinned again by the view it was handed
    w2().release()
    gc.collect()
    assert w2() is None
    c.close(timeout=0.5)


def test_array_never_reuses_a_copy_or_an_unknown_object(fake):
    """A converter that copies would give every later lease the first
    one's bytes if its result were reused; one whose address cannot be
    read might. Both are made anew each time, and keep their lease."""
    f, c = connected(fake)
    l1 = offer_range(f, c, 1, first=True, fill=1)
    c1 = l1.array(FakeCopy, None)
    assert c1.bytes == b"\x01" * 8
    o1 = l1.array(Opaque, None)
    assert l1.array(FakeCopy, None) is not c1 and l1.array(Opaque, None) is not o1
    w = weakref.ref(l1)
    l1.release()
    del l1
    gc.collect()
    assert w() is not None  # c1 and o1 keep it, as __dlpack__'s tensors do
    ctypes.memset(o1.t.data, 2, 4096)  # the producer's next batch in that range
    l2 = offer_range(f, c, 2)
    assert l2.array(FakeCopy, None).bytes == b"\x02" * 8
    assert c._n_views == 0
    del c1, o1
    gc.collect()
    assert w() is None
    l2.release()
    c.close(timeout=0.5)
    gc.collect()
    assert dlpack.live() == 0


def test_array_views_die_with_the_consumer(fake):
    f, c = connected(fake)
    base = dlpack.live()
    l = offer_range(f, c, 1, first=True)
    l.array(fake_from_dlpack, None)
    l.release()
    assert dlpack.live() == base + 1
    c.close(timeout=0.5)
    gc.collect()
    assert dlpack.live() == base


def test_array_cache_is_bounded(fake, monkeypatch):
    """A producer that offers ever new ranges (or a caller with a new
    converter per call) cannot grow the cache past MAX_VIEWS per
    allocation, nor past MAX_VIEWS_TOTAL in all; past them each call makes
    a view that keeps its lease alive, as __dlpack__'s do."""
    from cudashare import _views as views_mod
    monkeypatch.setattr(views_mod, "MAX_VIEWS_TOTAL", views_mod.MAX_VIEWS + 2)
    f, c = connected(fake, credits=1)
    base = dlpack.live()
    n = views_mod.MAX_VIEWS + 3
    held = []
    seq = 0
    for alloc in (1, 2):
        fd = sim_memfd(MiB2, 5)
        for i in range(n if alloc == 1 else 4):
            seq += 1
            if i == 0:
                f.offer(seq, alloc_id=alloc, size=256, offset=0, kind=1, nfds=1, fds=[fd], meta={"batch": seq})
                os.close(fd)
            else:
                f.offer(seq, alloc_id=alloc, size=256, offset=256 * i, kind=1, meta={"batch": seq})
            l = c.next(timeout=5)
            v = l.array(fake_from_dlpack, None)
            assert v.data == l.ptr
            cached = i < views_mod.MAX_VIEWS if alloc == 1 else i < 2
            assert (l.array(fake_from_dlpack, None) is v) == cached
            if not cached:
                held.append((weakref.ref(l), v))
            l.release()
            assert f.recv_until(4) == [4, [seq]]  # read, as a producer does (a socket holds only so many)
            del l
    assert c._n_views == views_mod.MAX_VIEWS_TOTAL
    gc.collect()
    assert all(w() is not None for w, _ in held)  # the views not cached keep their leases
    assert dlpack.live() == base + views_mod.MAX_VIEWS_TOTAL + len(held)
    del held, v
    gc.collect()
    assert dlpack.live() == base + views_mod.MAX_VIEWS_TOTAL
    c.close(timeout=0.5)
    gc.collect()
    assert dlpack.live() == base


class Recording:
    """The sim backend as a GPU backend that records the stream waits."""

    on_host = False

    def __init__(self, b):
        self.b = b
        self.waits = []

    def __getattr__(self, name):
        return getattr(self.b, name)

    def open_event(self, handle):
        return 0xE1

    def wait_event(self, ev, stream):
        self.waits.append((ev, stream))


def test_array_orders_the_named_stream_once_per_lease(fake):
    """The stream array() names waits on each lease's event, once per lease
    and stream (None and 1: the legacy default stream, 0; -1: none), and
    so does the stream a converter names through DLPack."""
    f, c = connected(fake)
    rec = c._backend = Recording(c._backend)
    c._on_host = rec.on_host  # what leases ask (_lease.py: the consumer keeps the backend's)

    class S:
        cuda_stream = 7

    def named(obj):
        return FakeTensor(obj, stream=9)

    fd = sim_memfd(MiB2, 5)
    f.offer(1, size=4096, offset=8192, kind=1, nfds=1, fds=[fd], meta={"batch": 1}, event=b"\x01" * 64)
    os.close(fd)
    l = c.next(timeout=5)
    v = l.array(fake_from_dlpack, 5)
    assert rec.waits == [(0xE1, 5)]
    assert l.array(fake_from_dlpack, 5) is v and l.array(fake_from_dlpack, S()) is v
    assert l.array(fake_from_dlpack, None) is v and l.array(fake_from_dlpack, 1) is v
    assert l.array(fake_from_dlpack, -1) is v
    assert rec.waits == [(0xE1, 5), (0xE1, 7), (0xE1, 0)]
    l.array(named, 3)
    assert rec.waits[3:] == [(0xE1, 3), (0xE1, 9)]  # ours, then the converter's
    l.release()
    f.offer(2, size=4096, offset=8192, kind=1, meta={"batch": 2}, event=b"\x01" * 64)
    l2 = c.next(timeout=5)
    del rec.waits[:]
    assert l2.array(fake_from_dlpack, 5) is v
    assert rec.waits == [(0xE1, 5)]  # every lease waits again
    l2.release()
    c.close(timeout=0.5)


def test_array_of_a_released_lease_and_a_capsule_taken_twice(fake):
    f, c, l = lease_of(fake)
    l.release()
    with pytest.raises(cudashare.Closed):
        l.array(fake_from_dlpack, None)

    def twice(obj):
        obj.__dlpack__()
        obj.__dlpack__()

    f.offer(2, size=4096, offset=8192, kind=1, meta={"batch": 2})
    l2 = c.next(timeout=5)
    with pytest.raises(BufferError):
        l2.array(twice, None)
    gc.collect()
    assert dlpack.live() == 0
    l2.release()
    c.close(timeout=0.5)


def test_leases_refuse_views_after_a_bad_end_and_close(fake):
    """A producer that vanishes with a lease out, then close(): the lease's
    mapping is closed, so the lease is released and refuses ptr, views and
    capsules (no pointer into unmapped memory)."""
    f, c = connected(fake)
    l = offer_range(f, c, 1, first=True)
    f.conn.close()
    try:
        c.next(timeout=5)
    except cudashare.ProducerGone:
        pass
    c.close(timeout=0.5)
    assert l.released
    for use in (lambda: l.ptr, lambda: l.array(fake_from_dlpack, None), l.__dlpack__):
        with pytest.raises(cudashare.Closed):  # no view of an unmapped lease
            use()
    l.release()  # idempotent, no error
    gc.collect()
    assert dlpack.live() == 0


def test_a_lease_dropped_with_its_view_is_given_back(fake):
    """array()'s pins keep a lease from the garbage collector while its
    view may be in use; one the application dropped without release, view
    and all, is found when next() would wait with every credit held, and
    at a retire, and released as the collector would have (leaked, with a
    warning). Not while the application still holds the view, or the lease."""
    import warnings as w
    f, c = connected(fake, credits=1)
    l = offer_range(f, c, 1, first=True)
    v = l.array(fake_from_dlpack, None)
    wl = weakref.ref(l)
    del l
    gc.collect()
    # The view is still held: the lease is not given back.
    try:
        c.next(timeout=0.3)
    except cudashare.Timeout:
        pass
    assert wl() is not None and c.stats().get("leaked", 0) == 0
    # Both dropped: the next wait gives it back.
    del v
    with w.catch_warnings(record=True) as got:
        w.simplefilter("always")
        try:
            c.next(timeout=0.3)
        except cudashare.Timeout:
            pass
    assert c.stats().get("leaked", 0) == 1 and any("dropped without release" in str(g.message) for g in got)
    assert f.recv_until(4) == [4, [1]]
    gc.collect()
    assert wl() is None
    # The lease held, its view dropped: kept.
    l2 = offer_range(f, c, 2)
    l2.array(fake_from_dlpack, None)
    try:
        c.next(timeout=0.3)
    except cudashare.Timeout:
        pass
    assert not l2.released and c.stats().get("leaked", 0) == 1
    # Dropped, then the producer retires the allocation: given back, and
    # the retire answered.
    del l2
    gc.collect()
    with w.catch_warnings(record=True):
        w.simplefilter("always")
        f.send([5, 1])
        assert f.recv_until(4) == [4, [2]]
        assert f.recv_until(6) == [6, 1]
    assert c.stats()["leaked"] == 2
    c.close(timeout=0.5)
    gc.collect()
    assert dlpack.live() == 0


def test_after_a_bad_end_views_keep_what_they_need_and_no_more(fake):
    """After the producer vanished, a consumer dropped without close() and
    a lease dropped without release: a view the application still holds
    keeps its lease, the consumer and the mapping (its memory stays
    readable, as with a __dlpack__ tensor); once it drops the view too,
    the consumer is collected, closes, and every slot returns."""
    f, c = connected(fake)
    l = offer_range(f, c, 1, first=True, fill=7)
    v = l.array(fake_from_dlpack, None)
    f.conn.close()
    try:
        c.next(timeout=5)
    except cudashare.ProducerGone:
        pass
    wc = weakref.ref(c)
    c._reader.join(5)
    del c, l
    gc.collect()
    assert wc() is not None and ctypes.string_at(v.data, 4) == b"\x07" * 4
    del v
    gc.collect()
    assert wc() is None
    gc.collect()
    assert dlpack.live() == 0


def test_stale_and_duplicate_pins_do_not_loosen_the_check(fake):
    """Two leases of one range out at once (PROTOCOL.md does not forbid
    it): the second takes the view's pin. The first, still held by the
    application (in a dict), is not taken for dropped; nor is a lease
    that asked for its view twice."""
    f, c = connected(fake, credits=2)
    l1 = offer_range(f, c, 1, first=True)
    v = l1.array(fake_from_dlpack, None)
    v2 = l1.array(other_from_dlpack, None)
    f.offer(2, size=4096, offset=8192, kind=1, meta={"batch": 2})
    l2 = c.next(timeout=5)
    assert l2.array(fake_from_dlpack, None) is v
    assert l1.array(fake_from_dlpack, None) is v  # back to l1: its pin once, not twice
    assert type(l1._pins) is list and len(l1._pins) == 2
    held = {1: l1, 2: l2}
    del l1, l2, v, v2
    gc.collect()
    with c._lock:
        c._reap_orphans()
    assert c.stats().get("leaked", 0) == 0 and not held[1].released and not held[2].released
    held[1].release()
    held[2].release()
    c.close(timeout=0.5)


def test_a_lost_lease_is_given_back_with_credits_to_spare(fake):
    """A producer may offer fewer buffers than the credits (a small ring,
    -max-leases, broadcast, several consumers): the look for lost leases
    does not wait for every credit to be held."""
    import warnings as w
    f, c = connected(fake, credits=4)
    l = offer_range(f, c, 1, first=True)
    l.array(fake_from_dlpack, None)
    del l
    gc.collect()
    with w.catch_warnings(record=True):
        w.simplefilter("always")
        try:
            c.next(timeout=0.3)
        except cudashare.Timeout:
            pass
    assert c.stats().get("leaked", 0) == 1
    assert f.recv_until(4) == [4, [1]]
    c.close(timeout=0.5)
